"""Greedy accept: the CPU walk against the GPU kernels, over batch x D x follow rate.

Two kernels: `gpu_kernel` walks the left-child / right-sibling lists (SGLang's input
form); `gpu_kernel_parents` takes the build's parents and node counts instead, so each
slot tests itself at once (what this project's round uses).

The follow rate is how often a node's target is its first child's token: 0.85 gives the
deep walks of a good draft; 0 gives random targets (a draft wrong early), where the walk
passes over most of a node's children before it matches or gives up: the slow case."""
from __future__ import annotations

import numpy as np

from ..gpu import cuda_available
from ..timing import time_cpu, time_graph
from ...reference.tree import build_trees, greedy_accept_batch
from ..workloads import follow_targets, stage_a_inputs
from .runner import run_sweep


DEFAULT_FOLLOW_RATES = (0.85,)


def case(B: int, budget: int, cfg: dict, follow: float = DEFAULT_FOLLOW_RATES[0]):
    V = 64
    lp, ids = stage_a_inputs(B, cfg["L"], V, budget, seed=cfg["seed"] + B + budget)
    tb = build_trees(lp, ids, np.full(B, budget), root_tokens=np.zeros(B, np.int64))
    return tb, follow_targets(tb, V, follow, np.random.default_rng(B * 31 + budget))


def measure_point(p: dict, cfg: dict, gpu: bool) -> list[dict]:
    B, budget, L = p["batch"], p["D"] - 1, cfg["L"]
    tb, target = case(B, budget, cfg, p["follow"])
    args = (tb.tokens, tb.next_token, tb.next_sibling, target, L)
    cpu = time_cpu(lambda: greedy_accept_batch(*args), reps=cfg["cpu_reps"],
                   max_seconds=cfg["cpu_max_seconds"])
    accepted = float(greedy_accept_batch(*args)[1].mean())
    rows = [dict(p, impl="cpu_walk", metric="batch_time", mean_accept_len=accepted, **cpu)]
    if not gpu:
        return rows + [dict(p, impl=impl, metric="device_time", status="skipped", reason="no CUDA device")
                       for impl in ("gpu_kernel", "gpu_kernel_parents")]
    import torch

    from ... import ops

    c, nt, ns, tgt = (torch.as_tensor(a).cuda() for a in args[:4])
    acc = ops.TreeAcceptResult.empty(B, L, "cuda")
    dev = time_graph(lambda: ops.tree_accept(c, tgt, L, next_token=nt, next_sibling=ns, out=acc),
                     replays=cfg["gpu_replays"])
    rows.append(dict(p, impl="gpu_kernel", metric="device_time", mean_accept_len=accepted, **dev))
    par, n = (torch.as_tensor(a).cuda() for a in (tb.parents, tb.node_counts))
    dev = time_graph(lambda: ops.tree_accept(c, tgt, L, parents=par, node_counts=n, out=acc),
                     replays=cfg["gpu_replays"])
    rows.append(dict(p, impl="gpu_kernel_parents", metric="device_time", mean_accept_len=accepted, **dev))
    return rows


def run(cfg: dict, out_path, gpu: bool | None = None, library=None):
    gpu = cuda_available() if gpu is None else gpu
    rates = cfg.get("follow_rates", DEFAULT_FOLLOW_RATES)
    points = [{"batch": int(B), "D": int(D), "follow": float(f)}
              for f in rates for B in cfg["batches"] for D in cfg["slots"]]
    return run_sweep("tree_accept", points, lambda p: measure_point(p, cfg, gpu), out_path, cfg,
                     library if gpu else None, extra={"L": cfg["L"]}, settle=gpu)
