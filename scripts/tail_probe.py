"""What a schedule that splits a request's last row tile apart would buy, timed with today's
kernels: a tree of D = budget + 1 slots verified at once (the plan as it is) against its first
`budget` slots' plan with the last slot's rows as a second launch of their own split count,
in turn on one stream or beside it on a second (a graph fork: the tail's CTAs take the SMs the
main launch leaves idle). `--tail-kernels mma_sync` gives the tail launch the mma.sync kernel,
whose 16-row tiles do an eighth of a 64-row tile's products for the last slot's H rows. The two-launch forms time the work, not a result: the tail launch
takes the last slot as a one-slot tree over the whole prefix. Graph replays over rotating
cache copies (L2 cold), every form of a shape in alternating replays; one Parquet row a form,
written after each shape (an interrupted run keeps the shapes it finished).

    python3 scripts/tail_probe.py OUT.parquet [--heads 8 16] [--budgets 16 64] [--tail-splits 4 8 11 16]
        [--tail-kernels auto mma_sync] [--no-serial]
"""
import argparse

import pandas as pd
import torch

from kdtree import ops
from kdtree.harness.results import check_output, write_parquet_atomic
from kdtree.harness.sweeps.verify_attn import cache_copies, cache_set, gpu_case, replay_inner, rotation
from kdtree.harness.timing import ALTERNATING, time_graphs_alternating

SCALE = 0.130861


def main():
    a = argparse.ArgumentParser()
    a.add_argument("out")
    a.add_argument("--heads", type=int, nargs="+", default=[8, 16])
    a.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    a.add_argument("--prefixes", type=int, nargs="+", default=[8192, 32768])
    a.add_argument("--batches", type=int, nargs="+", default=[16])
    a.add_argument("--page", type=int, default=64)
    a.add_argument("--tail-splits", type=int, nargs="+", default=[4, 8, 11, 16])
    a.add_argument("--tail-kernels", nargs="+", default=["auto"], choices=ops.VERIFY_KERNELS)
    a.add_argument("--no-serial", action="store_true", help="time only the forked two-launch forms")
    a.add_argument("--replays", type=int, default=10)
    args = a.parse_args()
    try:
        check_output(args.out, make_parent=True)  # before any GPU time
    except ValueError as e:
        raise SystemExit(f"{a.prog}: {e}") from None
    side = torch.cuda.Stream()
    rows = []
    for H in args.heads:
        for b in args.budgets:
            for P in args.prefixes:
                for B in args.batches:
                    D = b + 1
                    q, cache, table, seq, vis = gpu_case(B, D, H, P, args.page, seed=B + D + H + P)
                    copies = cache_copies(cache, cap=64)
                    caches = cache_set(cache, copies)
                    pages = table.shape[1]
                    # The main launch: the first b slots' rows, the prefix and those slots as keys.
                    q_main = q[:, :b].contiguous()
                    vis_main = vis[:, :b, :b].contiguous()
                    seq_main = seq - 1
                    q_tail = q[:, b:].contiguous()
                    vis_tail = vis[:, b:, b:].contiguous()
                    whole = ops.TreeVerifyPlan(B, D, H, args.page, pages)
                    main_plan = ops.TreeVerifyPlan(B, b, H, args.page, pages)
                    forms, fns = [], []

                    def add(name, splits, fn, tail_kernel=None):
                        forms.append((name, splits, tail_kernel))
                        fns.append(fn)

                    out = whole.run(q, cache, table, seq, vis, SCALE)
                    add("whole", whole.num_splits,
                        lambda out=out, nc=rotation(caches): whole.run(q, nc(), table, seq, vis, SCALE, out=out))
                    out_m = main_plan.run(q_main, cache, table, seq_main, vis_main, SCALE)
                    add("main_only", main_plan.num_splits,
                        lambda nc=rotation(caches): main_plan.run(q_main, nc(), table, seq_main, vis_main, SCALE,
                                                                  out=out_m))
                    for tk, s in [(tk, s) for tk in args.tail_kernels for s in args.tail_splits]:
                        tail = ops.TreeVerifyPlan(B, 1, H, args.page, pages, kernel=tk, num_splits=s)
                        out_t = tail.run(q_tail, cache, table, seq, vis_tail, SCALE)

                        def serial(tail=tail, out_t=out_t, nc=rotation(caches)):
                            c = nc()
                            main_plan.run(q_main, c, table, seq_main, vis_main, SCALE, out=out_m)
                            tail.run(q_tail, c, table, seq, vis_tail, SCALE, out=out_t)

                        def forked(tail=tail, out_t=out_t, nc=rotation(caches)):
                            c, here = nc(), torch.cuda.current_stream()
                            side.wait_stream(here)
                            with torch.cuda.stream(side):
                                tail.run(q_tail, c, table, seq, vis_tail, SCALE, out=out_t)
                            main_plan.run(q_main, c, table, seq_main, vis_main, SCALE, out=out_m)
                            here.wait_stream(side)

                        if not args.no_serial:
                            add("serial", tail.num_splits, serial, tail.kernel)
                        add("forked", tail.num_splits, forked, tail.kernel)
                    times = time_graphs_alternating(fns, replays=args.replays, inner=replay_inner(copies, 3))
                    ref = times[0]["median_us"]
                    for (name, splits, tail_kernel), t in zip(forms, times):
                        rows.append(dict(heads=H, budget=b, D=D, prefix=P, batch=B, page_size=args.page,
                                         form=name, splits=splits, tail_kernel=tail_kernel,
                                         whole_splits=whole.num_splits,
                                         main_splits=main_plan.num_splits, vs_whole=t["median_us"] / ref,
                                         device=torch.cuda.get_device_name(), timing=ALTERNATING, **t))
                        print(H, b, P, B, name, tail_kernel, splits, round(t["median_us"], 1), round(t["median_us"] / ref, 3),
                              flush=True)
                    write_parquet_atomic(pd.DataFrame(rows), args.out)
                    q = cache = caches = table = seq = vis = fns = None  # free the point before the next
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
