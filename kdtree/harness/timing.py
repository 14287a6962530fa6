"""Timing helpers: CPU wall clock, CUDA events over CUDA-graph replays, eager latency.

Warm-up first, then many repetitions; medians and spread go into the rows.
"""
from __future__ import annotations

import statistics
import time


def summarize(samples_s: list[float]) -> dict:
    s = sorted(samples_s)
    return {"median_us": statistics.median(s) * 1e6, "min_us": s[0] * 1e6,
            "p90_us": s[min(len(s) - 1, int(0.9 * len(s)))] * 1e6, "reps": len(s)}


def time_cpu(fn, reps: int = 5, warmup: int = 1, max_seconds: float = 10.0) -> dict:
    """Wall time of fn(); stops early past max_seconds (at least one timed run)."""
    for _ in range(warmup):
        fn()
    out, t_start = [], time.perf_counter()
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
        if time.perf_counter() - t_start > max_seconds:
            break
    return summarize(out)


def capture_graph(fn, inner: int = 1, warmup: int = 1):
    """(graph, fn's last result): fn run `warmup` times on a side stream (lazy allocations and
    plans made outside capture, as torch asks), then captured `inner` times into one CUDA graph."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    result = None
    with torch.cuda.graph(g):
        for _ in range(inner):
            result = fn()
    return g, result


def time_graph(fn, replays: int = 50, inner: int = 10, warmup: int = 3) -> dict:
    """Device time per call: fn captured `inner` times into one CUDA graph, replays timed by events
    (time_graphs_alternating with one side)."""
    return time_graphs_alternating([fn], replays=replays, inner=inner, warmup=warmup)[0]


ALTERNATING = "alternating"   # a row's `timing` where its replays alternated with a peer's


def alternating_order(sides: int, replays: int) -> list[int]:
    """Which side each timed replay runs: every side in turn, the order reversed every other
    round (A B, B A, A B, ...), so that every side runs at the clock the sides hold together:
    a board at its power limit sets one clock for the mix, where a side timed alone would
    settle at its own (docs/kernels/verify_attention.md, session 48). `replays` rounds."""
    order = []
    for r in range(replays):
        order.extend(range(sides) if r % 2 == 0 else range(sides - 1, -1, -1))
    return order


def time_graphs_alternating(fns: list, replays: int = 50, inner: int = 10, warmup: int = 3) -> list[dict]:
    """Device time per call of several functions compared in one run: each captured `inner`
    times into its own CUDA graph, replayed once, then their replays timed by events one at a
    time in alternating_order; a summary a function."""
    import torch

    graphs = [capture_graph(fn, inner=inner, warmup=warmup)[0] for fn in fns]
    for g in graphs:
        g.replay()
    torch.cuda.synchronize()
    samples = [[] for _ in graphs]
    for i in alternating_order(len(graphs), replays):
        samples[i] += [t / inner for t in _event_seconds(graphs[i].replay, 1)]
    del graphs
    return [summarize(s) for s in samples]


def time_graph_sustained(fn, inner: int, warmup_s: float, seconds: float, during=None) -> dict:
    """Device time per call with the GPU kept busy: fn captured `inner` times into one CUDA
    graph, replayed back to back for `warmup_s` (the board settles at its power limit), then
    for `seconds` with each replay timed by events, inside the context `during` (a
    PowerSampler) if given. Replays shorter than the host's enqueue time leave gaps."""
    import contextlib

    g, _ = capture_graph(fn, inner=inner)
    _back_to_back(g.replay, warmup_s, timed=False)
    with during if during is not None else contextlib.nullcontext():
        samples = _back_to_back(g.replay, seconds, timed=True)
    del g
    return summarize([t / inner for t in samples])


def _back_to_back(call, seconds: float, timed: bool, ahead: int = 8) -> list[float]:
    """`call` enqueued again and again for `seconds` of wall time, at most `ahead` calls queued
    past the one the host waits on; the device seconds of each call where `timed`."""
    import torch

    pairs, t0 = [], time.perf_counter()
    while True:
        start, end = torch.cuda.Event(enable_timing=timed), torch.cuda.Event(enable_timing=timed)
        start.record()
        call()
        end.record()
        pairs.append((start, end))
        if len(pairs) > ahead:
            pairs[-ahead - 1][1].synchronize()
            if not timed:
                del pairs[:-ahead]
        if time.perf_counter() - t0 >= seconds:
            break
    torch.cuda.synchronize()
    return [s.elapsed_time(e) / 1e3 for s, e in pairs] if timed else []


def time_events(fn, reps: int = 20, warmup: int = 3) -> dict:
    """Device time per eager call with CUDA events (for ops that cannot be captured)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return summarize(_event_seconds(fn, reps))


def _event_seconds(call, reps: int) -> list[float]:
    """Device seconds of each of `reps` calls, between CUDA events on the current stream."""
    import torch

    samples = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        start.record()
        call()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return samples


def time_eager_latency(fn, reps: int = 50, warmup: int = 5) -> dict:
    """What a caller sees: launch, then synchronize, on the host clock."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return summarize(samples)
