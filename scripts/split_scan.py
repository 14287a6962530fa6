"""Verify attention over forced split counts, beside the plan's own choice: the data behind
the `splits` row of the dispatch table (kernels/src/verify_plan.cu). Graph replays over
rotating cache copies (L2 cold), as the verify sweep times them; one Parquet row a point.

    python3 scripts/split_scan.py OUT.parquet [--heads 8 16] [--slots 1] [--prefixes 8192 32768]
"""
import argparse

import pandas as pd
import torch

from kdtree import ops
from kdtree.harness.gpu import measure_ceilings
from kdtree.harness.sweeps.verify_attn import cache_copies, cache_set, floor_us, gpu_case, replay_inner, rotation
from kdtree.harness.timing import time_graph
from kdtree.reference.attention import attention_bytes


def main():
    a = argparse.ArgumentParser()
    a.add_argument("out")
    a.add_argument("--heads", type=int, nargs="+", default=[8, 16])
    a.add_argument("--slots", type=int, nargs="+", default=[1])
    a.add_argument("--prefixes", type=int, nargs="+", default=[8192, 32768])
    a.add_argument("--batches", type=int, nargs="+", default=[16])
    a.add_argument("--page", type=int, default=64)
    a.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    args = a.parse_args()
    copy_gbps = measure_ceilings()["copy_gbps"]
    rows = []
    for H in args.heads:
        for D in args.slots:
            for P in args.prefixes:
                for B in args.batches:
                    q, cache, table, seq, vis = gpu_case(B, D, H, P, args.page, seed=B + D + H + P)
                    copies = cache_copies(cache, cap=64)
                    caches = cache_set(cache, copies)
                    nbytes = attention_bytes(B, D, H, P)
                    for s in [None] + args.splits:
                        plan = ops.TreeVerifyPlan(B, D, H, args.page, table.shape[1], num_splits=s)
                        out = ops.tree_verify(q, cache, table, seq, vis, 0.130861, num_splits=s)
                        next_cache = rotation(caches)
                        fn = lambda: ops.tree_verify(q, next_cache(), table, seq, vis, 0.130861, num_splits=s,
                                                     out=out)
                        t = time_graph(fn, replays=10, inner=replay_inner(copies, 3))
                        rows.append(dict(heads=H, D=D, prefix=P, batch=B, page_size=args.page,
                                         forced=s or 0, num_splits=plan.num_splits, kernel=plan.name,
                                         merge=plan.merge, floor_us=floor_us(B, D, H, P),
                                         copy_fraction=nbytes / (t["median_us"] * 1e-6) / (copy_gbps * 1e9), **t))
                        print(rows[-1]["heads"], D, P, B, s, plan.num_splits, plan.name, round(t["median_us"], 1),
                              round(rows[-1]["copy_fraction"], 3), flush=True)
                    del q, cache, caches, table, seq, vis
                    torch.cuda.empty_cache()
    pd.DataFrame(rows).to_parquet(args.out, index=False)


if __name__ == "__main__":
    main()
