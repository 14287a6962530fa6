"""How much of a tree-build batch's device time is the launch and the tree's fixed phases, not
its size: the tree-build sweep's inputs and timing (10 calls a graph, replays timed by events)
for four forms in alternating replays: an empty torch op (the graph's floor for a kernel), the
build at budget 0 (staging and the slot outputs of D = budget + 1 slots, no selection), at
budget 1 (the selection's every phase on a one-node tree) and at the point's budget. One
Parquet row a form, written after each point (an interrupted run keeps what it measured).

    python3 scripts/tree_build_floor.py OUT.parquet [--batches 1 16 64] [--budgets 16 64 256]
        [--drafts mixed confident] [--rounds 2]
"""
import argparse
import statistics

import pandas as pd
import torch

from kdtree import ops
from kdtree.harness.results import check_output, write_parquet_atomic
from kdtree.harness.sweeps.tree_build import REFERENCE_L, reference_inputs
from kdtree.harness.timing import ALTERNATING, time_graphs_alternating
from kdtree.harness.workloads import DRAFTS


def main():
    a = argparse.ArgumentParser()
    a.add_argument("out")
    a.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    a.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    a.add_argument("--drafts", nargs="+", choices=DRAFTS, default=list(DRAFTS))
    a.add_argument("--rounds", type=int, default=2, help="alternating timings a point; the median of each "
                                                          "form's round medians is kept")
    a.add_argument("--replays", type=int, default=30)
    args = a.parse_args()
    if min(args.budgets) < 2:
        a.error("--budgets: each must be >= 2 (budgets 0 and 1 are the forms every point times)")
    if not torch.cuda.is_available():
        raise SystemExit(f"{a.prog}: needs a CUDA device (none is visible)")
    try:
        check_output(args.out, make_parent=True)  # before any GPU time
    except ValueError as e:
        raise SystemExit(f"{a.prog}: {e}") from None
    tiny = torch.zeros(1, device="cuda")
    rows = []
    for drafts in args.drafts:
        for B in args.batches:
            for budget in args.budgets:
                K = min(budget, 256)  # issue 29's build targets' K
                lp, ids = reference_inputs(B, budget, K, drafts)
                lp, ids, D = lp.cuda(), ids.cuda(), budget + 1
                forms, fns = ["empty_op"], [lambda: tiny.add_(0)]
                for name, bud in (("budget_0", 0), ("budget_1", 1), ("budget", budget)):
                    budgets = torch.full((B,), bud, dtype=torch.int32, device="cuda")
                    out = ops.tree_build(lp, ids, budgets, d_max=D)
                    forms.append(name)
                    fns.append(lambda budgets=budgets, out=out: ops.tree_build(lp, ids, budgets, d_max=D, out=out))
                rounds = [time_graphs_alternating(fns, replays=args.replays) for _ in range(args.rounds)]
                for i, form in enumerate(forms):
                    med = statistics.median(r[i]["median_us"] for r in rounds)
                    rows.append(dict(drafts=drafts, batch=B, budget=budget, K=K, L=REFERENCE_L, form=form, median_us=med,
                                     round_medians_us=[r[i]["median_us"] for r in rounds],
                                     device=torch.cuda.get_device_name(), timing=ALTERNATING))
                print(f"{drafts:9s} B {B:3d} budget {budget:4d}: " +
                      ", ".join(f"{r['form']} {r['median_us']:.2f}" for r in rows[-len(forms):]) + " us", flush=True)
                write_parquet_atomic(pd.DataFrame(rows), args.out)


if __name__ == "__main__":
    main()
