"""Where a wgmma verify CTA spends its time: the clock stamps of row tile 0 of request 0 (every
split) on random tree-verify inputs, per phase of its first tiles. Needs a profile build:

    python3 -m kdtree build --archs sm_90a --build-dir build/vprof --extra-flags=-DKD_VERIFY_PROFILE
    KDTREE_LIB=build/vprof/libkdtree.so python3 scripts/profile_verify.py [--shapes 16:64:16:8192 ...]

A shape is batch:D:H:prefix (page size --page). Stamps are clock64 (kernels/src/sm90/
verify_wgmma.cuh, VSTAMP): 1 entry, 2 prologue done, for tile i < 10: 3 + 4i S issued (its
tile landed), 4 + 4i S done, 5 + 4i P ready (softmax done), 6 + 4i warpgroup 1 requested tile
i + 1; 43 loop done, 46 exit (0 and 47: the global timer at entry and exit, ns). A split that
merges in its cluster leaves before 46. Printed per split: the prologue, then per tile S, the
softmax and the rest of the period (P ready to the next S issue, or to the loop's end for a
split's last tile), in cycles, then their medians over tiles 1.. (tile 0 carries the prologue's
copies). With --latency, per tile i >= 1 also the cycles from warpgroup 1's request of it (stamp
6 + 4(i - 1)) to its S issue: an upper bound on its copy's latency, equal to it where S waited
for the tile.
"""
import argparse
import ctypes
import os
import statistics

import torch

from kdtree import loader, ops
from kdtree.harness.workloads import TABLE_LAYOUTS, paged_case

SLOTS = 48  # a split's stamps (verify_common.cuh)
SCALE = 0.130861  # K2's softmax scale


def stamped_tiles(s: list) -> list:
    """The tiles (0-9) whose S issue and P ready a split's stamps hold."""
    return [i for i in range(10) if s[3 + 4 * i] and s[5 + 4 * i]]


def request_waits(s: list, tiles: list) -> list:
    """Per stamped tile i >= 1: cycles from warpgroup 1's request of it to its S issue."""
    return [s[3 + 4 * i] - s[6 + 4 * (i - 1)] for i in tiles if i and s[6 + 4 * (i - 1)]]


def tile_medians(s: list) -> dict:
    """A split's stamps (`SLOTS` clock values) as medians over its stamped tiles after the first
    (tile 0 carries the prologue's copies), in cycles: S, softmax, rest (P ready to the next S
    issue) and request_to_s (warpgroup 1's request of a tile to its S issue), each only where
    stamped. Empty where fewer than two tiles were stamped."""
    tiles = stamped_tiles(s)
    later = [i for i in tiles if i >= 1]
    if not later:
        return {}
    out = {"S": statistics.median(s[4 + 4 * i] - s[3 + 4 * i] for i in later),
           "softmax": statistics.median(s[5 + 4 * i] - s[4 + 4 * i] for i in later)}
    rest = [s[3 + 4 * (i + 1)] - s[5 + 4 * i] for i in later if i + 1 in tiles]
    if rest:
        out["rest"] = statistics.median(rest)
    req = request_waits(s, tiles)
    if req:
        out["request_to_s"] = statistics.median(req)
    return out


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--shapes", nargs="+", default=["16:64:16:8192", "1:16:8:8192"])
    a.add_argument("--page", type=int, default=64, help="page size of the cache")
    a.add_argument("--layout", choices=TABLE_LAYOUTS, default="scattered",
                   help="block-table order (workloads.page_order); runs: SGLang's page-1 prefills")
    a.add_argument("--splits", type=int, default=4, help="splits printed (of row tile 0, request 0)")
    a.add_argument("--launches", type=int, default=3, help="launches; the last one's stamps are read")
    a.add_argument("--latency", action="store_true",
                   help="per tile, request to S issue (the copy's latency where S waited for it)")
    args = a.parse_args()
    if "KDTREE_LIB" not in os.environ:
        raise SystemExit("set KDTREE_LIB to a profile build (-DKD_VERIFY_PROFILE)")
    lib = loader.lib()
    if not hasattr(lib, "kd_verify_profile_buffer"):
        raise SystemExit("KDTREE_LIB is not a profile build (-DKD_VERIFY_PROFILE)")
    stamps = torch.zeros(64 * SLOTS, dtype=torch.int64, device="cuda")
    lib.kd_verify_profile_buffer(ctypes.c_void_p(stamps.data_ptr()))
    for shape in args.shapes:
        B, D, H, P = (int(x) for x in shape.split(":"))
        case = paged_case([P] * B, D, H, args.page, seed=B + D + H, device="cuda", layout=args.layout)
        plan = ops.TreeVerifyPlan(B, D, H, args.page, case.block_table.shape[1])
        for _ in range(args.launches):
            stamps.zero_()
            plan.run(case.q, case.kv_cache, case.block_table, case.seq_lens, case.visibility, SCALE)
        torch.cuda.synchronize()
        print(f"== B {B}, D {D}, H {H}, P {P}, page {args.page} ({args.layout}): {plan}")
        if plan.kernel != "wgmma":
            print("   (the mma.sync kernel takes no stamps)")
            continue
        st = stamps.view(64, SLOTS).tolist()
        for split in range(min(args.splits, plan.num_splits)):
            s = st[split]
            if not s[1]:
                continue
            tiles = stamped_tiles(s)
            rows = []
            for i in tiles:
                # The last stamped tile's rest runs to the loop's end only if the split ends there.
                nxt = s[3 + 4 * (i + 1)] if i + 1 in tiles else (s[43] if len(tiles) < 10 else None)
                rest = nxt - s[5 + 4 * i] if nxt is not None else "-"
                rows.append(f"{s[4 + 4 * i] - s[3 + 4 * i]}/{s[5 + 4 * i] - s[4 + 4 * i]}/{rest}")
            exit_ = f", epilogue {s[46] - s[43]}, {(s[47] - s[0]) / 1e3:.1f} us entry to exit" if s[46] else ""
            print(f"   split {split}: prologue {s[2] - s[1]}; tiles S/softmax/rest: {' '.join(rows)}{exit_}")
            if args.latency:
                print(f"     request to S issue, tiles 1..: {' '.join(map(str, request_waits(s, tiles)))}")
            med = tile_medians(s)
            if "rest" in med:
                print(f"     medians of tiles 1..: S {med['S']:.0f}, softmax {med['softmax']:.0f}, rest "
                      f"{med['rest']:.0f}: a period of {med['S'] + med['softmax'] + med['rest']:.0f}"
                      + (f"; request to S issue {med['request_to_s']:.0f}" if args.latency and "request_to_s" in med
                         else ""))


if __name__ == "__main__":
    main()
