"""Whether the verify sweep's order (kdtree timed first at a point, FlashMLA after it) favours
either side: per shape, full timings in the order K F K F K F F K on the sweep's inputs (runs
tables, rotating cache copies, page 64) and `time_graph`, as the sweep times them. One Parquet
row a timing; the adjacent pairs' ratios say whether going first matters.

    python3 scripts/verify_order.py OUT.parquet [--passes 2]
"""
import argparse

import pandas as pd
import torch

from kdtree.harness.sweeps.verify_attn import peer_calls, require_flashmla
from kdtree.harness.timing import time_graph

# (batch, D, heads, prefix): compute-bound shapes where FlashMLA leads, memory-bound D 1, batch 1.
SHAPES = [(32, 64, 8, 8192), (32, 16, 16, 8192), (32, 64, 16, 8192), (32, 1, 16, 8192), (16, 64, 8, 8192),
          (16, 16, 16, 32768), (16, 1, 16, 8192), (16, 64, 64, 8192), (1, 64, 16, 32768)]
ORDER = "KFKFKFFK"
SCALE = 0.130861


def time_shape(fm, B, D, H, P, rep) -> list[dict]:
    """The shape's timings in ORDER, one row each."""
    kdtree_call, fcalls, inner = peer_calls(fm, B, D, H, P, SCALE)
    rows = []
    for pos, who in enumerate(ORDER):
        t = time_graph(kdtree_call() if who == "K" else fcalls(), replays=10, inner=inner)
        rows.append(dict(rep=rep, batch=B, D=D, heads=H, prefix=P, pos=pos,
                         impl="kdtree_kernel" if who == "K" else "flashmla", median_us=t["median_us"]))
    return rows


def main():
    a = argparse.ArgumentParser()
    a.add_argument("out")
    a.add_argument("--passes", type=int, default=2)
    args = a.parse_args()
    fm = require_flashmla("verify_order")
    rows = []
    for rep in range(args.passes):
        for (B, D, H, P) in SHAPES:
            rows += time_shape(fm, B, D, H, P, rep)
            print(B, D, H, P, [round(r["median_us"], 1) for r in rows[-len(ORDER):]], flush=True)
            torch.cuda.empty_cache()
    pd.DataFrame(rows).to_parquet(args.out, index=False)


if __name__ == "__main__":
    main()
