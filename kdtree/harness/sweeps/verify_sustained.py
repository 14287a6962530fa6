"""Verify attention under sustained load, beside FlashMLA. The verify sweep times short
bursts of graph replays; a decode loop keeps the GPU busy, and an H200 held at load runs at
its board power limit with a lower SM clock (kdtree.harness.power). Per shape and kernel, on
the same inputs (page size 64, cache copies rotated past the L2): the burst time after an
idle pause, the time a call once the board has settled, and the board's power and SM clock
while that is timed. Each kernel runs alone here and settles at a clock of its own; the verify
sweep alternates the two, which then share one (docs/kernels/verify_attention.md, session 48)."""
from __future__ import annotations

import time

from ..power import PowerSampler
from ..timing import time_graph, time_graph_sustained
from .runner import run_sweep
from .verify_attn import (FLASHMLA_MISSING, FLASHMLA_PAGE, flashmla_calls, flashmla_module, floor_us, point_inputs,
                          rotation)


def parse_shape(text: str) -> dict:
    """'B:H:D:P' -> a point (the config schema checks the form)."""
    B, H, D, P = (int(x) for x in text.split(":"))
    return {"batch": B, "heads": H, "D": D, "prefix": P}


def points(shapes: list[str]) -> list[dict]:
    """The shapes in order, kdtree timed first at every other one and FlashMLA at the rest, so
    that neither always follows the other's load."""
    return [dict(parse_shape(s), kdtree_first=i % 2 == 0) for i, s in enumerate(shapes)]


def measure_point(p: dict, cfg: dict) -> list[dict]:
    import torch

    from ... import ops

    B, H, D, P = p["batch"], p["heads"], p["D"], p["prefix"]
    page = FLASHMLA_PAGE
    (q, cache, table, seq, vis), caches, inner = point_inputs(B, D, H, P, page, cfg, "runs")
    scale = cfg["scale"]
    out = ops.tree_verify(q, cache, table, seq, vis, scale)

    def kdtree_calls():  # each timing rotates through the copies from the first
        next_cache = rotation(caches)
        return lambda: ops.tree_verify(q, next_cache(), table, seq, vis, scale, out=out)

    makers = {"kdtree_kernel": kdtree_calls}
    base = dict(p, page_size=page, floor_us=floor_us(B, D, H, P), cache_copies=len(caches), graph_inner=inner,
                warmup_s=cfg["warmup_s"], seconds=cfg["seconds"])
    rows = []
    fm = flashmla_module() if cfg.get("compare_flashmla", True) else None
    if cfg.get("compare_flashmla", True) and fm is None:
        rows.append(dict(base, impl="flashmla", status="not_available", reason=FLASHMLA_MISSING))
    if fm is not None:
        makers["flashmla"] = flashmla_calls(fm, q, caches, table, seq, scale)
    order = list(makers.items())
    for impl, make in (order if p.get("kdtree_first", True) else order[::-1]):
        time.sleep(cfg["idle_s"])  # the board's clock recovers before the burst
        burst = time_graph(make(), replays=cfg["gpu_replays"], inner=inner)
        sampler = PowerSampler(cfg["sample_ms"])
        t = time_graph_sustained(make(), inner, cfg["warmup_s"], cfg["seconds"], during=sampler)
        rows.append(dict(base, impl=impl, burst_us=burst["median_us"], **t, **sampler.summary(),
                         roofline_fraction=base["floor_us"] / t["median_us"]))
    del q, cache, caches, table, seq, vis, out
    torch.cuda.empty_cache()
    return rows


def run(cfg: dict, out_path, library=None):
    return run_sweep("verify_sustained", points(cfg["shapes"]), lambda p: measure_point(p, cfg), out_path, cfg,
                     library)
