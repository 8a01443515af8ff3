"""Drive-side measurements for bench_streaming.py.

`raw_odirect` is the reference the decode is measured against: plain threads doing
O_DIRECT preadv of the same pack bytes, written here without deltafind's reader.
`time_fetches` and `between_reads` time a decode's layer fetches: where the time around the reads goes.
`barrier_bounds` is the arithmetic behind the placement choice (whole records,
stripes, or hot copies on two drives with each read sent to the less loaded copy).
"""

from __future__ import annotations

import itertools
import mmap
import os
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def raw_odirect(store: Path, queue_depth: int = 8, read_bytes: int = 1 << 20) -> dict:
    """Read every record's bytes once, `queue_depth` reads in flight per drive, with O_DIRECT."""
    from deltafind.store.manifest import Manifest, pack_name

    m = Manifest.load(store)
    paths = [d / pack_name(i, m.pack_generation) for i, d in enumerate(m.drive_paths(store))]
    jobs: list[list[tuple[int, int]]] = [[] for _ in paths]
    for r in m.experts:
        for e in r.extents():
            jobs[e.drive] += [
                (o, min(read_bytes, e.offset + e.nbytes - o))
                for o in range(e.offset, e.offset + e.nbytes, read_bytes)
            ]
    fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p in paths]
    local = threading.local()

    def read(fd: int, off: int, n: int) -> int:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = mmap.mmap(-1, read_bytes)
        return os.preadv(fd, [memoryview(buf)[:n]], off)

    pools = [ThreadPoolExecutor(queue_depth) for _ in paths]
    t0 = time.perf_counter()
    futs = [
        pool.submit(read, fd, off, n)
        for pool, fd, js in zip(pools, fds, jobs, strict=True)
        for off, n in js
    ]
    total = sum(f.result() for f in futs)
    dt = time.perf_counter() - t0
    for pool in pools:
        pool.shutdown()
    for fd in fds:
        os.close(fd)
    return {
        "raw_gb_s": total / dt / 1e9,
        "raw_read_bytes": read_bytes,
        "raw_queue_depth": queue_depth,
    }


def barrier_bounds(store: Path, top_k: int = 8, samples: int = 4000) -> dict[str, float]:
    """Best speedup over one drive when each layer's reads must land before the next layer starts,
    for uniform routes (as the synthetic router's are): reads per layer ÷ the busiest drive's share,
    for the store's actual placement, for every record striped, and for every expert copied to two
    drives with each read sent to the copy whose drive has fewer bytes queued (ARGODRIVE's rule)."""
    from deltafind.store.manifest import Manifest

    m = Manifest.load(store)
    n = len(m.drives)
    share = {r.key: Counter({e.drive: e.nbytes for e in r.extents()}) for r in m.experts}
    size = {r.key: sum(e.nbytes for e in r.extents()) for r in m.experts}
    home = {r.key: r.drive for r in m.experts}
    layers = sorted({k[0] for k in share})
    experts = {layer: sorted(k for k in share if k[0] == layer) for layer in layers}
    rng = random.Random(0)
    total = actual = striped = replicated = 0.0
    for _ in range(samples):
        for layer in layers:
            picks = rng.sample(experts[layer], min(top_k, len(experts[layer])))
            load: Counter = Counter()
            for k in picks:
                load.update(share[k])
            queued = [0.0] * n
            for k in picks:  # copies on drive d and d + 1
                d = home[k]
                pick = min((d, (d + 1) % n), key=lambda i: queued[i])
                queued[pick] += size[k]
            bytes_ = sum(size[k] for k in picks)
            total += bytes_
            actual += max(load.values())
            striped += bytes_ / n
            replicated += max(queued)
    return {
        "placement_actual": round(total / actual, 3),
        "stripe_all": round(total / striped, 3),
        "replicate_2_least_queued": round(total / replicated, 3),
    }


def page_cache_bytes() -> int:
    """The kernel's page cache ("Cached" in /proc/meminfo): what buffered reads leave behind."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Cached:"))


def drop_store_from_page_cache(store: Path) -> None:
    """Evict the store's pack files from the page cache, so a buffered run starts cold too."""
    from deltafind.store.manifest import Manifest, pack_name

    m = Manifest.load(store)
    for i, d in enumerate(m.drive_paths(store)):
        fd = os.open(d / pack_name(i, m.pack_generation), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def device_read_bytes() -> int:
    """Bytes this process made the block layer read (/proc/self/io read_bytes, all threads): O_DIRECT
    and page-cache misses count, page-cache hits do not."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def time_fetches(experts: object) -> list[list[tuple[str, float]]]:
    """Record when each fetch starts, when each expert reaches the model, and when it ends (wraps
    the provider's `fetch`; what it yields is unchanged)."""
    log: list[list[tuple[str, float]]] = []
    inner = experts.fetch  # type: ignore[attr-defined]

    def fetch(layer_idx, expert_ids):
        events = [("start", time.perf_counter())]
        log.append(events)
        for item in inner(layer_idx, expert_ids):
            events.append(("got", time.perf_counter()))
            yield item
        events.append(("end", time.perf_counter()))

    experts.fetch = fetch  # type: ignore[attr-defined]
    return log


def between_reads(log: list[list[tuple[str, float]]]) -> dict:
    """Where a cold decode's time goes around the reads, per layer fetch (medians, ms): from the
    fetch's start to its first expert, to its end (the last expert computed), and from its end to
    the next fetch's start (attention, router, norms; lm_head and sampling between tokens) — in
    that last gap no read is queued unless a prefetch is."""
    import statistics as st

    done = [f for f in log if f[-1][0] == "end" and len(f) > 2]
    gaps = [b[0][1] - a[-1][1] for a, b in itertools.pairwise(done)]
    ms = lambda xs: round(1e3 * st.median(xs), 2) if xs else None  # noqa: E731
    return {
        "fetches": len(done),
        "first_expert_ms": ms([f[1][1] - f[0][1] for f in done]),
        "fetch_ms": ms([f[-1][1] - f[0][1] for f in done]),
        "last_expert_to_end_ms": ms([f[-1][1] - f[-2][1] for f in done]),
        "gap_to_next_fetch_ms": ms(gaps),
        "gap_share_of_wall": round(sum(gaps) / max(1e-9, done[-1][-1][1] - done[0][0][1]), 3)
        if gaps
        else None,
    }
