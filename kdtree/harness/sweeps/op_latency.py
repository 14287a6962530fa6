"""Caller latency of each op (one call, then a synchronize: what a decode loop without
graphs pays), through the Python API and as a registered torch op, beside an empty torch
op measured in the same run."""
from __future__ import annotations

from ..timing import time_eager_latency
from ..workloads import stage_a_inputs
from .runner import run_sweep
from .verify_attn import gpu_case


def measure_point(p: dict, cfg: dict) -> list[dict]:
    import torch

    from ... import ops
    from ... import torch_ops  # noqa: F401

    B, budget, H, P, L = p["batch"], cfg["budget"], cfg["heads"], cfg["prefix"], cfg["L"]
    D, reps = budget + 1, cfg.get("reps", 50)
    lp, ids = (t.cuda() for t in stage_a_inputs(B, L, 8192, budget, seed=B))
    budgets = torch.full((B,), budget, dtype=torch.int32, device="cuda")
    q, cache, table, seq, _ = gpu_case(B, D, H, P, 64, B)
    trees = ops.tree_build(lp, ids, budgets, d_max=D)
    vis = trees.visibility_bits
    vout = ops.tree_verify(q, cache, table, seq, vis, cfg["scale"])
    target = torch.randint(0, 8192, (B, D), device="cuda")
    acc = ops.TreeAcceptResult.empty(B, L, "cuda")
    tiny = torch.zeros(1, device="cuda")
    kd = torch.ops.kdtree
    calls = {
        ("empty_torch_op", "torch"): lambda: tiny.add_(0),
        ("tree_build", "python_api"): lambda: ops.tree_build(lp, ids, budgets, d_max=D, out=trees),
        ("tree_build", "torch_op"): lambda: kd.tree_build(lp, ids, budgets, None, None, D),
        ("tree_verify", "python_api"): lambda: ops.tree_verify(q, cache, table, seq, vis, cfg["scale"], out=vout),
        ("tree_verify", "torch_op"): lambda: kd.tree_verify(q, cache, table, seq, vis, cfg["scale"]),
        ("tree_accept", "python_api"): lambda: ops.tree_accept(trees.tokens, target, L, parents=trees.parents,
                                                               node_counts=trees.node_counts, out=acc),
        ("tree_accept", "torch_op"): lambda: kd.tree_accept(trees.tokens, target, L, trees.parents,
                                                            trees.node_counts),
    }
    rows = [dict(p, op=op, impl=impl, metric="caller_latency", **time_eager_latency(fn, reps=reps))
            for (op, impl), fn in calls.items()]
    del q, cache, table, seq, trees, vout
    torch.cuda.empty_cache()
    return rows


def run(cfg: dict, out_path, library=None):
    points = [{"batch": int(b)} for b in cfg["batches"]]
    return run_sweep("op_latency", points, lambda p: measure_point(p, cfg), out_path, cfg, library, settle=True)
