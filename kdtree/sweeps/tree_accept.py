"""Greedy accept: the CPU walk against the GPU kernel, over batch x D."""
from __future__ import annotations

import numpy as np

from ..gpu import cuda_available
from ..timing import time_cpu, time_graph
from ..tree import build_trees, greedy_accept_batch
from ..workloads import stage_a_inputs
from .runner import run_sweep


def case(B: int, budget: int, cfg: dict):
    V = 64
    lp, ids = stage_a_inputs(B, cfg["L"], V, budget, seed=cfg["seed"] + B + budget)
    tb = build_trees(lp, ids, np.full(B, budget), root_tokens=np.zeros(B, np.int64))
    rng = np.random.default_rng(B * 31 + budget)
    target = rng.integers(0, V, size=(B, tb.D)).astype(np.int64)
    for b in range(B):   # follow first children, so walks go deep as they do in real use
        for i in range(tb.D):
            if tb.next_token[b, i] != -1 and rng.random() < 0.85:
                target[b, i] = tb.tokens[b, tb.next_token[b, i]]
    return tb, target


def measure_point(p: dict, cfg: dict, gpu: bool) -> list[dict]:
    B, budget, L = p["batch"], p["D"] - 1, cfg["L"]
    tb, target = case(B, budget, cfg)
    args = (tb.tokens, tb.next_token, tb.next_sibling, target, L)
    cpu = time_cpu(lambda: greedy_accept_batch(*args), reps=cfg["cpu_reps"],
                   max_seconds=cfg["cpu_max_seconds"])
    accepted = float(greedy_accept_batch(*args)[1].mean())
    rows = [dict(p, impl="cpu_walk", metric="batch_time", mean_accept_len=accepted, **cpu)]
    if not gpu:
        rows.append(dict(p, impl="gpu_kernel", metric="device_time", status="skipped",
                         reason="no CUDA device"))
        return rows
    import torch

    from .. import ops

    t = [torch.as_tensor(a).cuda() for a in args[:4]]
    dev = time_graph(lambda: ops.tree_accept(*t, L), replays=cfg["gpu_replays"])
    rows.append(dict(p, impl="gpu_kernel", metric="device_time", mean_accept_len=accepted, **dev))
    return rows


def run(cfg: dict, out_path, gpu: bool | None = None, library=None):
    gpu = cuda_available() if gpu is None else gpu
    points = [{"batch": int(B), "D": int(D)} for B in cfg["batches"] for D in cfg["slots"]]
    return run_sweep("tree_accept", points, lambda p: measure_point(p, cfg, gpu), out_path, cfg,
                     library if gpu else None, extra={"L": cfg["L"]})
