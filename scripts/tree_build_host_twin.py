"""The tree build's host twin (kd_select_threshold_host: the kernel's threshold selection run
on the CPU, one thread) on the tree-build sweep's inputs: for each drafter, batch and budget,
how many requests raise tau, how often, the largest candidate set and the refusals, for one
library or several (builds with other flags), each against the first: the requests whose
raises differ and whether every tree is the same. It answers "would this change raise tau
more often?" before any GPU time is spent. CPU only.

    python3 -m kdtree build --build-dir /tmp/a
    python3 -m kdtree build --build-dir /tmp/b --extra-flags=-DKD_LEVEL_RAISE=0
    python3 scripts/tree_build_host_twin.py /tmp/a/libkdtree.so /tmp/b/libkdtree.so --budgets 256 1024

Inputs as the sweep makes them (stage_a_inputs, point_seed, K = min(budget, vocab, max_topk)); the
node buffer is the twin's, a batch of 16's (ts_capacity). A raise picks as the two-CTA kernel does;
--linear-raise as the one-CTA-an-SM kernel (ops.tree_build_plan says which a shape runs).
"""
import argparse
import ctypes

import numpy as np

from kdtree.harness.sweeps.tree_build import point_seed
from kdtree.harness.workloads import DRAFTS, stage_a_inputs


def load(path):
    """kd_select_threshold_host of the library at `path`."""
    f = ctypes.CDLL(str(path)).kd_select_threshold_host
    f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 6 + [ctypes.c_int]
    f.restype = ctypes.c_int
    return f


def select(f, lp, budget, linear_raise=False):
    """One request's selection: (n, [parents, ranks, depths, next_token, next_sibling],
    (raises, candidates, laid)); n < 0 where the twin refused (the kernel then runs the warp
    loop). linear_raise: the one-CTA-an-SM kernel's program (its raise, and the one-deviation
    layout, which `laid` says ran)."""
    lp = np.ascontiguousarray(lp, dtype=np.float32)
    outs = [np.zeros(budget + 1, np.int32) for _ in range(5)]
    stats = np.zeros(3, np.int32)
    n = f(lp.ctypes.data, lp.shape[0], lp.shape[1], budget, *(o.ctypes.data for o in outs), stats.ctypes.data,
          int(linear_raise))
    return n, outs, (int(stats[0]), int(stats[1]), int(stats[2]))


def compare(paths, drafts=DRAFTS, batches=(16, 64, 256), budgets=(64, 128, 256, 1024), max_topk=256, L=15,
            vocab=8192, seed=0, linear_raise=False) -> list[dict]:
    """A row per library and point (the sweep's inputs); `differ` and `same_trees` against
    the first library."""
    fs = [load(p) for p in paths]
    rows = []
    for d in drafts:
        for B in batches:
            for budget in budgets:
                K = min(budget, vocab, max_topk)  # as the sweep: a top-k capped below the budget
                lp, _ = stage_a_inputs(B, L, vocab, K, seed=point_seed(seed, B, budget), drafts=d)
                runs = [[select(f, lp[b].numpy(), budget, linear_raise) for b in range(B)] for f in fs]
                for i, run in enumerate(runs):
                    n = np.array([r[0] for r in run])
                    raises = np.array([r[2][0] for r in run])
                    ok = n >= 0
                    rows.append(dict(
                        library=i, drafts=d, batch=B, budget=budget,
                        raising=int((ok & (raises > 0)).sum()), raises=int(raises[ok].sum()),
                        max_raises=int(raises[ok].max(initial=0)), refused=int((~ok).sum()),
                        laid=sum(r[2][2] for r, good in zip(run, ok) if good),
                        max_candidates=max(r[2][1] for r in run),
                        differ=sum(r[2][0] != q[2][0] for r, q in zip(run, runs[0])),
                        same_trees=all(r[0] == q[0] and all(np.array_equal(a, b) for a, b in zip(r[1], q[1]))
                                       for r, q in zip(run, runs[0]))))
    return rows


def main():
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("libraries", nargs="+", help="libkdtree.so builds; the first is the base")
    a.add_argument("--drafts", nargs="+", choices=DRAFTS, default=list(DRAFTS))
    a.add_argument("--batches", nargs="+", type=int, default=[16, 64, 256])
    a.add_argument("--budgets", nargs="+", type=int, default=[64, 128, 256, 1024])
    a.add_argument("--max-topk", type=int, default=256)
    a.add_argument("--vocab", type=int, default=8192)
    a.add_argument("--linear-raise", action="store_true",
                   help="the one-CTA-an-SM kernel's program (ops.tree_build_plan's 'wide'): its raise and "
                        "the one-deviation layout")
    args = a.parse_args()
    rows = compare(args.libraries, args.drafts, args.batches, args.budgets, args.max_topk, vocab=args.vocab,
                   linear_raise=args.linear_raise)
    for r in rows:
        print(f"lib {r['library']} {r['drafts']:9s} B {r['batch']:3d} budget {r['budget']:4d}: "
              f"{r['raising']} raising, {r['raises']} raises (max {r['max_raises']}), {r['refused']} refused, "
              f"{r['laid']} laid out at once, "
              f"candidates max {r['max_candidates']}; against lib 0: {r['differ']} differ, "
              f"{'same trees' if r['same_trees'] else 'TREES DIFFER'}")


if __name__ == "__main__":
    main()
