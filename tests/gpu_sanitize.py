"""One small launch of each kernel, for compute-sanitizer (memcheck, racecheck).

    compute-sanitizer --tool memcheck --error-exitcode 9 python tests/gpu_sanitize.py
"""
import numpy as np
import torch

from kdtree import ops, sglang
from kdtree.harness.workloads import paged_case, stage_a_inputs, widened_table


def main():
    lp, ids = stage_a_inputs(3, 15, 200, 40, seed=1)
    budgets = torch.tensor([40, 7, 0], dtype=torch.int32, device="cuda")
    trees = ops.tree_build(lp.cuda(), ids.cuda(), budgets, d_max=41, dense_visibility=True)
    # Threshold selection with tau raises (coarse rows, budget 256), and one request whose
    # unsorted row sends it to the warp loop.
    lp2, ids2 = stage_a_inputs(4, 15, 8192, 256, seed=3, coarse_fraction=1.0)
    lp2[3, 1] = lp2[3, 1].flip(0)
    wide = ops.tree_build(lp2.cuda(), ids2.cuda(), torch.full((4,), 256, dtype=torch.int32, device="cuda"), d_max=257)
    # Top-k below the budget (K 64, budget 300): the one-deviation start bound, and the
    # bucket ranks of more than 256 candidates.
    lp3, ids3 = stage_a_inputs(3, 15, 8192, 64, seed=4)
    ops.tree_build(lp3.cuda(), ids3.cuda(), torch.full((3,), 300, dtype=torch.int32, device="cuda"), d_max=301)
    # Batch 16 at budget 64: the start bound's one round of squared pivots, 4x node buffer.
    lp4, ids4 = stage_a_inputs(16, 15, 8192, 256, seed=5)
    ops.tree_build(lp4.cuda(), ids4.cuda(), torch.full((16,), 64, dtype=torch.int32, device="cuda"), d_max=65)
    # Batch 16 at budget 128: a 4x buffer of 512, sets of 129-512 candidates by bucket ranks.
    ops.tree_build(lp4.cuda(), ids4.cuda(), torch.full((16,), 128, dtype=torch.int32, device="cuda"), d_max=129)
    # A confident drafter at budgets 64 and 16: deep trees one deviation wide, laid out at once.
    lp5, ids5 = stage_a_inputs(16, 15, 8192, 64, seed=6, drafts="confident")
    ops.tree_build(lp5.cuda(), ids5.cuda(), torch.full((16,), 64, dtype=torch.int32, device="cuda"), d_max=65)
    lp6, ids6 = lp5[:2, :, :16].contiguous(), ids5[:2, :, :16].contiguous()
    ops.tree_build(lp6.cuda(), ids6.cuda(), torch.full((2,), 16, dtype=torch.int32, device="cuda"), d_max=17)
    # And at budget 256: the deviations dealt over all threads.
    lp7, ids7 = stage_a_inputs(4, 15, 8192, 256, seed=7, drafts="confident")
    ops.tree_build(lp7.cuda(), ids7.cuda(), torch.full((4,), 256, dtype=torch.int32, device="cuda"), d_max=257)
    target = torch.randint(0, 200, (3, 41), device="cuda")
    ops.tree_accept(trees.tokens, target, 15, next_token=trees.next_token, next_sibling=trees.next_sibling)  # a warp each
    # D 257: a CTA each; the target follows first children.
    target2 = torch.where(wide.next_token >= 0, wide.tokens.gather(1, wide.next_token.clamp(min=0)), 0)
    ops.tree_accept(wide.tokens, target2, 15, next_token=wide.next_token, next_sibling=wide.next_sibling)
    # Random targets (long sibling scans), then lists that are not a tree.
    target3 = torch.randint(0, 8192, wide.tokens.shape, device="cuda")
    ops.tree_accept(wide.tokens, target3, 15, next_token=wide.next_token, next_sibling=wide.next_sibling)
    ns = wide.next_sibling.clone()
    first = int(wide.next_token[0, 0])
    ns[0, first] = 0                        # a sibling link back to the root: not a tree
    ops.tree_accept(wide.tokens, target3, 15, next_token=wide.next_token, next_sibling=ns)
    # The parents form: a warp each (D 41, ragged), a CTA each (D 257), and 16 slots a thread.
    ops.tree_accept(trees.tokens, target, 15, parents=trees.parents, node_counts=trees.node_counts)
    ops.tree_accept(wide.tokens, target2, 15, parents=wide.parents, node_counts=wide.node_counts)
    big = torch.randint(0, 3, (2, 3000), device="cuda")
    par = (torch.arange(3000, device="cuda") - 1).clamp(min=-1).int().repeat(2, 1)
    ops.tree_accept(big, big, 40, parents=par, node_counts=torch.tensor([2999, 100], dtype=torch.int32, device="cuda"))
    case = paged_case([0, 70, 200], 41, 8, 64, seed=2, device="cuda")  # 6 row tiles: TMA
    # Hopper: 2 splits merge in clusters (auto, 18 row tiles); 3, 8 and 40 go through the
    # combine kernel (a warp per half row below 32 splits, a CTA per quarter row from 32), as 3
    # on the cp.async copy and when forced (wgmma_combine).
    for path, splits in (("auto", 1), ("auto", 2), ("auto", 3), ("auto", 8), ("auto", 40), ("mma_sync", 1),
                         ("mma_sync", 3), ("mma_sync", 40), ("wgmma_cp_async", 3), ("wgmma_combine", 3)):
        # wgmma on Hopper (TMA, then cp.async), the mma.sync kernel
        for vis in (trees.visibility, trees.visibility_bits):
            ops.tree_verify(case.q, case.kv_cache, case.block_table, case.seq_lens, vis, 0.130861,
                            kernel=path, num_splits=splits)
    small = paged_case([0, 300, 20, 90, 5, 64], 17, 8, 64, seed=4, device="cuda")  # 6 x 3 row tiles
    for splits in (2, 3):  # clusters of 2 (a partial last row tile, P = 0); 3 combine
        ops.tree_verify(small.q, small.kv_cache, small.block_table, small.seq_lens, small.visibility,
                        0.130861, num_splits=splits)
    # Hopper: combines held as programmatic dependents of the wgmma kernel, 1 to 3 CTAs an
    # SM (8 / 128 / 136 / 384 CTAs on 132 SMs).
    for D, splits in ((1, 3), (1, 40), (17, 3), (3, 40)):
        tiny = paged_case([0, 900, 64, 3000], D, 8, 64, seed=6, device="cuda")
        ops.tree_verify(tiny.q, tiny.kv_cache, tiny.block_table, tiny.seq_lens, tiny.visibility,
                        0.130861, num_splits=splits)
    wide = paged_case([0, 130], 16, 64, 128, seed=3, device="cuda")  # 16 row tiles
    for path in ("auto", "wgmma_combine"):  # 2 splits through the combine kernel when forced
        ops.tree_verify(wide.q, wide.kv_cache, wide.block_table, wide.seq_lens, wide.visibility,
                        0.130861, kernel=path, num_splits=1 if path == "auto" else 2)
    # Page size 1 (SGLang's pool): tiles of consecutive rows by TMA, the others by cp.async
    # (auto; 2 splits of its 24 row tiles merge in clusters), or every tile by cp.async, one
    # page lookup a row (wgmma_cp_async).
    for layout in ("scattered", "runs", "broken_runs"):
        ones = paged_case([0, 70, 200, 900], 41, 8, 1, seed=5, device="cuda", layout=layout)
        for path, splits in (("auto", 1), ("auto", 2), ("auto", 3), ("wgmma_cp_async", 1)):
            ops.tree_verify(ones.q, ones.kv_cache, ones.block_table, ones.seq_lens, ones.visibility, 0.130861,
                            kernel=path, num_splits=splits)
    # Per-request split counts (the SGLang drop-in's plans): B 16, H 8 under tables of 32k
    # keys, ragged requests of 0-5000 keys, so most splits are empty; D 65 (on 132 SMs the last
    # row tile alone is split: tail) and D 64 (every row tile); page 64 (TMA) and 1 (runs),
    # each kernel.
    for D in (65, 64):
        for page in (64, 1):
            pr = paged_case([0, 1, 63, 64, 100, 700, 1500, 2100, 3000, 4000, 4500, 5000, 0, 9, 640, 64 * 40], D, 8,
                            page, seed=8, device="cuda")
            table = widened_table(pr.block_table, -(-(32768 + D) // page))
            for path in ("auto", "mma_sync", "wgmma_cp_async"):
                plan = ops.TreeVerifyPlan(16, D, 8, page, table.shape[1], kernel=path, per_request_splits=True)
                plan.run(pr.q, pr.kv_cache, table, pr.seq_lens, pr.visibility, 0.130861)
    # SGLang's round (D 41, ragged budgets, prefixes 0-200): the padded layout, the custom
    # mask into a buffer sized for the largest prefix, the accept outputs.
    rb = sglang.RoundBuilder(3, 40)
    prefix = torch.tensor([0, 70, 200], device="cuda")
    lay = rb.build(lp.cuda(), ids.cuda(), budgets, torch.tensor([5, 6, 7], device="cuda"), prefix)
    mask = torch.empty(sglang.mask_size(3, 41, 200), dtype=torch.uint8, device="cuda")
    sglang.custom_mask(lay.visibility, prefix, out=mask)
    sglang.accept(lay.tree_tokens, lay.retrieve_next_token, lay.retrieve_next_sibling, target)
    torch.cuda.synchronize()
    print("sanitize run finished:", np.asarray(trees.node_counts.cpu()).tolist())


if __name__ == "__main__":
    main()
