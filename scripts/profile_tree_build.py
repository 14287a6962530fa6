"""Where a tree-build batch spends its time: per-request cycles and the phase stamps of the
slowest and the median request, on the tree-build sweep's inputs (stage_a_inputs, L 15,
V 8192, its seeds). Needs a profile build of the library:

    python3 -m kdtree build --archs sm_90a --build-dir build/prof --extra-flags=-DKD_BUILD_PROFILE
    KDTREE_LIB=build/prof/libkdtree.so python3 scripts/profile_tree_build.py [--shapes 64:256:256 ...]

A shape is batch:budget:K. A batch's device time is its slowest request's, so the request
clocks (kd_build_profile_blocks) say which request to read; its phases come from a second
launch that stamps that block (kd_build_profile_block). Stamps are clock64 at phase ends
(kernels/src/tree_views.cuh, KD_PROF): a slot written more than once keeps its last
time; after an overflow, level_bound ends at 32 (lbound, written also where it did not run)
and raise_tau at 21; slots 10-15 are the merge levels (run 32 .. 1024), which reuse 14 (the
start bound's end); 16 the start bound's setup and 17, 18 its rounds (each before the round's
barrier); narrowD the end of narrow level D (warp 0's levels, D 1-7, 10 and 13); 33 past the
deep-tree gate, 34 the deviation bound's chain sums shared; the warp-a-depth one-deviation
layout's start (35), chain counted (36), lines counted (37), chain nodes stored (38) and
thread 0's lines written (39; `selected` follows the barrier).
Host raises and candidates come from the host twin of the selection.
"""
import argparse
import ctypes
import os

import numpy as np
import torch

from kdtree import ops
from kdtree.harness.sweeps.tree_build import reference_inputs
from kdtree.harness.workloads import DRAFTS
from tree_build_host_twin import load, select  # this folder's

SLOTS = 40  # KD_PROF_SLOTS in kernels/src/tree_views.cuh
SLOT_NAMES = {0: "start", 1: "staged", 14: "bound", 23: "levels", 24: "overflow", 32: "lbound", 21: "raised",
              22: "compacted", 2: "selected", 3: "rank_setup", 9: "ranked", 5: "popped", 6: "slots",
              7: "bits_setup", 8: "end", 19: "narrow10", 20: "narrow13",
              **{24 + d: f"narrow{d}" for d in range(1, 8)},
              33: "gated", 34: "chain_shared", 35: "layout", 36: "lay_counted", 37: "lay_walked",
              38: "lay_chain", 39: "lay_lines"}


def host_stats(twin, lp, budget, linear_raise):
    """(raises, candidates) of the host twin for one request; raises < 0: refused."""
    n, _, (raises, candidates, _) = select(twin, lp, budget, linear_raise)
    return (raises if n >= 0 else n), candidates


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--shapes", nargs="+", default=["16:64:64", "64:64:64", "16:256:256", "64:256:256",
                                                   "16:1024:256", "64:1024:256"])
    a.add_argument("--launches", type=int, default=4, help="launches before the clocks are read")
    a.add_argument("--drafts", choices=DRAFTS, default="mixed", help="the synthetic drafter (workloads.DRAFTS)")
    args = a.parse_args()
    lib = ctypes.CDLL(os.environ["KDTREE_LIB"])
    twin = load(os.environ["KDTREE_LIB"])
    if not hasattr(lib, "kd_build_profile_block"):
        raise SystemExit("KDTREE_LIB is not a profile build (-DKD_BUILD_PROFILE)")
    for shape in args.shapes:
        B, budget, K = (int(x) for x in shape.split(":"))
        lp, ids = reference_inputs(B, budget, K, args.drafts)
        lpd, idsd = lp.cuda(), ids.cuda()
        budgets = torch.full((B,), budget, dtype=torch.int32, device="cuda")

        def launch(n):
            out = ops.tree_build(lpd, idsd, budgets, d_max=budget + 1)
            for _ in range(n):
                out = ops.tree_build(lpd, idsd, budgets, d_max=budget + 1, out=out)
            torch.cuda.synchronize()

        lib.kd_build_profile_block(0)
        launch(args.launches)
        clocks = (ctypes.c_longlong * 256)()
        lib.kd_build_profile_blocks(clocks)
        cyc = np.array(clocks[:min(B, 256)])
        order = np.argsort(-cyc)
        linear = ops.tree_build_plan(*lp.shape, budget + 1)["kernel"] == "wide"  # the kernel's pick
        stats = [host_stats(twin, lp[b].numpy(), budget, linear) for b in range(len(cyc))]
        print(f"B {B} budget {budget} K {K}: cycles max {cyc.max()} p90 {int(np.percentile(cyc, 90))} "
              f"median {int(np.median(cyc))} min {cyc.min()}")
        print("  slowest (cycles, (raises, candidates)):", [(int(cyc[i]), stats[i]) for i in order[:6]])
        for b in dict.fromkeys((int(order[0]), int(order[len(order) // 2]))):  # slowest, median (once at B 1)
            stamps = (ctypes.c_longlong * SLOTS)()
            lib.kd_build_profile_block(b)
            launch(1)
            lib.kd_build_profile(stamps)
            p = np.array(stamps[:])
            rows = sorted((int(v - p[0]), SLOT_NAMES.get(i, str(i))) for i, v in enumerate(p) if v and v >= p[0])
            print(f"  request {b} {stats[b]}:", " ".join(f"{name}={c}" for c, name in rows))


if __name__ == "__main__":
    main()
