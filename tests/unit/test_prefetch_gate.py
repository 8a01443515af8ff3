"""The prefetch gate: reads start only where a drive has slack and the layer's predictions pay.

The gate is pure policy over (drive, bytes) and real futures; these drive it with reads that
land after measured sleeps, so its rates and windows are measured as the store's are.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from deltafind.store.prefetch_gate import PrefetchGate, PrefetchOptions

MB = 1_000_000


def _landing(seconds: float) -> Future:
    fut: Future = Future()
    fut.set_running_or_notify_cancel()
    threading.Timer(seconds, fut.set_result, (None,)).start()
    return fut


def _measured(num_drives: int = 2, window_s: float = 0.2) -> PrefetchGate:
    """A gate whose drives each read 10 MB in ~0.1 s (~100 MB/s) and whose layer 1 took `window_s` at width 1."""
    gate = PrefetchGate(PrefetchOptions(), num_drives)
    futs = [_landing(0.1) for _ in range(num_drives)]
    for d, fut in enumerate(futs):
        gate.track(d, 10 * MB, fut)
    for fut in futs:
        fut.result()
    time.sleep(0.01)  # the done callbacks run on the timer threads
    gate.begin_step(1)
    gate.admit(
        1, [((1, 0), [(0, MB)])], 8
    )  # opens layer 1's window (no window yet: nothing starts)
    time.sleep(window_s)
    gate.fetch_started(1)
    gate.begin_step(1)
    return gate


def test_drive_rate_and_queue_are_measured_from_real_reads() -> None:
    gate = _measured()
    rate = gate.drives[0].rate
    assert (
        rate is not None and 40 * MB < rate < 110 * MB
    )  # 10 MB over >= 0.1 s (a loaded machine runs late)
    assert gate.drives[0].queued_bytes == 0
    slow = _landing(0.3)
    gate.track(0, 5 * MB, slow)
    assert gate.drives[0].queued_bytes == 5 * MB
    slow.result()
    time.sleep(0.01)
    assert gate.drives[0].queued_bytes == 0 and gate.drives[0].queued_reads == 0


def test_a_first_window_is_measured_before_anything_starts() -> None:
    gate = PrefetchGate(PrefetchOptions(), 1)
    gate.begin_step(1)
    assert gate.admit(3, [((3, 1), [(0, MB)])], 8) == []  # this layer and width were never timed
    assert gate.layers[3].held == 1 and gate.gated == 1


def test_a_layer_not_yet_timed_borrows_the_window_last_measured_at_its_width() -> None:
    # Keyed strictly by (layer, width), a step width first seen (a new batch size) prefetched nothing
    # on any layer: on the 8-layer bench that was the first two steps' whole idle time (RESULTS.md).
    gate = _measured(window_s=0.2)  # layer 1 timed at width 1: ~20 MB of slack per idle drive
    assert gate.admit(2, [((2, 0), [(0, 2 * MB)])], 8) == [
        ((2, 0), 2 * MB)
    ]  # layer 2 at width 1: layer 1's window
    gate.begin_step(4)
    assert gate.admit(2, [((2, 1), [(0, 2 * MB)])], 8) == []  # width 4 never timed: nothing starts


def test_an_idle_drive_takes_reads_up_to_its_slack_a_busy_one_none() -> None:
    gate = _measured(window_s=0.2)  # slack of an idle drive: ~0.2 s x ~100 MB/s = ~20 MB
    busy = [_landing(2.0) for _ in range(4)]
    for fut in busy:
        gate.track(
            0, 10 * MB, fut, speculative=True
        )  # drive 0: 40 MB of prefetch queued, ~0.4 s of work: past the window
    cands = [((1, e), [(e % 2, 2 * MB)]) for e in range(8)]  # alternate drives, best first
    started = gate.admit(1, cands, 8)
    assert started == [
        ((1, e), 2 * MB) for e in range(1, 8, 2)
    ]  # only drive 1's, all four (8 MB of its ~20 MB slack)
    gate.begin_step(1)
    many = [
        ((1, 100 + e), [(1, 4 * MB)]) for e in range(20)
    ]  # 80 MB for drive 1 alone: more than its slack
    n = len(gate.admit(1, many, 64))
    assert (
        2 <= n <= 8
    )  # what fits its slack (plus one a coin-flip precision may still pay for), never all 20
    assert len(gate.admit(1, many, 1)) <= 1  # and never more than the room given
    for fut in busy:
        fut.result()


def test_the_window_is_its_compute_part_plus_the_demand_drain_at_decision() -> None:
    # The decoder waits for the demand reads queued when the gate decides: they lengthen the window
    # (the other drive idles meanwhile). The window's compute part is measured from the moment the last
    # drive's demand ran out: a warm cache that hits more each token queues less, and a remembered
    # whole window then let whole records overrun it; the window less a drain estimated from rates was
    # a difference of two noisy numbers, 0-16 ms around a 5 ms truth (tests/bench/RESULTS.md, drives).
    gate = _measured(window_s=0.05)  # compute part ~0.05 s: ~5 MB of slack per idle drive
    drain = [_landing(0.3) for _ in range(3)]
    for fut in drain:
        gate.track(0, 10 * MB, fut)  # drive 0: 30 MB of demand, ~0.3 s the decoder waits for
    started = gate.admit(1, [((1, 1), [(1, 16 * MB)])], 8)
    assert started == [((1, 1), 16 * MB)]  # drive 1 idles ~0.35 s: the whole record fits its slack
    for fut in drain:
        fut.result()
    time.sleep(0.05)  # the compute after the demand landed
    gate.fetch_started(1)
    gate.begin_step(1)
    ((compute, _),) = gate._windows.values()
    assert (
        0.02 < compute < 0.2
    )  # since the demand ran out, not the whole ~0.35 s since the decision
    # the next step's layer queues no demand (the cache holds it): the slack is the compute part only
    [(_, n)] = gate.admit(1, [((1, 2), [(1, 16 * MB)])], 8)
    assert (
        n % gate.piece_bytes == 0 and n < 16 * MB
    )  # its first pieces inside ~0.05 s, not the 16 MB record


def test_a_confirmed_prefetch_is_demand_for_its_whole_record() -> None:
    # A prefetch of a record's first pieces is counted at those pieces, as speculation. Once the router
    # confirms it the decoder waits for all of it: counted as speculation still, a confirmed layer's reads
    # hid from the drain and the next layer's slack came out negative (every other layer prefetched nothing).
    gate = PrefetchGate(PrefetchOptions(), 2)
    read = _landing(0.3)
    gate.track(0, 2 * MB, read, speculative=True)
    gate.track(1, 2 * MB, read, speculative=True)
    assert [(d.queued_bytes, d.demand_bytes) for d in gate.drives] == [(2 * MB, 0), (2 * MB, 0)]
    gate.promote(read, [(0, 8 * MB), (1, 8 * MB)])
    assert [(d.queued_bytes, d.demand_bytes) for d in gate.drives] == [
        (8 * MB, 8 * MB),
        (8 * MB, 8 * MB),
    ]
    read.result()
    time.sleep(0.01)
    assert [(d.queued_bytes, d.demand_bytes, d.queued_reads) for d in gate.drives] == [
        (0, 0, 0),
        (0, 0, 0),
    ]
    assert gate.drives[0].busy_bytes == 8 * MB  # the drive read the whole record
    gate.promote(read, [(0, 8 * MB)])  # landed already: nothing left to count
    assert gate.drives[0].queued_bytes == 0


def test_a_striped_record_is_weighed_on_every_drive_it_loads() -> None:
    gate = _measured(
        window_s=0.05
    )  # ~5 MB of slack on each idle drive (more if the machine runs late)
    striped = [
        ((1, e), [(e % 2, 8 * MB), ((e + 1) % 2, 8 * MB)]) for e in range(2)
    ]  # home drives 0 and 1
    first, *rest = gate.admit(1, striped, 8)
    assert first == (
        (1, 0),
        8 * MB,
    )  # a coin-flip precision still pays for the first: most of it fits
    # the first took both drives' slack; the second, weighed on its home drive alone, looked free there
    assert all(n < 8 * MB and n % gate.piece_bytes == 0 for _, n in rest)


def test_demand_reads_a_fetch_holds_back_count_as_the_drives_work() -> None:
    # Under a cache budget a fetch queues 2 records per drive and holds the rest back until they land;
    # the drive is no freer for it (before this counted, a warm cache's prefetch lost 11 % on one drive).
    # The decoder waits for them, so they lengthen the window as queued demand does.
    gate = _measured(window_s=0.2)  # compute part ~0.2 s: ~20 MB of slack per idle drive
    gate.hold_back(0, 40 * MB)  # drive 0: 40 MB of this layer's demand still to queue, ~0.4 s
    cands = [((1, e), [(e % 2, 2 * MB)]) for e in range(40)]  # 40 MB for each drive
    started = [k for k, _ in gate.admit(1, cands, 64)]
    on0, on1 = sum(e % 2 == 0 for _, e in started), sum(e % 2 == 1 for _, e in started)
    assert (
        on1 == 20
    )  # drive 1 idles through drive 0's ~0.4 s and the ~0.2 s after: all of its 40 MB
    assert (
        5 <= on0 <= 15
    )  # drive 0 has only the ~0.2 s after its demand: ~20 MB (more if the machine ran late)
    assert gate.snapshot()["drives"][0]["held_back_bytes"] == 40 * MB
    gate.hold_back(0, -40 * MB)  # queued (then counted as queued) or dropped
    gate.begin_step(1)
    assert [k for k, _ in gate.admit(1, [((1, 4), [(0, 2 * MB)])], 8)] == [(1, 4)]
    gate.hold_back(
        0, 40 * MB
    )  # a fetch that errs or is abandoned leaves its held-back reads behind:
    gate.fetch_started(1)  # the next fetch starts from none
    assert gate.snapshot()["drives"][0]["held_back_bytes"] == 0


def test_a_layer_whose_predictions_miss_stops_after_warmup() -> None:
    gate = _measured(window_s=0.2)
    cand = [((1, 5), [(1, MB)])]
    assert gate.admit(1, cand, 8) == [((1, 5), MB)]  # idle drive, prior precision: it pays
    for _ in range(PrefetchOptions().warmup):
        gate.observe(1, {5, 6}, [7, 8])
    assert gate.layers[1].ema == 0.0 and gate.layers[1].precision == 0.0
    gate.begin_step(1)
    assert gate.admit(1, cand, 8) == []
    gate.observe(1, {5, 6}, [5, 6, 7, 8])
    assert gate.layers[1].recall == 2 / (4 * 2 + 4)  # hits over routed experts, all observations
    snap = gate.snapshot()
    assert snap["layers"][0]["layer"] == 1 and snap["layers"][0]["precision"] == round(2 / 10, 4)
    assert [d["drive"] for d in snap["drives"]] == [0, 1]


def test_precision_weighs_against_bytes_past_the_slack() -> None:
    gate = _measured(window_s=0.1)  # ~10 MB of slack per idle drive
    for _ in range(4):
        gate.observe(
            1, {1, 2, 3, 4}, [1, 2, 3, 4]
        )  # precision 1: a read past the slack costs nothing wasted
    gate.begin_step(1)
    assert len(gate.admit(1, [((1, e), [(0, 4 * MB)]) for e in range(8)], 8)) == 8
    for _ in range(3):
        gate.observe(
            1, {1, 2, 3, 4}, [1, 2, 9, 10]
        )  # precision -> ~0.6: reads past the slack now lose
    gate.begin_step(1)
    assert 1 <= len(gate.admit(1, [((1, e), [(0, 4 * MB)]) for e in range(8)], 8)) <= 4
    for _ in range(12):
        gate.observe(
            1, {1, 2, 3, 4}, [1, 9, 10, 11]
        )  # precision -> ~0.25, under recall_threshold 0.3
    gate.begin_step(1)
    started = gate.admit(1, [((1, e), [(0, 4 * MB)]) for e in range(8)], 8)
    # a closed layer reads only what fits the idle drive's ~10 MB slack, the last record in whole pieces
    assert 4 * MB <= sum(n for _, n in started) <= 11 * MB and len(started) <= 3
    assert all(n == 4 * MB or n % gate.piece_bytes == 0 for _, n in started)


def test_pieces_fill_the_slack_that_a_whole_record_would_overrun() -> None:
    gate = _measured(window_s=0.03)  # ~3 MB of slack per idle drive (more if the machine runs late)
    for _ in range(4):
        gate.observe(
            1, {1, 2}, [1, 9]
        )  # precision 0.5: a 16 MB record past a 5 MB slack loses as a whole
    gate.begin_step(1)
    [(key, n)] = gate.admit(1, [((1, 1), [(0, 16 * MB)])], 8)
    assert (
        key == (1, 1) and n % gate.piece_bytes == 0 and gate.piece_bytes <= n < 16 * MB
    )  # its first pieces only
    busy = _landing(1.0)
    gate.track(
        0, 40 * MB, busy, speculative=True
    )  # drive 0 now has ~0.4 s of prefetch queued: no slack, no piece
    gate.begin_step(1)
    assert gate.admit(1, [((1, 2), [(0, 16 * MB)])], 8) == []
    busy.result()


def test_the_reads_started_weigh_when_they_miss_more_than_the_predictions() -> None:
    gate = _measured(window_s=0.1)  # ~10 MB of slack per idle drive
    # predictions hit 3 of 4, but the one not cached (the one read) always misses
    for _ in range(4):
        gate.observe(1, {1, 2, 3, 4}, [1, 2, 3, 9], read={4})
    r = gate.layers[1]
    assert abs(r.ema - 0.75) < 1e-9 and r.read_ema == 0.0
    gate.begin_step(1)
    assert (
        gate.admit(1, [((1, 4), [(1, 16 * MB)])], 8) == []
    )  # past the slack at read precision 0: held
