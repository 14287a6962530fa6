"""Verify attention over forced split counts, beside the plan's own choice: the data behind
the `splits` row of the dispatch table (kernels/src/verify_plan.cu). Graph replays over
rotating cache copies (L2 cold), as the verify sweep times them, every count of a shape in
alternating replays (one clock for all); one Parquet row a point, the file rewritten after
each shape.

    python3 scripts/split_scan.py OUT.parquet [--heads 8 16] [--slots 1] [--prefixes 8192 32768]

--plan-keys N makes every plan for block tables of N keys (padded with page 0) while each
request holds only its prefix and slots: a plan for longer requests than the batch's, as the
SGLang drop-in plans for the server's context length. --per-request adds that plan with
per_request_splits (each request its own count), as the drop-in makes it. --kernel forces a
kernel for every plan (`--kernel mma_sync --splits` times that kernel's own plans alone: with
a build held to sm_120's tiles, docs/kernels/README.md, the stand-in for sm_120).
"""
import argparse

import pandas as pd
import torch

from kdtree import ops
from kdtree.harness.gpu import measure_ceilings
from kdtree.harness.results import check_output, write_parquet_atomic
from kdtree.harness.sweeps.verify_attn import cache_copies, cache_set, floor_us, gpu_case, replay_inner, rotation
from kdtree.harness.timing import ALTERNATING, time_graphs_alternating
from kdtree.harness.workloads import widened_table
from kdtree.reference.attention import attention_bytes


def main():
    a = argparse.ArgumentParser()
    a.add_argument("out")
    a.add_argument("--heads", type=int, nargs="+", default=[8, 16])
    a.add_argument("--slots", type=int, nargs="+", default=[1])
    a.add_argument("--prefixes", type=int, nargs="+", default=[8192, 32768])
    a.add_argument("--batches", type=int, nargs="+", default=[16])
    a.add_argument("--page", type=int, default=64)
    a.add_argument("--splits", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32, 64, 128])
    a.add_argument("--kernel", default="auto", choices=ops.VERIFY_KERNELS, help="the kernel every plan takes")
    a.add_argument("--plan-keys", type=int, default=0, help="plan for tables of this many keys (0: the batch's)")
    a.add_argument("--per-request", action="store_true", help="also time the plan with per-request split counts")
    args = a.parse_args()
    try:
        check_output(args.out, make_parent=True)  # before any GPU time
    except ValueError as e:
        raise SystemExit(f"{a.prog}: {e}") from None
    copy_gbps = measure_ceilings()["copy_gbps"]
    rows = []
    for H in args.heads:
        for D in args.slots:
            for P in args.prefixes:
                for B in args.batches:
                    q, cache, table, seq, vis = gpu_case(B, D, H, P, args.page, seed=B + D + H + P)
                    table = widened_table(table, -(-args.plan_keys // args.page))
                    copies = cache_copies(cache, cap=64)
                    caches = cache_set(cache, copies)
                    nbytes = attention_bytes(B, D, H, P)
                    # (forced count or None, per-request counts)
                    specs = [(None, False)] + [(s, False) for s in args.splits]
                    specs += [(None, True)] if args.per_request else []
                    plans, fns = [], []
                    for s, per_request in specs:
                        plan = ops.TreeVerifyPlan(B, D, H, args.page, table.shape[1], kernel=args.kernel,
                                                  num_splits=s, per_request_splits=per_request)
                        out = plan.run(q, cache, table, seq, vis, 0.130861)
                        plans.append(plan)
                        fns.append(lambda plan=plan, out=out, next_cache=rotation(caches):
                                   plan.run(q, next_cache(), table, seq, vis, 0.130861, out=out))
                    # The specs' replays alternate (A B C, C B A, ...): at a power-capped shape the
                    # first plan timed ran up to 9% fast when each was timed in turn (session 80).
                    times = time_graphs_alternating(fns, replays=10, inner=replay_inner(copies, 3))
                    for (s, per_request), plan, t in zip(specs, plans, times):
                        rows.append(dict(heads=H, D=D, prefix=P, batch=B, page_size=args.page,
                                         plan_keys=table.shape[1] * args.page, forced=s or 0,
                                         per_request=per_request, num_splits=plan.num_splits,
                                         split_base=plan.split_base, tail=getattr(plan, "tail", False),
                                         kernel=plan.name, rows_per_cta=plan.rows_per_cta,
                                         keys_per_tile=plan.keys_per_tile,
                                         merge=plan.merge, floor_us=floor_us(B, D, H, P),
                                         copy_fraction=nbytes / (t["median_us"] * 1e-6) / (copy_gbps * 1e9),
                                         timing=ALTERNATING, **t))
                        print(rows[-1]["heads"], D, P, B, s, per_request, plan.num_splits, plan.name,
                              round(t["median_us"], 1), round(rows[-1]["copy_fraction"], 3), flush=True)
                    write_parquet_atomic(pd.DataFrame(rows), args.out)  # an interrupted scan keeps its shapes
                    q = cache = caches = table = seq = vis = plans = fns = None  # free the point before the next
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
