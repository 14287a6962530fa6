"""Where a tree_build call's host time goes, eager mode: the Python API with out= and without,
the registered torch op (which allocates its outputs every call), ten output allocations alone,
a grouped allocation (two tensors, split into views) and one torch.empty, beside an empty torch
op. Per case: host microseconds a call (calls back to back, a sync every 200) and call + sync.
Session 52's reading in docs/results.md (H200 host) came from its host column
(call + sync, not quoted there, is now the harness's time_eager_latency).

    KDTREE_LIB=build/kernels/libkdtree.so python3 scripts/tree_build_host_time.py
"""
import time

import torch

from kdtree import ops, torch_ops  # noqa: F401  (torch_ops registers torch.ops.kdtree)
from kdtree.harness.timing import time_eager_latency
from kdtree.harness.workloads import stage_a_inputs


def host_us(fn, n=3000):
    """Host microseconds a call, calls back to back (a sync every 200 keeps the queue short)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(n):
        fn()
        if i % 200 == 199:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


for B, budget in ((1, 64), (16, 64)):
    D, L = budget + 1, 15
    lp, ids = (t.cuda() for t in stage_a_inputs(B, L, 8192, budget, seed=B))
    budgets = torch.full((B,), budget, dtype=torch.int32, device="cuda")
    out = ops.tree_build(lp, ids, budgets, d_max=D)
    dev = lp.device
    W = (D + 31) // 32

    def grouped():
        i64 = torch.empty(5, B, D, dtype=torch.int64, device=dev).unbind(0)
        i32 = torch.empty(B * D * W + B * D + 2 * B, dtype=torch.int32, device=dev)
        return i64, i32.split([B * D * W, B * D, B, B])
    tiny = torch.zeros(1, device="cuda")
    cases = {
        "empty_op": lambda: tiny.add_(0),
        "api_out": lambda: ops.tree_build(lp, ids, budgets, d_max=D, out=out),
        "api_fresh": lambda: ops.tree_build(lp, ids, budgets, d_max=D),
        "torch_op": lambda: torch.ops.kdtree.tree_build(lp, ids, budgets, None, None, D),
        "alloc_10": lambda: ops.TreeBuildResult.empty(B, D, dev),
        "alloc_grouped": grouped,
        "one_empty": lambda: torch.empty(B, D, dtype=torch.int64, device=dev),
    }
    for name, fn in cases.items():
        print(f"B {B:3d} {name:14s} host {host_us(fn):7.1f} us   call+sync {time_eager_latency(fn, reps=500, warmup=20)['median_us']:7.1f} us", flush=True)
