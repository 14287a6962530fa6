"""One verify round on the GPU: tree build -> tree-verify attention -> accept (from the
build's parents), captured into one CUDA graph with no host sync between them; its replay
time beside each part's own."""
from __future__ import annotations

import math

from ..gpu import ensure_fits
from ..timing import time_graph
from ..workloads import stage_a_inputs
from .runner import run_sweep
from .verify_attn import gpu_case


def measure_point(p: dict, cfg: dict) -> list[dict]:
    import torch

    from ... import ops

    B, budget, H, P = p["batch"], p["budget"], p["heads"], p["prefix"]
    D, L, page = budget + 1, cfg["L"], 64
    ensure_fits(B * (math.ceil((P + D) / page) + 1) * page * 576 * 2 * 2 + B * D * D * 4,
                cfg["gpu_mem_cap_gb"])
    lp, ids = stage_a_inputs(B, L, cfg["vocab"], budget, seed=cfg["seed"] + B + budget)
    lp, ids = lp.cuda(), ids.cuda()
    budgets = torch.full((B,), budget, dtype=torch.int32, device="cuda")
    q, cache, table, seq, _ = gpu_case(B, D, H, P, page, cfg["seed"] + 17)
    target = torch.randint(0, cfg["vocab"], (B, D), device="cuda")
    trees = ops.tree_build(lp, ids, budgets, d_max=D)
    plan = ops.TreeVerifyPlan(B, D, H, page, table.shape[1])
    out = plan.run(q, cache, table, seq, trees.visibility_bits, cfg["scale"])
    acc = ops.TreeAcceptResult.empty(B, L, "cuda")

    def build():
        ops.tree_build(lp, ids, budgets, d_max=D, out=trees)

    def verify():
        plan.run(q, cache, table, seq, trees.visibility_bits, cfg["scale"], out=out)

    def accept():   # from the build's parents: no sibling walk (sweeps/tree_accept.py)
        ops.tree_accept(trees.tokens, target, L, parents=trees.parents, node_counts=trees.node_counts, out=acc)

    def round_():
        build(); verify(); accept()

    rows = []
    parts = {}
    for name, fn in (("build", build), ("verify", verify), ("accept", accept), ("round", round_)):
        t = time_graph(fn, replays=cfg["gpu_replays"], inner=cfg["graph_inner"])
        parts[name] = t["median_us"]
        rows.append(dict(p, impl=f"{name}_graph", **t))
    for r in rows:
        r["sum_of_parts_us"] = parts["build"] + parts["verify"] + parts["accept"]
    del q, cache, table, seq, trees, out, plan
    torch.cuda.empty_cache()
    return rows


def run(cfg: dict, out_path, library=None):
    points = [{"batch": int(b), "budget": int(k), "heads": int(h), "prefix": int(pp)}
              for b in cfg["batches"] for k in cfg["budgets"] for h in cfg["heads"] for pp in cfg["prefixes"]]
    return run_sweep("round", points, lambda p: measure_point(p, cfg), out_path, cfg, library, settle=True)
