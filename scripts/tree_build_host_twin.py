"""The tree build's host twin (kd_select_threshold_host: the kernel's threshold selection run
on the CPU, one thread) on the tree-build sweep's inputs: for each drafter, batch and budget,
how many requests raise tau, how often, the largest candidate set and the refusals, for one
library or several (builds with other flags), each against the first: the requests whose
raises differ and whether every tree is the same. It answers "would this change raise tau
more often?" before any GPU time is spent. CPU only.

    python3 -m kdtree build --build-dir /tmp/a
    python3 -m kdtree build --build-dir /tmp/b --extra-flags=-DKD_LEVEL_RAISE=0
    python3 scripts/tree_build_host_twin.py /tmp/a/libkdtree.so /tmp/b/libkdtree.so --budgets 256 1024
    python3 scripts/tree_build_host_twin.py /tmp/b/libkdtree.so --fuzz 600 --seed 1

Inputs as the sweep makes them (stage_a_inputs, point_seed, K = min(budget, vocab, max_topk)); the
node buffer is the twin's, a batch of 16's (ts_capacity). A raise picks as the two-CTA kernel does;
--linear-raise as the one-CTA-an-SM kernel (ops.tree_build_plan says which a shape runs).

--fuzz SECONDS draws random requests instead (L 1-16, K 1-1024, budgets 0-1024 with their
edges, vocabularies 2-32000 for ties, every drafter; a tenth each with -inf tails, sums that
are not exact, or exact ties at many magnitudes: FUZZ_ROWS) and checks each library's selection, both
programs, against the heap build (`kdtree.reference.tree.build_tree`): the parents, ranks,
depths and links wherever the twin claims a result. A change to the selection can be checked
that way before any GPU time is spent; the GPU fuzz (scripts/fuzz_gpu.py) checks the kernels.
Exit status 1 if any selection differs; each such case is printed with what reproduces it.
"""
import argparse
import ctypes
import time

import numpy as np

from kdtree.harness.sweeps.tree_build import point_seed
from kdtree.harness.workloads import DRAFTS, stage_a_inputs
from kdtree.reference.tree import build_tree


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


FUZZ_BUDGETS = (0, 1, 2, 3, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 255, 256, 257, 511, 512,
                1000, 1024)


def fuzz_case(rng) -> dict:
    """A random request's parameters; fuzz_inputs makes its rows from them."""
    budget = int(rng.choice(FUZZ_BUDGETS))
    vocab = int(rng.choice([2, 3, 7, 50, 300, 4000, 32000]))
    topk = int(rng.choice([1, 2, 8, 31, 32, 33, 64, 128, 256, 300, max(budget, 1), 1024]))
    return dict(L=int(rng.integers(1, 17)), K=min(vocab, topk), vocab=vocab, budget=budget,
                drafts=str(rng.choice(DRAFTS)), coarse=float(rng.choice([0.0, 0.3, 1.0])),
                rows=str(rng.choice(FUZZ_ROWS, p=[0.7, 0.1, 0.1, 0.1])), seed=int(rng.integers(1 << 30)))


# The drafter's rows as they come, or made harder for the certificate: -inf past a random
# rank in half the rows (the clamp), magnitudes of 1e-30 to 1e4 (sums that are not exact:
# the selection must refuse them), or a few exact values at many magnitudes (ties at sums).
FUZZ_ROWS = ("drafter", "-inf tails", "wide range", "exact ties")


def fuzz_inputs(case):
    """The case's rows f32 [L, K] and ids (each rank's own index, so ranks read as tokens)."""
    lp, _ = stage_a_inputs(1, case["L"], case["vocab"], case["K"], seed=case["seed"],
                           coarse_fraction=case["coarse"], drafts=case["drafts"])
    lp = lp[0].numpy()
    rng = np.random.default_rng(case["seed"])
    if case["rows"] == "-inf tails":
        for d in range(lp.shape[0]):
            if lp.shape[1] > 1 and rng.random() < 0.5:
                lp[d, int(rng.integers(1, lp.shape[1])):] = -np.inf
    elif case["rows"] == "wide range":
        scale = (10.0 ** rng.uniform(-30, 4, size=lp.shape)).astype(np.float32)
        lp = -np.sort(np.abs(lp * scale), axis=1)
    elif case["rows"] == "exact ties":
        values = np.array([0, 2.0 ** -20, 1e-8, 0.5, 1, 3, 7e3], np.float32)
        lp = -np.sort(rng.choice(values, size=lp.shape), axis=1)
    lp = np.ascontiguousarray(lp, dtype=np.float32)
    return lp, np.tile(np.arange(lp.shape[1], dtype=np.int64), (lp.shape[0], 1))


def same_as_heap(run, t) -> bool:
    """A select() result against the heap build's tree t (build_tree over the fuzz_inputs
    ids): equal, or refused (n < 0: the kernel then runs the warp loop, which the GPU tests
    check)."""
    n, outs, _ = run
    if n < 0:
        return True
    parents, ranks, depths, next_token, next_sibling = (o[:n + 1] for o in outs)
    return (n == len(t.parents) - 1 and np.array_equal(parents, t.parents) and np.array_equal(ranks[1:], t.tokens)
            and np.array_equal(depths[1:], t.depths) and np.array_equal(next_token, t.next_token)
            and np.array_equal(next_sibling, t.next_sibling))


def fuzz(paths, seconds, seed=0) -> dict:
    """Random requests for `seconds`; every library, both programs, against the heap build."""
    fs = [load(p) for p in paths]
    rng, t0 = np.random.default_rng(seed), time.monotonic()
    tally = dict(cases=0, selections=0, refused=0, laid=0, differ=[])
    while time.monotonic() - t0 < seconds:
        case = fuzz_case(rng)
        lp, ids = fuzz_inputs(case)
        heap = build_tree(lp, ids, case["budget"])
        for i, f in enumerate(fs):
            for linear_raise in (False, True):
                run = select(f, lp, case["budget"], linear_raise)
                tally["selections"] += 1
                tally["refused"] += run[0] < 0
                tally["laid"] += run[0] >= 0 and run[2][2] > 0
                if not same_as_heap(run, heap):
                    tally["differ"].append(dict(case, library=i, linear_raise=linear_raise))
        tally["cases"] += 1
    return tally


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
    a.add_argument("--fuzz", type=float, metavar="SECONDS",
                   help="random requests for this long, each library against the heap build")
    a.add_argument("--seed", type=int, default=0, help="the fuzz's seed")
    args = a.parse_args()
    if args.fuzz is not None:
        t = fuzz(args.libraries, args.fuzz, args.seed)
        for d in t["differ"]:
            print(f"DIFFERS from the heap build: {d}")
        print(f"{t['cases']} requests, {t['selections']} selections: {len(t['differ'])} differ from the heap "
              f"build, {t['refused']} refused (warp loop), {t['laid']} laid out at once")
        raise SystemExit(1 if t["differ"] else 0)
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
