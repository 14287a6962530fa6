"""Where a verify call's device time goes: the kernels' durations (CUPTI, through
torch.profiler) inside graph replays of `tree_verify`, beside the graph time a call, on the
verify sweep's inputs (runs tables, cache copies rotated past the L2). One Markdown row a
shape; the table behind session 32's memory-bound reading in docs/kernels/verify_attention.md.

    python3 scripts/verify_kernel_times.py --shapes 16:8:1:8192:64 16:8:1:8192:1 1:8:1:8192:64
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from kdtree import ops
from kdtree.harness.sweeps.verify_attn import cache_copies, cache_set, gpu_case, replay_inner, rotation
from kdtree.harness.timing import capture_graph, time_graph

SCALE = 0.130861
REPLAYS = 10


def shape(text: str) -> tuple:
    try:
        B, H, D, P, page = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected B:H:D:P:page_size, got {text!r}") from None
    return B, H, D, P, page


def kernel_us(graph, calls: int) -> dict:
    """Mean device microseconds a call of each kernel over REPLAYS replays of `graph`."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    total = {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        name = "attention" if "verify_attention" in e.name else "combine" if "combine" in e.name else e.name[:40]
        total[name] = total.get(name, 0.0) + e.device_time_total
    return {k: v / (REPLAYS * calls) for k, v in total.items()}


def main():
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--shapes", type=shape, nargs="+", required=True, help="B:H:D:P:page_size")
    args = a.parse_args()
    print("| B | H | D | P | page | plan | a call (us) | kernels a call (us) |")
    print("|---|---|---|---|---|---|---|---|")
    for B, H, D, P, page in args.shapes:
        q, cache, table, seq, vis = gpu_case(B, D, H, P, page, seed=B + D + H + P, layout="runs")
        copies = cache_copies(cache)
        caches = cache_set(cache, copies)
        out = ops.tree_verify(q, cache, table, seq, vis, SCALE)
        inner = replay_inner(copies, 5)
        next_cache = rotation(caches)
        fn = lambda: ops.tree_verify(q, next_cache(), table, seq, vis, SCALE, out=out)
        t = time_graph(fn, replays=20, inner=inner)
        graph, _ = capture_graph(fn, inner=inner)
        ks = kernel_us(graph, inner)
        pl = ops.TreeVerifyPlan(B, D, H, page, table.shape[1])
        plan = f"{pl.name}, {pl.num_splits} splits, {pl.merge}"
        kernels = ", ".join(f"{k} {v:.1f}" for k, v in ks.items())
        print(f"| {B} | {H} | {D} | {P} | {page} | {plan} | {t['median_us']:.1f} | {kernels} |", flush=True)
        del graph, caches, cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
