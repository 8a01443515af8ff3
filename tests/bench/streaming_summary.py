"""bench_streaming.py's rows made into its printed lines: one per bench from one tree's runs, and the
headline figures of two trees side by side (`--before`)."""

from __future__ import annotations

import statistics


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _io(rows: list[dict]) -> dict | None:
    """How the drives were driven in the median-speed run: read sizes, queue depth, idle gaps, alignment, buffer reuse."""
    run_ = sorted(rows, key=lambda r: r["decode_tok_s"])[len(rows) // 2]
    io = run_.get("io")
    if not io:
        return None
    drives = io["drives"]
    return {
        "read_mode": io["read_mode"],
        "o_direct": io["o_direct"],
        "buffers_reused": io["buffers_reused"],
        "buffers_allocated": io["buffers_allocated"],
        "mean_read_bytes": [d["mean_read_bytes"] for d in drives],
        "mean_queue_depth": [d["mean_queue_depth"] for d in drives],
        "max_queue_depth": [d["max_queue_depth"] for d in drives],
        "misaligned_reads": sum(d["misaligned_reads"] for d in drives),
        # where the time between reads goes: drive idle (nothing queued: the model computing between
        # layers, or waiting on the last read of a layer elsewhere) as a share of the run's wall time
        "drive_idle_fraction": [round(d["idle_s"] / run_["wall_s"], 3) for d in drives],
        "idle_gaps": [d["idle_gaps"] for d in drives],
        "io_wait_fraction": round(run_["io_wait_s"] / run_["wall_s"], 3),
        "wall_s": round(run_["wall_s"], 3),
        "between_reads": run_.get("between_reads"),
        "paired_raw_gb_s": run_.get("paired_raw_gb_s"),
        # the read path alone: bytes over the time some read was in flight on the slowest drive
        "busy_gb_s": round(
            sum(d["bytes"] for d in drives) / max(d["span_s"] - d["idle_s"] for d in drives) / 1e9,
            3,
        ),
    }


def _drive_gb_s(row: dict) -> float:
    return row.get("drive_bytes", row["bytes_read"]) / row["wall_s"] / 1e9


def summarize(res: dict[str, list[dict]], t: int, cap_mb_s: float) -> list[dict]:
    """One line per bench from one tree's runs (an older tree ran only the whole-record configurations)."""
    out = []
    raw = max((median(res[k], "raw_gb_s") for k in ("raw", "raw_rec") if k in res), default=None)
    eff = {
        "bench": "streaming_efficiency",
        "raw_odirect_gb_s": raw and round(raw, 3),
        "raw_by_read_size": {
            str(r[0]["raw_read_bytes"]): round(median(r, "raw_gb_s"), 3)
            for r in (res.get("raw"), res.get("raw_rec"))
            if r
        },
    }
    for key in EFF_KEYS:
        rows = res.get(key)
        if not rows:
            continue
        needed, drive = median(rows, "read_gb_s"), statistics.median(_drive_gb_s(r) for r in rows)
        paired = all(
            "paired_raw_gb_s" in r for r in rows
        )  # uncapped: each run's own raw, read around it
        capped = rows[0].get("cap_gb_s")  # capped: the caps are the reference
        refs = [
            r.get("paired_raw_gb_s") or capped or raw for r in rows
        ]  # each run's reference rate
        ratios = (
            [r["read_gb_s"] / x for r, x in zip(rows, refs, strict=True)] if all(refs) else None
        )
        ref = _io(rows)  # the median-speed run's read path
        ref_raw = ref and (ref["paired_raw_gb_s"] or capped or raw)
        eff[key] = {
            "decode_tok_s": round(median(rows, "decode_tok_s"), 3),
            "needed_gb_s": round(needed, 3),
            "drive_gb_s": round(drive, 3),
            "ratio": ratios and round(statistics.median(ratios), 3),
            "ratio_range": ratios and [round(min(ratios), 3), round(max(ratios), 3)],
            "drive_ratio": ratios
            and round(
                statistics.median(_drive_gb_s(r) / x for r, x in zip(rows, refs, strict=True)), 3
            ),
            "reference": "paired raw O_DIRECT"
            if paired
            else f"caps, {capped} GB/s"
            if capped
            else "raw O_DIRECT",
            "paired_raw_gb_s": [
                [round(x, 3) for x in r.get("paired_raw_before_after", [r["paired_raw_gb_s"]])]
                for r in rows
            ]
            if paired
            else None,
            "busy_ratio": ref_raw and round(ref["busy_gb_s"] / ref_raw, 3),
            "bytes_per_token": int(median(rows, "bytes_read") / (t + 3)),
            "cpu_ms_per_token": round(1e3 * median(rows, "cpu_s") / (t + 3), 1),
            "io": ref,
        }
        # prefetch on: how well the next layer was predicted, and what its early pieces became
        if key.startswith("stream"):
            last = rows[-1]
            eff[key] |= {
                "recall_by_layer": last["recall_by_layer"],
                "precision_by_layer": last["precision_by_layer"],
                "prefetch_used_wasted": [last["prefetch_used"], last["prefetch_wasted"]],
                "prefetch_pieces": (last.get("io") or {}).get("prefetch_pieces"),
            }
    out.append(eff)
    scaling: dict = {"bench": "drive_scaling", "cap_mb_s_per_drive": cap_mb_s, "prefetch": False}
    for name, prefix in (("whole", "cap"), ("stripe", "caps")):
        if f"{prefix}2" not in res or "cap1" not in res:
            continue
        tok = {
            n: median(res[f"{prefix}{n}" if n > 1 else "cap1"], "decode_tok_s")
            for n in (1, 2, 3, 4)
        }
        scaling[name] = {
            "tok_s": {n: round(v, 3) for n, v in tok.items()},
            "speedup": {n: round(v / tok[1], 3) for n, v in tok.items()},
            "per_drive_efficiency_at_4": round(tok[4] / tok[1] / 4, 3),
        }
    out.append(scaling)
    if "stream" in res and "stripe" in res:
        on, off = median(res["stream"], "decode_tok_s"), median(res["stripe"], "decode_tok_s")
        out.append(
            {
                "bench": "prefetch_value",
                "ratio_on_off": round(on / off, 3),
                "tok_s_on_off": [round(on, 3), round(off, 3)],
                "recall_by_layer": res["stream"][-1]["recall_by_layer"],
                "precision_by_layer": res["stream"][-1]["precision_by_layer"],
            }
        )
    if "mem" not in res:
        return out
    mem = res["mem"]
    peak = median(mem, "peak_rss_bytes")
    # The denominator is what the budgets allow: the spine as held (compute dtype) plus the cache budget.
    budget = mem[0].get("spine_resident_bytes", 2 * mem[0]["spine_bytes"]) + (1 << 30)
    runtime = median(mem, "runtime_rss_bytes") if "runtime_rss_bytes" in mem[0] else None
    out.append(
        {
            "bench": "memory",
            "peak_rss_bytes": int(peak),
            "spine_resident_plus_cache_bytes": budget,
            "ratio": round(peak / budget, 3),
            "runtime_rss_bytes": runtime and int(runtime),
            "ratio_without_runtime": runtime and round((peak - runtime) / budget, 3),
        }
    )
    return out


EFF_KEYS = ("whole", "stripe", "stream", "stripe_cap", "stream_cap")


def before_after(before: list[dict], after: list[dict]) -> dict:
    """The headline figures of both trees side by side: [before, after]."""
    b, a = ({line["bench"]: line for line in lines} for lines in (before, after))
    pair = lambda get: [_get(b, get), _get(a, get)]  # noqa: E731
    return {
        "efficiency_ratio": {k: pair(("streaming_efficiency", k, "ratio")) for k in EFF_KEYS},
        "decode_tok_s": {k: pair(("streaming_efficiency", k, "decode_tok_s")) for k in EFF_KEYS},
        "drive_idle_fraction": {
            k: pair(("streaming_efficiency", k, "io", "drive_idle_fraction")) for k in EFF_KEYS
        },
        "scaling_at_4": {k: pair(("drive_scaling", k, "speedup", 4)) for k in ("whole", "stripe")},
        "prefetch_on_off": pair(("prefetch_value", "ratio_on_off")),
        "memory_ratio": pair(("memory", "ratio")),
    }


def _get(d: dict, path: tuple) -> object:
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d
