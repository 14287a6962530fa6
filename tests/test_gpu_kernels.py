"""The CUDA kernels against the CPU references (run on a GPU; skipped without one).

Outputs are poisoned before every launch, inputs are fresh per check, and the
tree build is compared byte for byte on thousands of tie-heavy requests.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kdtree.reference.attention import verify_attention_ref
from kdtree.checks import NEG_INF_FLOOR, InputError
from kdtree.reference.tree import build_trees, greedy_accept_batch, greedy_accept_parents_batch, pack_visibility
from kdtree.harness.timing import capture_graph
from kdtree.harness.workloads import (TREE_POISON, follow_targets, paged_case, poisoned_accept, poisoned_trees,
                                      stage_a_inputs, tied_one_deviation_rows, widened_table)

pytestmark = pytest.mark.gpu
DEV = "cuda"
SCALE = 0.130861
FIELDS = ("node_counts", "tokens", "depths", "parents", "positions", "next_token",
          "next_sibling", "visibility", "visibility_bits")


@pytest.fixture(scope="module")
def ops():
    from kdtree import ops as _ops
    _ops.lib()
    return _ops


def gpu_vs_cpu(ops, lp, ids, budgets, seq, roots, d_max=None, dense=True):
    """Every output of the GPU build (poisoned before) against the CPU build; dense=False
    leaves the dense mask out (the bit rows then come from the kernel's own paths)."""
    B = lp.shape[0]
    want = build_trees(lp, ids, budgets, seq_lens=seq, root_tokens=roots, d_max=d_max)
    out = poisoned_trees(B, want.D, DEV, dense)
    got = ops.tree_build(lp.to(DEV), ids.to(DEV), torch.as_tensor(budgets, dtype=torch.int32, device=DEV), seq_lens=torch.as_tensor(seq, dtype=torch.int32, device=DEV), root_tokens=torch.as_tensor(roots, dtype=torch.int64, device=DEV), d_max=want.D, out=out)
    assert (got.visibility is None) == (not dense)
    for f in FIELDS:
        if f == "visibility" and not dense:
            continue
        g = getattr(got, f).cpu().numpy()
        w = getattr(want, f)
        assert g.dtype == w.dtype, f
        if not np.array_equal(g, w):
            bad = np.argwhere((g != w).reshape(B, -1).any(1)).ravel()
            raise AssertionError(f"{f} differs in requests {bad[:10]} (budgets {np.asarray(budgets)[bad[:10]]})")
    st = got.status.cpu()
    assert ((st & ~ops.STATUS_WARP_LOOP) == 0).all()
    return want, st


BUDGET_CHOICES = [1, 2, 14, 15, 16, 17, 31, 64, 100, 128, 256, 512, 1024]


@pytest.mark.parametrize("seed", range(32))
def test_tree_build_matches_cpu(ops, seed):
    rng = np.random.default_rng(seed)
    B = 64
    V = int(rng.choice([2, 3, 7, 50, 1000, 32000]))
    budgets = rng.choice(BUDGET_CHOICES, size=B)
    if seed % 4 == 0:
        budgets[:] = int(rng.choice(BUDGET_CHOICES))   # uniform batches too
    lp, ids = stage_a_inputs(B, 15, V, int(budgets.max()), seed=1000 + seed,
                             coarse_fraction=float(rng.choice([0.3, 1.0])))
    seq = rng.integers(0, 100_000, size=B)
    roots = rng.integers(0, V, size=B)
    gpu_vs_cpu(ops, lp, ids, budgets, seq, roots)


@pytest.mark.parametrize("seed", range(6))
def test_tree_build_small_batch(ops, seed):
    """Batches under 16 start tau from the depth-1 bound alone (no chain bound) unless
    the budget is 1024 and the batch 4 or more: the same bytes as the CPU build, through
    both sorts (ranks by counting up to 256 candidates, the merge above)."""
    rng = np.random.default_rng(500 + seed)
    B = int(rng.integers(1, 8))
    budgets = rng.choice([1, 2, 15, 16, 17, 64, 100, 255, 256, 600, 1024], size=B)
    V = int(rng.choice([3, 50, 8192, 32000]))
    lp, ids = stage_a_inputs(B, 15, V, int(budgets.max()), seed=600 + seed,
                             coarse_fraction=float(rng.choice([0.3, 1.0])))
    gpu_vs_cpu(ops, lp, ids, budgets, rng.integers(0, 1000, size=B), rng.integers(0, V, size=B))


def test_tree_build_batch_wider_than_the_gpu(ops):
    """More requests than SMs: the log-probs stay in global memory (small, resident CTAs)."""
    rng = np.random.default_rng(77)
    B = 2 * torch.cuda.get_device_properties(0).multi_processor_count + 3
    budgets = rng.choice(BUDGET_CHOICES, size=B)
    lp, ids = stage_a_inputs(B, 15, 4000, int(budgets.max()), seed=77, coarse_fraction=1.0)
    gpu_vs_cpu(ops, lp, ids, budgets, rng.integers(0, 1000, size=B), rng.integers(0, 4000, size=B))


def kernel_expected(ops, B, d_max, smem_sm):
    """What the plan must pick, from the device alone: the wide kernel where the batch fits
    the SMs or a CTA needs more than half an SM's shared memory; the two-CTA kernel where two
    CTAs fit with room for the kernel's static arrays (< 32 KB); None in between."""
    p = ops.tree_build_plan(B, 15, 256, d_max)
    if B <= torch.cuda.get_device_properties(0).multi_processor_count or 2 * p["smem_bytes"] > smem_sm:
        return p, "wide"
    return p, ("two_cta" if 2 * (p["smem_bytes"] + 32768) <= smem_sm else None)


@pytest.mark.parametrize("extra", [0, 1])
@pytest.mark.parametrize("d_max", [513, 1025])
def test_tree_build_at_and_past_the_sm_count(ops, extra, d_max):
    """A batch of the SM count runs the wide kernel (one CTA an SM, the linear raise); one
    more request the two-CTA kernel (the radix raise) where two CTAs fit an SM's shared
    memory, else the wide one too (budget 1024's node buffer on an H200). Budgets up to
    d_max - 1 on coarse rows, where tau rises; the CPU build's bytes from both kernels."""
    props = torch.cuda.get_device_properties(0)
    B = props.multi_processor_count + extra
    plan, want = kernel_expected(ops, B, d_max, props.shared_memory_per_multiprocessor)
    if want is not None:
        assert plan["kernel"] == want, plan
    rng = np.random.default_rng(88 + extra + d_max)
    budgets = rng.choice([64, 200, 256, d_max - 1], size=B)
    lp, ids = stage_a_inputs(B, 15, 8192, 256, seed=88, coarse_fraction=1.0)
    _, st = gpu_vs_cpu(ops, lp, ids, budgets, rng.integers(0, 1000, size=B), rng.integers(0, 8192, size=B),
                       d_max=d_max)
    assert int((st & ops.STATUS_WARP_LOOP).count_nonzero()) == 0


def test_tree_build_plan_on_this_gpu(ops):
    """The plan's choices on the device: the wide kernel up to the SM count, the two-CTA one
    past it where two CTAs fit, the node buffer 4x the budget from batch 16 up to budget 128
    (2x at batch 1 and above), nothing staged past the SM count on the warp loop."""
    props = torch.cuda.get_device_properties(0)
    sms, smem_sm = props.multi_processor_count, props.shared_memory_per_multiprocessor
    for B in (1, 16, sms, sms + 1, 4 * sms):
        for d_max in (2, 17, 65, 129, 257, 513, 1025):
            plan, want = kernel_expected(ops, B, d_max, smem_sm)
            if want is not None:
                assert plan["kernel"] == want, (B, d_max, plan)
            if plan["node_buffer"]:
                mult = 4 if B >= 16 and d_max - 1 <= 128 else 2
                assert plan["node_buffer"] >= min(mult * (d_max - 1), 4096), (B, d_max, plan)
                assert plan["node_buffer"] < max(2 * mult * (d_max - 1), 128), (B, d_max, plan)
            elif B > sms:
                assert plan["staged_ld"] == 0, (B, d_max, plan)
            assert 0 < plan["smem_bytes"] <= props.shared_memory_per_block_optin, (B, d_max, plan)
    assert ops.tree_build_plan(8, 15, 64, 65, visibility=False)["vis_smem"] is False


@pytest.mark.parametrize("L,V,budget", [(1, 5, 3), (2, 2, 50), (3, 1, 10), (15, 1, 1024), (15, 2, 1024),
                                        (4, 3, 1024), (15, 16, 15),
                                        (40, 600, 1024)])   # log-probs too big to stage: global reads
def test_tree_build_tiny_vocab_and_short_blocks(ops, L, V, budget):
    lp, ids = stage_a_inputs(8, L, V, budget, seed=L * 100 + V, coarse_fraction=1.0)
    gpu_vs_cpu(ops, lp, ids, np.full(8, budget), np.arange(8), np.arange(8))


@pytest.mark.parametrize("budget", [16, 64, 256, 1024])
def test_tree_build_threshold_path_on_sweep_inputs(ops, budget):
    """The sweep's inputs are certified: every request takes the threshold selection."""
    B = 64
    for cf in (0.3, 1.0):
        lp, ids = stage_a_inputs(B, 15, 8192, budget, seed=budget + int(cf * 10), coarse_fraction=cf)
        _, st = gpu_vs_cpu(ops, lp, ids, np.full(B, budget), np.arange(B), np.arange(B))
        assert int((st & ops.STATUS_WARP_LOOP).count_nonzero()) == 0, cf


@pytest.mark.parametrize("budget,K", [(16, 16), (64, 64), (128, 128), (256, 256), (1024, 256)])
def test_tree_build_on_deep_trees(ops, budget, K):
    """A confident drafter's trees (15 levels, narrow deep levels) at batch 16 and 64: the
    heap's trees, on the threshold path (laid out at once a warp a depth below rows of 128,
    dealt over all threads from 128)."""
    for B in (16, 64):
        lp, ids = stage_a_inputs(B, 15, 8192, K, seed=B + budget, drafts="confident")
        _, st = gpu_vs_cpu(ops, lp, ids, np.full(B, budget), np.arange(B), np.arange(B))
        assert int((st & ops.STATUS_WARP_LOOP).count_nonzero()) == 0, B


@pytest.mark.parametrize("budget", [16, 64, 128, 256])
def test_tree_build_on_deep_trees_with_tied_scores(ops, budget):
    """A confident drafter's one-deviation trees with many equal scores (rows rounded to
    quarter units): the layout's one-word keys order the ties as the heap does."""
    lp, ids = stage_a_inputs(16, 15, 8192, budget, seed=3 * budget, drafts="confident")
    _, st = gpu_vs_cpu(ops, tied_one_deviation_rows(lp, 0.25), ids, np.full(16, budget), np.arange(16),
                       np.arange(16))
    assert int((st & ops.STATUS_WARP_LOOP).count_nonzero()) == 0


@pytest.mark.parametrize("K", [40, 50, 64, 100])
def test_tree_build_levels_led_by_one_or_two_parents(ops, K):
    """Levels of a few parents with many children beside many with few (a drafter sure of its
    first one to three tokens, flat after): the one-CTA kernel takes up to two such lead
    parents first, by 32-rank ballots; rows of K not a multiple of 32, lead parents with more
    than 32 children, and three leads (the general path) among them."""
    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 30)))
    B, L = 16, 6
    lp = np.empty((B, L, K), dtype=np.float32)
    for b in range(B):  # depth 1: 1-3 sure tokens, the rest below; depth 2 wide; then steep
        lead = 1 + b % 3
        lp[b, 0] = np.sort(rng.uniform(-1.0 - K / 40, -1.0, K))[::-1]
        lp[b, 0, :lead] = np.sort(rng.uniform(-0.3, -0.01, lead))[::-1]
        lp[b, 1] = np.sort(rng.uniform(-1.0 - K / 40, -0.05, K))[::-1]
        for d in range(2, L):
            lp[b, d] = np.sort(rng.uniform(-8.0, -3.0, K))[::-1]
            lp[b, d, 0] = -rng.uniform(0.3, 1.0)
    ids = torch.as_tensor(rng.permuted(np.tile(np.arange(4 * K), (B, L, 1)), axis=2)[:, :, :K].copy())
    budgets = rng.integers(32, 129, B)
    want, st = gpu_vs_cpu(ops, torch.as_tensor(lp), ids, budgets, np.arange(B), np.arange(B))
    assert int((st & ops.STATUS_WARP_LOOP).count_nonzero()) == 0
    # The trees have the shape meant: a depth-1 level of 5-32 nodes, one of them parent to 16 or more.
    shaped = 0
    for b in range(B):
        n = int(want.node_counts[b])
        depth, parent = want.depths[b, 1:n + 1], want.parents[b, 1:n + 1]
        level1 = np.flatnonzero(depth == 1) + 1
        kids = [int(np.sum(parent[depth == 2] == p)) for p in level1]
        shaped += 5 <= len(level1) <= 32 and max(kids, default=0) >= 16
    assert shaped >= 2, shaped


@pytest.mark.parametrize("budget,K,V,seed", [(1024, 256, 8192, 1), (256, 64, 8192, 21), (512, 128, 4000, 19)])
def test_tree_build_ties_at_the_budget_th_score_stay_on_the_threshold_path(ops, budget, K, V, seed):
    """Requests whose ties at the budget-th score alone fill the node buffer (coarse rows,
    top-k below the budget) are selected with the ties in path order, not by the warp loop."""
    lp, ids = stage_a_inputs(8, 15, V, K, seed=1000 + seed, coarse_fraction=1.0)
    _, st = gpu_vs_cpu(ops, lp, ids, np.full(8, budget), np.arange(8), np.arange(8))
    assert int((st & ops.STATUS_WARP_LOOP).count_nonzero()) == 0


def test_tree_build_uncertified_rows_take_the_warp_loop(ops):
    """Unsorted rows (outside stage A's contract, still a valid heap input) fall back to the
    heap-exact warp loop, request by request, and still match the CPU build."""
    rng = np.random.default_rng(9)
    B, budget = 24, 200
    lp, ids = stage_a_inputs(B, 15, 3000, budget, seed=9, coarse_fraction=0.5)
    shuffled = np.arange(B) % 3 == 0
    for b in np.nonzero(shuffled)[0]:
        d = int(rng.integers(15))
        perm = torch.as_tensor(rng.permutation(budget))
        lp[b, d], ids[b, d] = lp[b, d, perm].clone(), ids[b, d, perm].clone()
    _, st = gpu_vs_cpu(ops, lp, ids, np.full(B, budget), np.arange(B), np.arange(B))
    assert np.array_equal((st & ops.STATUS_WARP_LOOP).numpy() != 0, shuffled)


def test_tree_build_positive_log_probs_take_the_warp_loop(ops):
    """Log-probs > 0 (documented as accepted, outside stage A) are built exactly, like the CPU."""
    B, budget = 8, 64
    lp, ids = stage_a_inputs(B, 15, 3000, budget, seed=3)
    lp[::2, 0, 0] = 0.5                      # still sorted, but above 0
    _, st = gpu_vs_cpu(ops, lp, ids, np.full(B, budget), np.arange(B), np.arange(B))
    assert np.array_equal((st & ops.STATUS_WARP_LOOP).numpy() != 0, np.arange(B) % 2 == 0)


# RTX PRO 6000 (sm_120): 99 KB of shared memory a block, less the kernel's static arrays.
SM120_ROOM = 99 * 1024 - 26656


@pytest.mark.parametrize("limit", [SM120_ROOM, 1])
def test_tree_build_on_a_smaller_gpus_shared_memory(ops, limit):
    """With the build's shared memory capped (sm_120's room; 1 byte: nothing staged, no
    bit rows in shared memory), every path the smaller GPU takes still matches the CPU."""
    rng = np.random.default_rng(limit)
    old = ops.lib().kd_build_set_smem_limit(limit)
    try:
        for V, cf in ((8192, 0.3), (7, 1.0)):
            budgets = rng.choice(BUDGET_CHOICES, size=48)
            budgets[:4] = 1024
            lp, ids = stage_a_inputs(48, 15, V, 1024, seed=int(rng.integers(1 << 30)), coarse_fraction=cf)
            gpu_vs_cpu(ops, lp, ids, budgets, rng.integers(0, 1000, size=48), rng.integers(0, V, size=48))
            small = np.minimum(budgets, 200)  # D 201: threshold selection fits sm_120
            _, st = gpu_vs_cpu(ops, lp, ids, small, np.arange(48), np.arange(48))
            if limit > 1:
                assert int((st & ops.STATUS_WARP_LOOP).count_nonzero()) == 0
    finally:
        ops.lib().kd_build_set_smem_limit(old)


def test_tree_build_neg_inf_clamped_like_cpu(ops):
    lp, ids = stage_a_inputs(16, 15, 500, 64, seed=5)
    lp[:, :, 40:] = float("-inf")
    lp[3, 2, 1:] = float("-inf")
    gpu_vs_cpu(ops, lp, ids, np.full(16, 64), np.zeros(16), np.zeros(16))
    assert NEG_INF_FLOOR == -1e4


@pytest.mark.parametrize("d_max", [17, 33, 64, 65, 100, 128, 129, 257])
def test_tree_build_bit_rows_without_the_dense_mask(ops, d_max):
    """Without the dense mask (tree_build's default) rows of up to four words (D <= 128) are
    made in registers and written from there, larger ones through shared memory: the CPU
    build's bits either way, with ragged budgets (padding slots), shallow and deep trees."""
    rng = np.random.default_rng(d_max)
    B = 24
    for drafts in ("mixed", "confident"):
        budgets = rng.integers(0, d_max, B)
        budgets[0] = d_max - 1
        lp, ids = stage_a_inputs(B, 15, 8192, d_max - 1, seed=d_max, drafts=drafts)
        gpu_vs_cpu(ops, lp, ids, budgets, rng.integers(0, 100_000, B), rng.integers(0, 8192, B), d_max=d_max,
                   dense=False)


@pytest.mark.parametrize("d_max", [17, 100, 300])
def test_tree_build_c_abi_without_row_outputs(ops, d_max):
    """A C caller may pass neither row output (no dense mask, no bit rows): every other
    output is still the CPU build's, and no row is written anywhere."""
    rng = np.random.default_rng(1000 + d_max)
    B = 12
    budgets = rng.integers(0, d_max, B)
    budgets[0] = d_max - 1
    seq, roots = rng.integers(0, 100_000, B), rng.integers(0, 8192, B)
    lp, ids = stage_a_inputs(B, 15, 8192, d_max - 1, seed=d_max, drafts="confident")
    want = build_trees(lp, ids, budgets, seq_lens=seq, root_tokens=roots, d_max=d_max)
    out = poisoned_trees(B, d_max, DEV, dense=False)
    t = {n: x.to(DEV) for n, x in (("lp", lp), ("ids", ids))}
    bud = torch.as_tensor(budgets, dtype=torch.int32, device=DEV)
    sq = torch.as_tensor(seq, dtype=torch.int32, device=DEV)
    rt = torch.as_tensor(roots, dtype=torch.int64, device=DEV)
    ptrs = [ops._ptr(getattr(out, f)) for f in FIELDS[:7]]
    rc = ops.lib().kd_build_trees(ops._ptr(t["lp"]), ops._ptr(t["ids"]), ops._ptr(bud), ops._ptr(sq), ops._ptr(rt),
                                  B, 15, d_max - 1, d_max, *ptrs, None, None, ops._ptr(out.status),
                                  ops._stream(torch.device(DEV)))
    assert rc == 0
    torch.cuda.synchronize()
    for f in FIELDS[:7]:
        assert np.array_equal(getattr(out, f).cpu().numpy(), getattr(want, f)), f
    assert (out.visibility_bits == TREE_POISON).all()  # not passed: left as poisoned
    assert ((out.status.cpu() & ~ops.STATUS_WARP_LOOP) == 0).all()


def test_tree_build_zero_budget_and_padding(ops):
    lp, ids = stage_a_inputs(6, 15, 300, 40, seed=6)
    gpu_vs_cpu(ops, lp, ids, np.array([0, 1, 40, 0, 7, 39]), np.arange(6), np.arange(6), d_max=45)


def test_tree_build_status_flags(ops):
    lp, ids = stage_a_inputs(3, 15, 100, 16, seed=7)
    lp[1, 4, 2] = float("nan")
    budgets = torch.tensor([16, 16, 16], dtype=torch.int32, device=DEV)
    got = ops.tree_build(lp.to(DEV), ids.to(DEV), budgets, d_max=9)
    st = got.status.cpu().tolist()
    assert st[1] & ops.STATUS_NAN_INPUT and got.node_counts[1].item() == 0
    assert st[0] == ops.STATUS_BUDGET_CLAMPED and got.node_counts[0].item() == 8
    with pytest.raises(InputError, match="top_logprobs: NaN"):
        got.raise_on_status()


def test_tree_build_argument_errors(ops):
    lp, ids = stage_a_inputs(2, 15, 100, 16, seed=8)
    b = torch.tensor([4, 4], dtype=torch.int32, device=DEV)
    with pytest.raises(InputError, match="top_logprobs: expected a CUDA tensor"):
        ops.tree_build(lp, ids.to(DEV), b)
    with pytest.raises(InputError, match="top_ids: expected dtype torch.int64"):
        ops.tree_build(lp.to(DEV), ids.to(DEV).int(), b)
    with pytest.raises(InputError, match=r"budgets: expected shape \[2\]"):
        ops.tree_build(lp.to(DEV), ids.to(DEV), b[:1])
    for bad in (2000, 0, True):
        with pytest.raises(InputError, match="d_max: expected"):
            ops.tree_build(lp.to(DEV), ids.to(DEV), b, d_max=bad)


def test_tree_build_reused_outputs_are_checked_again_when_changed(ops):
    """A reused ``out=`` is checked in full once; a field replaced, viewed as another dtype or
    resized, or another D, is checked again and refused by name."""
    B, budget = 3, 16
    lp, ids = stage_a_inputs(B, 15, 300, budget, seed=int(np.random.default_rng().integers(1 << 30)))
    seq, roots = np.arange(B) + 5, np.arange(B) + 1
    want = build_trees(lp, ids, np.full(B, budget), seq_lens=seq, root_tokens=roots)
    args = (lp.to(DEV), ids.to(DEV), torch.full((B,), budget, dtype=torch.int32, device=DEV))
    kw = dict(seq_lens=torch.as_tensor(seq, dtype=torch.int32, device=DEV),
              root_tokens=torch.as_tensor(roots, dtype=torch.int64, device=DEV))
    out = poisoned_trees(B, want.D, DEV)

    def build_and_compare():
        for f in FIELDS:
            getattr(out, f).view(torch.uint8).fill_(0x5A)
        ops.tree_build(*args, **kw, d_max=want.D, out=out)
        for f in FIELDS:
            assert np.array_equal(getattr(out, f).cpu().numpy(), getattr(want, f)), f

    build_and_compare()
    build_and_compare()  # the recorded check
    good = out.tokens
    out.tokens = torch.empty(B, want.D, dtype=torch.int32, device=DEV)
    with pytest.raises(InputError, match="out.tokens: expected dtype torch.int64"):
        ops.tree_build(*args, **kw, d_max=want.D, out=out)
    out.tokens = good.view(torch.float64)  # same storage and pointer, another dtype
    with pytest.raises(InputError, match="out.tokens: expected dtype torch.int64"):
        ops.tree_build(*args, **kw, d_max=want.D, out=out)
    out.tokens = good
    build_and_compare()
    out.depths.resize_(B, want.D + 64)  # a larger storage: a new pointer
    with pytest.raises(InputError, match=r"out.depths: expected shape"):
        ops.tree_build(*args, **kw, d_max=want.D, out=out)
    out.depths = torch.empty(B, want.D, dtype=torch.int64, device=DEV)
    with pytest.raises(InputError, match=r"out.node_counts: expected shape \[2\]"):
        ops.tree_build(*(a[:2] for a in args), **{k: v[:2] for k, v in kw.items()}, d_max=want.D, out=out)
    with pytest.raises(InputError, match=r"out.tokens: expected shape"):
        ops.tree_build(*args, **kw, d_max=want.D + 1, out=out)
    build_and_compare()


def test_launches_go_to_the_callers_stream(ops):
    """Kernels launch on the caller's current stream (a side stream, a graph capture's)."""
    dev = torch.zeros(1, device=DEV).device          # with its index
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert ops._stream(dev) == side.cuda_stream
    assert ops._stream(dev) == torch.cuda.current_stream(dev).cuda_stream
    # a build queued behind a slow op on a side stream sees that op's result
    lp, ids = stage_a_inputs(2, 15, 300, 16, seed=5)
    lp, ids = lp.to(DEV), ids.to(DEV)
    budgets = torch.zeros(2, dtype=torch.int32, device=DEV)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000)                 # ~1 ms of GPU time before the fill
        budgets.fill_(16)
        trees = ops.tree_build(lp, ids, budgets, d_max=17)
    side.synchronize()
    assert trees.node_counts.tolist() == [16, 16]        # 0 had it run before the fill


# ---------------------------------------------------------------- accept
def random_accept_case(rng, B, budget, V=40):
    lp, ids = stage_a_inputs(B, 15, V, budget, seed=int(rng.integers(1 << 30)), coarse_fraction=0.5)
    tb = build_trees(lp, ids, np.full(B, budget), root_tokens=rng.integers(0, V, B))
    target = rng.integers(0, V, size=(B, tb.D)).astype(np.int64)
    follow = rng.random(B) < 0.8
    for b in range(B):   # follow the first child most of the time, sometimes to full depth
        for i in range(tb.D):
            c = tb.next_token[b, i]
            if follow[b] and c != -1 and rng.random() < 0.9:
                target[b, i] = tb.tokens[b, c]
    return tb, target


@pytest.mark.parametrize("B,budget", [(1, 1), (7, 16), (64, 64), (256, 256), (33, 1024)])
def test_tree_accept_matches_cpu(ops, B, budget):
    rng = np.random.default_rng(B + budget)
    tb, target = random_accept_case(rng, B, budget)
    want = greedy_accept_batch(tb.tokens, tb.next_token, tb.next_sibling, target, 15)
    t = lambda a: torch.as_tensor(a).to(DEV)
    got = ops.tree_accept(t(tb.tokens), t(target), 15, next_token=t(tb.next_token), next_sibling=t(tb.next_sibling))
    for g, w in zip(got, want):
        assert np.array_equal(g.cpu().numpy(), w)
    assert B < 7 or (want[1].max() >= 1 and (want[1] == 0).any())  # both outcomes exercised


def random_lcrs(rng, B, D, V):
    """Random trees given as LCRS lists in slot order (as the build writes them)."""
    nt = np.full((B, D), -1, np.int64)
    ns = np.full((B, D), -1, np.int64)
    cand = rng.integers(0, V, size=(B, D))
    for b in range(B):
        last = {}
        for i in range(1, D):
            p = int(rng.integers(max(0, i - 8), i))   # deep-ish trees
            if p in last:
                ns[b, last[p]] = i
            else:
                nt[b, p] = i
            last[p] = i
    return cand, nt, ns


@pytest.mark.parametrize("links", [torch.int64, torch.int32])
@pytest.mark.parametrize("B,D,max_depth", [(3, 5000, 40), (5, 300, 0), (9, 300, 70)])
def test_tree_accept_wide_rows_and_depth_limits(ops, B, D, max_depth, links):
    """D = 5000 walks global memory (too wide to stage); max_depth 0 and > 32 fill the tail;
    the lists as i64 (the build's) or i32 (SGLang's)."""
    rng = np.random.default_rng(D + max_depth)
    V = 3
    cand, nt, ns = random_lcrs(rng, B, D, V)
    target = rng.integers(0, V, size=(B, D))
    want = greedy_accept_batch(cand, nt, ns, target, max_depth)
    t = lambda a: torch.as_tensor(a).to(DEV)
    got = ops.tree_accept(t(cand), t(target), max_depth, next_token=t(nt).to(links), next_sibling=t(ns).to(links))
    for g, w in zip(got, want):
        assert np.array_equal(g.cpu().numpy(), w)
    assert max_depth == 0 or want[1].max() >= 2


def capped_walk(cand, nt, ns, target, max_depth, steps_out=None):
    """The kernel's walk on any lists (greedy_accept_batch assumes a tree): a link out of
    [0, D) ends its list, and a request stops after D steps (cycles). steps_out, a list,
    gets each request's count of tested slots."""
    B, D = cand.shape
    idx = np.full((B, max_depth + 1), -1, np.int32)
    alen = np.zeros(B, np.int32)
    bonus = np.zeros(B, np.int64)
    ok = lambda x: int(x) if 0 <= x < D else -1
    for b in range(B):
        cur, k, steps = 0, 0, 0
        idx[b, 0] = b * D
        child = ok(nt[b, 0])
        while child != -1 and k < max_depth and steps < D:
            if cand[b, child] == target[b, cur]:
                cur, k = child, k + 1
                idx[b, k] = b * D + cur
                child = ok(nt[b, cur])
            else:
                child = ok(ns[b, child])
            steps += 1
        alen[b], bonus[b] = k, target[b, cur]
        if steps_out is not None:
            steps_out.append(steps)
    return idx, alen, bonus


@pytest.mark.parametrize("corruption", ["cycle", "two_preds", "root_link", "child_and_sibling",
                                        "out_of_range", "none"])
@pytest.mark.parametrize("links", [torch.int64, torch.int32])
@pytest.mark.parametrize("D", [50, 200, 2500])
def test_tree_accept_on_trees_and_corrupt_lists(ops, corruption, D, links):
    """Both staged paths (D 50: a warp per request; 200 and 2500: a CTA, 2500 close to the
    shared-memory limit): the walk equals the reference on trees (duplicate tokens among
    siblings: the first in list order wins) and the capped walk on lists that are not a
    forest (requests 0-2 here: cycles, two predecessors, links to the root or out of range)."""
    rng = np.random.default_rng(sum(map(ord, corruption)) + D)
    B, V = 6, 3
    cand, nt, ns = random_lcrs(rng, B, D, V)
    target = rng.integers(0, V, size=(B, D))
    for b in range(B):           # mostly follow the first child: deep walks
        for i in range(D):
            if nt[b, i] != -1 and rng.random() < 0.9:
                target[b, i] = cand[b, nt[b, i]]
    valid_want = greedy_accept_batch(cand, nt, ns, target, 15) if corruption == "none" else None
    for b in range(3 if corruption != "none" else 0):
        linked = [i for i in range(1, D) if ns[b, i] != -1]
        u = int(rng.choice(linked))
        v = int(ns[b, u])
        if corruption == "cycle":
            ns[b, v] = u
        elif corruption == "two_preds":
            w = next(i for i in range(1, D) if ns[b, i] == -1 and i not in (u, v))
            ns[b, w] = v
        elif corruption == "root_link":
            ns[b, v] = 0
        elif corruption == "child_and_sibling":
            first = next(int(nt[b, i]) for i in range(1, D) if nt[b, i] > 0 and nt[b, i] != v)
            w = next(i for i in range(1, D) if ns[b, i] == -1 and i != first)
            ns[b, w] = first
        elif corruption == "out_of_range":
            ns[b, u] = D + 7
            nt[b, int(rng.integers(1, D))] = -5
    want = capped_walk(cand, nt, ns, target, 15)
    t = lambda a: torch.as_tensor(np.ascontiguousarray(a, dtype=np.int64)).to(DEV)
    got = ops.tree_accept(t(cand), t(target), 15, next_token=t(nt).to(links), next_sibling=t(ns).to(links))
    for g, w in zip(got, want):
        assert np.array_equal(g.cpu().numpy(), w)
    if valid_want is not None:
        for g, w in zip(got, valid_want):
            assert np.array_equal(g.cpu().numpy(), w)
        assert want[1].max() >= 2     # the walks went below the root's children


@pytest.mark.parametrize("order", ["slot", "shuffled"])
@pytest.mark.parametrize("D", [65, 300, 1500, 2500])
def test_tree_accept_long_sibling_scans(ops, D, order):
    """Wide nodes and targets that match late siblings: walks test many slots, through
    lists in slot order or (shuffled) not, and equal the reference."""
    rng = np.random.default_rng(D + (order == "shuffled"))
    B, V = 8, 40
    nt = np.full((B, D), -1, np.int64)
    ns = np.full((B, D), -1, np.int64)
    cand = rng.integers(0, V, size=(B, D))
    target = rng.integers(0, V, size=(B, D))
    for b in range(B):
        last, kids = {}, {}
        for i in range(1, D):
            # a quarter to the root, the rest to a slot in [i/3, i/2): long lists, some depth
            p = 0 if i < 4 or rng.random() < 0.25 else int(rng.integers(i // 3, i // 2))
            if p in last:
                ns[b, last[p]] = i
            else:
                nt[b, p] = i
            last[p] = i
            kids.setdefault(p, []).append(i)
        for p, ks in kids.items():                       # mostly a late child's token
            if rng.random() < 0.9:
                target[b, p] = cand[b, ks[int(rng.integers(len(ks) // 2, len(ks)))]]
        if order == "shuffled":                          # relabel slots 1.. at random
            perm = np.concatenate([[0], 1 + rng.permutation(D - 1)])   # old slot -> new slot
            relabel = lambda a: np.where(a >= 0, perm[np.maximum(a, 0)], -1)
            inv = np.argsort(perm)
            nt[b], ns[b] = relabel(nt[b])[inv], relabel(ns[b])[inv]
            cand[b], target[b] = cand[b][inv], target[b][inv]
    want = greedy_accept_batch(cand, nt, ns, target, 15)
    steps = []
    for g, w in zip(want, capped_walk(cand, nt, ns, target, 15, steps_out=steps)):
        assert np.array_equal(g, w)
    assert max(steps) > 16 and want[1].max() >= 2
    t = lambda a: torch.as_tensor(np.ascontiguousarray(a, dtype=np.int64)).to(DEV)
    got = ops.tree_accept(t(cand), t(target), 15, next_token=t(nt), next_sibling=t(ns))
    for g, w in zip(got, want):
        assert np.array_equal(g.cpu().numpy(), w)


@pytest.mark.parametrize("D", [5, 101, 1502])
def test_tree_accept_step_cap_with_a_self_loop(ops, D):
    """The D-step cap on a list that is not a tree: slot 1 (token 5) and its sibling 2
    (token 7) both have slot 1 as first child, and the targets alternate 5, 7, so matches
    cost 1 and 2 steps in turn; with D = 2 (mod 3) the cap leaves one step when the match
    is the second sibling, which must then not be taken."""
    cand = np.zeros((2, D), np.int64)
    nt = np.full((2, D), -1, np.int64)
    ns = np.full((2, D), -1, np.int64)
    target = np.zeros((2, D), np.int64)
    cand[:, 1:3] = [5, 7]
    target[:, :3] = [5, 7, 5]
    nt[:, 0:3] = 1
    ns[:, 1] = 2
    target[1, 0] = 7               # request 1 matches the second sibling first
    max_depth = D + 10             # so the step cap ends the walk, not the depth
    want = capped_walk(cand, nt, ns, target, max_depth)
    assert want[1][0] == 2 * (D // 3) + 1   # request 0: one step left for a two-step visit
    t = lambda a: torch.as_tensor(a).to(DEV)
    got = ops.tree_accept(t(cand), t(target), max_depth, next_token=t(nt), next_sibling=t(ns))
    for g, w in zip(got, want):
        assert np.array_equal(g.cpu().numpy(), w)


def test_tree_accept_corrupt_links_end_the_walk(ops):
    """Out-of-range and cyclic links stop the walk instead of reading past the row or hanging."""
    D = 8
    cand = torch.zeros(2, D, dtype=torch.int64)
    target = torch.ones(2, D, dtype=torch.int64)            # nothing matches: siblings forever
    nt = torch.full((2, D), -1, dtype=torch.int64)
    ns = torch.full((2, D), -1, dtype=torch.int64)
    nt[:, 0] = 1
    ns[0, 1], ns[0, 2] = 2, 1                                # cycle 1 -> 2 -> 1
    ns[1, 1] = D + 5                                         # out of range
    idx, alen, bonus = ops.tree_accept(cand.to(DEV), target.to(DEV), 4, next_token=nt.to(DEV), next_sibling=ns.to(DEV))
    assert alen.tolist() == [0, 0] and bonus.tolist() == [1, 1]
    assert idx[1].tolist() == [D, -1, -1, -1, -1]


def test_tree_accept_full_depth_chain(ops):
    D = 16
    cand = torch.arange(D, dtype=torch.int64).repeat(3, 1)
    nt = torch.cat([torch.arange(1, D), torch.tensor([-1])]).repeat(3, 1)
    ns = torch.full((3, D), -1, dtype=torch.int64)
    target = torch.cat([torch.arange(1, D), torch.tensor([99])]).repeat(3, 1)
    target[1, 0] = 55          # request 1: nothing accepted
    target[2, 7] = 55          # request 2: stops after 7
    idx, alen, bonus = ops.tree_accept(cand.to(DEV), target.to(DEV), 15, next_token=nt.to(DEV), next_sibling=ns.to(DEV))
    assert alen.tolist() == [15, 0, 7] and bonus.tolist() == [99, 55, 55]
    assert idx[0].tolist() == list(range(16))
    assert idx[1].tolist() == [D] + [-1] * 15


def accept_parents_poisoned(ops, cand, par, counts, target, max_depth):
    """The parents kernel into outputs filled with garbage first."""
    t = lambda a: torch.as_tensor(np.ascontiguousarray(a)).to(DEV)
    B = cand.shape[0]
    out = poisoned_accept(B, max_depth, DEV)
    got = ops.tree_accept(t(cand), t(target), max_depth, parents=t(par), node_counts=t(counts), out=out)
    assert all(g is o for g, o in zip(got, out))
    return [g.cpu().numpy() for g in got]


@pytest.mark.parametrize("B,budget", [(3, 0), (1, 1), (7, 16), (64, 64), (256, 256), (33, 1024)])
def test_tree_accept_parents_equals_the_walk(ops, B, budget):
    """On built trees, ragged (smaller budgets leave padding slots: parent 0, PAD_TOKEN),
    the parents kernel gives the list walk's result, CPU and GPU."""
    rng = np.random.default_rng(7 * B + budget)
    V = 40
    budgets = np.where(rng.random(B) < 0.3, rng.integers(0, budget + 1, B), budget)
    lp, ids = stage_a_inputs(B, 15, V, max(budget, 1), seed=B + budget, coarse_fraction=0.5)
    tb = build_trees(lp, ids, budgets, root_tokens=rng.integers(0, V, B), d_max=budget + 1)
    target = follow_targets(tb, V, 0.85, rng)
    target[::4, 0] = 0            # PAD_TOKEN at the root: padding must not match
    want = greedy_accept_batch(tb.tokens, tb.next_token, tb.next_sibling, target, 15)
    got = accept_parents_poisoned(ops, tb.tokens, tb.parents, tb.node_counts, target, 15)
    for g, w in zip(got, want):
        assert np.array_equal(g, w)
    t = lambda a: torch.as_tensor(a).to(DEV)
    walk = ops.tree_accept(t(tb.tokens), t(target), 15, next_token=t(tb.next_token), next_sibling=t(tb.next_sibling))
    for g, w in zip(got, walk):
        assert np.array_equal(g, w.cpu().numpy())
    assert budget < 16 or want[1].max() >= 2


@pytest.mark.parametrize("D,max_depth", [(2, 15), (64, 15), (65, 0), (512, 15), (513, 70),
                                         (1280, 15), (1281, 15), (4096, 40)])
def test_tree_accept_parents_on_any_rows(ops, D, max_depth):
    """Every launch shape (a warp, a CTA with 2, 5 or 16 slots a thread) on random deep
    trees with duplicate sibling tokens (the smallest slot wins), corrupt parents (a slot
    itself, later slots, out of range: not nodes) and node counts out of range (clamped),
    against the CPU reference."""
    rng = np.random.default_rng(D + max_depth)
    B, V = 9, 3
    cand = rng.integers(0, V, size=(B, D)).astype(np.int64)
    par = np.full((B, D), -1, np.int32)
    for i in range(1, D):
        par[:, i] = np.where(rng.random(B) < 0.5, i - 1, rng.integers(max(0, i - 6), i, B))
    target = rng.integers(0, V, size=(B, D)).astype(np.int64)
    for i in range(1, D):           # mostly some child's token: deep walks
        hit = rng.random(B) < 0.8
        target[hit, par[hit, i]] = cand[hit, i]
    counts = np.full(B, D - 1, np.int32)
    counts[1], counts[2], counts[3] = -3, D + 5, rng.integers(0, D)
    for b in (4, 5, 6):
        for i in rng.integers(1, D, size=max(1, D // 8)):
            par[b, i] = rng.choice([i, i + 1, D + 3, -5, 1 << 30])
    want = greedy_accept_parents_batch(cand, par, counts, target, max_depth)
    got = accept_parents_poisoned(ops, cand, par, counts, target, max_depth)
    for g, w in zip(got, want):
        assert np.array_equal(g, w)
    assert max_depth == 0 or D < 64 or want[1].max() >= 3     # walks go several levels down


def test_tree_accept_parents_errors_name_the_argument(ops):
    cand = torch.zeros(2, 8, dtype=torch.int64, device=DEV)
    par = torch.zeros(2, 8, dtype=torch.int32, device=DEV)
    n = torch.full((2,), 7, dtype=torch.int32, device=DEV)
    with pytest.raises(InputError, match="parents: expected dtype torch.int32"):
        ops.tree_accept(cand, cand, 15, parents=par.long(), node_counts=n)
    with pytest.raises(InputError, match=r"node_counts: expected shape \[2\]"):
        ops.tree_accept(cand, cand, 15, parents=par, node_counts=n[:1])
    with pytest.raises(InputError, match=r"out.accept_index: expected shape \[2, 16\]"):
        ops.tree_accept(cand, cand, 15, parents=par, node_counts=n, out=(n, n, cand[:, 0]))
    wide = torch.zeros(1, 4097, dtype=torch.int64, device=DEV)
    with pytest.raises(InputError, match="tokens: expected at most 4096 slots"):
        ops.tree_accept(wide, wide, 15, parents=wide.int(), node_counts=n[:1])
    # the lists' two tensors share one dtype, int64 or int32
    with pytest.raises(InputError, match="next_sibling: expected dtype torch.int32, got torch.int64"):
        ops.tree_accept(cand, cand, 15, next_token=par, next_sibling=cand)
    with pytest.raises(InputError, match="next_token: expected dtype torch.int64, got torch.int16"):
        ops.tree_accept(cand, cand, 15, next_token=par.short(), next_sibling=cand)


# ---------------------------------------------------------------- attention
def check_attention(ops, case, num_splits=None, bits=False, kernel="auto"):
    vis = case.visibility
    if bits:
        vis = torch.from_numpy(pack_visibility(vis.cpu().numpy())).to(DEV)
    B, D, H, _ = case.q.shape
    out = torch.full((B, D, H, 512), float("nan"), dtype=torch.bfloat16, device=DEV)
    lse = torch.full((B, D, H), float("nan"), dtype=torch.float32, device=DEV)
    got = ops.tree_verify(case.q, case.kv_cache, case.block_table, case.seq_lens, vis, SCALE,
                          kernel=kernel, num_splits=num_splits, out=(out, lse))
    assert got.out is out and got.lse is lse
    return assert_matches_reference(case, out, lse)


def assert_matches_reference(case, out, lse) -> float:
    """A verify launch's out and lse (poisoned before it) against the float64 reference."""
    ref_o, ref_l = verify_attention_ref(case.q, case.kv_cache, case.block_table, case.seq_lens,
                                        case.visibility, SCALE)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    rel = (out.double() - ref_o).norm() / ref_o.norm()
    assert rel <= 5e-3, float(rel)
    assert (lse.double() - ref_l).abs().max() <= 1e-3
    return float(rel)


ATTN_GRID = [
    # prefixes (ragged, P = 0, non-multiples of tile and page), D, H, page size
    ([0, 1, 37, 300], 1, 8, 64),
    ([0, 5, 64, 129], 16, 8, 1),
    ([1000, 0, 31, 2049], 16, 16, 64),
    ([513, 77], 64, 8, 64),
    ([250, 4100], 5, 64, 1),
    ([3000], 257, 8, 64),
    ([0, 200], 1025, 8, 64),
    ([100], 1025, 16, 1),
    ([8192, 70], 33, 64, 64),
    # Small trees in launches that fill the GPU: the wgmma kernel on Hopper, one partial
    # row tile (8, 32 or 64 rows; cp.async for pages of 1 row).
    ([0, 9000, 4100, 33], 1, 8, 64),
    ([5000, 1], 2, 16, 64),
    ([70, 8000], 4, 16, 1),
]


@pytest.fixture(params=["auto", "mma_sync", "wgmma_cp_async", "wgmma_combine"])
def verify_path(request, ops):
    """Every verify kernel, chosen per call: "auto" is wgmma on Hopper (but mma.sync for one
    row tile in a small launch; keys by TMA where the page size is a multiple of 64; 2
    splits merged in clusters from 16 row tiles), "mma_sync" the kernel every other GPU
    runs (sm_120 among them), "wgmma_cp_async" the wgmma kernel's cp.async copy,
    "wgmma_combine" its splits merged by the combine kernel: forced so the H200 tests all."""
    return request.param


def plan(ops, B, R, page=64, max_seq=None, kernel="auto", num_splits=None, H=8, per_request=False):
    """The plan of B requests of R = D * H rows over max_seq keys (default: a launch that fills
    the GPU)."""
    assert R % H == 0
    max_seq = max_seq or 64 * 1024
    return ops.TreeVerifyPlan(B, R // H, H, page, -(-max_seq // page), kernel=kernel, num_splits=num_splits,
                              per_request_splits=per_request)


def test_hopper_dispatches_to_wgmma(ops):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma path: Hopper (sm_90) only")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tile = lambda pl: (pl.rows_per_cta, pl.keys_per_tile)
    assert tile(plan(ops, 16, 257 * 8)) == (64, 64)    # the wgmma tile
    assert tile(plan(ops, 16, 8)) == (64, 64)          # small trees too
    # ... but one row tile in a small launch takes mma.sync's tiles of 32 keys.
    assert tile(plan(ops, 1, 8, max_seq=1024)) == (16, 32)
    assert tile(plan(ops, 1, 64, max_seq=1024)) == (64, 32)
    assert tile(plan(ops, 1, 72, max_seq=1024)) == (64, 64)
    for B, max_seq in ((1, 64), (1, 1024), (1, 8192), (3, 1024), (16, 1024), (64, 64)):
        want = 2 * B * -(-max_seq // 64) < sms
        assert plan(ops, B, 8, max_seq=max_seq).small_launch == want, (B, max_seq)
    assert plan(ops, 1, 8, max_seq=1024).name == "mma_sync"
    assert plan(ops, 1, 8, max_seq=64 * sms).name != "mma_sync"
    # Keys by TMA for pages of 64k rows, one CTA a tile at any row-tile count (no pairs).
    assert plan(ops, 16, 257 * 8).name == "wgmma_tma"        # 33 row tiles
    assert plan(ops, 16, 16 * 8).name == "wgmma_tma"         # 2 row tiles
    assert plan(ops, 16, 64 * 16).name == "wgmma_tma"        # 16 row tiles
    assert plan(ops, 16, 64 * 16, page=192).name == "wgmma_tma"
    # Other page sizes: TMA for the tiles of consecutive cache rows, cp.async for the rest.
    assert plan(ops, 16, 64 * 16, page=32).name == "wgmma_tma_runs"
    assert plan(ops, 16, 16 * 8, page=1).name == "wgmma_tma_runs"
    assert plan(ops, 16, 16 * 8, page=1, kernel="wgmma_cp_async").name == "wgmma"
    # Splits on the TMA path: 2 merge in clusters from 16 row tiles on, where the clusters
    # all fit at once.
    merge = lambda B, page=64, splits=2, kernel="auto": plan(ops, B, 16 * 8, page, kernel=kernel,
                                                             num_splits=splits).merge
    assert merge(16, splits=1) == "none"
    # The combine follows as a programmatic dependent: after wgmma held to ceil(CTAs / SMs)
    # an SM where it launches at most 4 CTAs an SM (a warp per half row: 2 B R / 8), else
    # plainly.
    combine = lambda B, R, splits, kernel="auto": plan(ops, B, R, kernel=kernel, num_splits=splits).combine
    assert combine(16, 8, 8) == "programmatic_held"                # 32 CTAs
    assert combine(4, 8, 40) == "programmatic_held"                # a CTA per quarter row: 128
    if sms >= 128:
        assert combine(16, 16 * 8, 4) == "programmatic_held"       # 512 CTAs
    assert combine(16, 16 * 8 * 8, 3) == "plain"                   # 4,096 CTAs
    assert combine(1, 8, 40, kernel="mma_sync") == "programmatic"  # after mma.sync, always
    assert combine(16, 8, 1) is None and combine(8, 16 * 8, 2) is None  # one split; clusters
    assert merge(8) == "cluster"                  # 16 row tiles
    assert merge(8, splits=3) == "combine_kernel"  # above 2
    assert merge(7) == "combine_kernel"           # 14 row tiles
    assert merge(1024) == "combine_kernel"        # 2048 clusters
    assert merge(8, page=32) == "cluster"         # the runs path merges too
    if sms == 132:  # H100/H200 SXM: 66 clusters of 2 fit at once
        assert merge(33) == "cluster"
        assert merge(34) == "combine_kernel"
    assert plan(ops, 16, 16 * 8, kernel="wgmma_combine").name == "wgmma_tma"
    assert merge(8, kernel="wgmma_combine") == "combine_kernel"
    assert plan(ops, 16, 64 * 16, kernel="wgmma_cp_async").name == "wgmma"
    assert merge(8, kernel="wgmma_cp_async") == "combine_kernel"
    assert tile(plan(ops, 16, 257 * 8, kernel="mma_sync")) == (64, 32)
    assert plan(ops, 16, 64 * 16, kernel="mma_sync").name == "mma_sync"
    assert merge(4, kernel="mma_sync") == "combine_kernel"
    # The split that fills one wave: many splits for one request, none for a full grid.
    assert 64 <= plan(ops, 1, 8, max_seq=32768).num_splits <= 128
    assert plan(ops, 16, 64 * 16, max_seq=32768).num_splits == 1   # 256 CTAs: past one wave
    # More splits than the fill where it leaves SMs idle for a wave: a request's last row tile
    # holds H rows at D = budget + 1 (B 16, H 8, D 65: 144 row tiles, two waves at one split;
    # B 8: 72 row tiles on 132 SMs).
    if sms == 132:
        assert 3 <= plan(ops, 16, 65 * 8, max_seq=8192 + 128).num_splits <= 6
        assert 3 <= plan(ops, 8, 65 * 8, max_seq=8192 + 128).num_splits <= 6
        assert 6 <= plan(ops, 16, 65 * 8, max_seq=32768 + 128).num_splits <= 12
        assert plan(ops, 16, 257 * 8, max_seq=8192 + 320).num_splits == 1   # 528 CTAs: 4 waves
        # Per-request plans take counts from the fill (split_base) where the count passes it;
        # they never merge in clusters. Other plans: 0.
        per_request = lambda B, R, max_seq: plan(ops, B, R, max_seq=max_seq, per_request=True)
        assert per_request(8, 65 * 8, 8192 + 128).split_base == 1
        assert per_request(16, 257 * 8, 8192 + 320).split_base == 0
        assert plan(ops, 16, 65 * 8, max_seq=8192 + 128).split_base == 0
        assert per_request(8, 65 * 8, 8192 + 128).num_splits == plan(ops, 8, 65 * 8, max_seq=8192 + 128).num_splits
        # Only the last row tile split (tail) where it is part full and at least 8 other row
        # tiles a request fill their waves (B 16, H 8, D 65: 128 CTAs on 132 SMs); not at B 8
        # (64 CTAs), D 64 (no part-full tile), B 32, D 33 (4 other row tiles a request), in
        # plans without per-request counts, or where one split pays (B 16, H 8, D 257: the 16
        # last row tiles fit the 16 SMs the 512 others leave).
        for max_seq in (2048 + 128, 8192 + 128, 131072):
            tail = per_request(16, 65 * 8, max_seq)
            assert tail.tail and tail.split_base == 0 and 2 <= tail.num_splits <= 16, tail
            assert tail.merge == "combine_kernel"
        assert not any(p.tail for p in (per_request(8, 65 * 8, 8192 + 128), per_request(16, 64 * 8, 8192 + 128),
                                        per_request(32, 33 * 8, 32768 + 64),
                                        plan(ops, 16, 65 * 8, max_seq=8192 + 128),
                                        per_request(16, 257 * 8, 8192 + 320)))
    # Every split holds keys at max_seq: a split takes ceil(tiles / splits) tiles, and the
    # splits past the last tile are not launched.
    for B, R, max_seq in ((1, 8, 129 * 64), (1, 8, 513 * 64), (16, 8, 17 * 64), (1, 8, 1000), (1, 128, 8256)):
        pl = plan(ops, B, R, max_seq=max_seq)
        tiles = -(-max_seq // pl.keys_per_tile)
        assert (pl.num_splits - 1) * -(-tiles // pl.num_splits) < tiles, (B, R, max_seq, pl.num_splits)
    if sms >= 129:  # 129 tiles: 65 splits of 2, not 128 of which 63 are empty
        assert plan(ops, 1, 8, max_seq=129 * 64).num_splits == 65


@pytest.mark.parametrize("prefixes,D,H,page", ATTN_GRID)
def test_verify_attention_matches_reference(ops, verify_path, prefixes, D, H, page):
    case = paged_case(prefixes, D, H, page, seed=D * 7 + H + page, device=DEV)
    check_attention(ops, case, kernel=verify_path)


# sm_120's 32-row tile of 16-key slots (verify v27), which a block of 99 KB takes: kd_verify_run
# launches the tile its plan names, so a plan told (32 rows, 16 keys) runs it on any GPU.
@pytest.mark.parametrize("prefixes,D,H,page,num_splits", [
    ([0, 37, 300, 2049], 3, 8, 64, None),  # 24 rows: one tile a request
    ([5, 1000], 33, 8, 1, None),           # 264 rows: 9 tiles, the last part full; page size 1
    ([4100, 0, 129], 17, 8, 64, 3),        # forced splits, P = 0
])
def test_verify_attention_tile_of_16_key_slots(ops, prefixes, D, H, page, num_splits):
    case = paged_case(prefixes, D, H, page, seed=D + H + page, device=DEV)
    B = len(prefixes)
    pl = ops.TreeVerifyPlan(B, D, H, page, case.block_table.shape[1], kernel="mma_sync", num_splits=num_splits)
    pl._plan.rows_per_cta, pl._plan.keys_per_tile = 32, 16
    out = torch.full((B, D, H, 512), float("nan"), dtype=torch.bfloat16, device=DEV)
    lse = torch.full((B, D, H), float("nan"), dtype=torch.float32, device=DEV)
    pl.run(case.q, case.kv_cache, case.block_table, case.seq_lens, case.visibility, SCALE,
           out=ops.TreeVerifyResult(out, lse))
    assert_matches_reference(case, out, lse)


def ramp_keys(case, per_key: float):
    """Scales each request's key at position pos by 1 + pos * per_key, in place: every row's
    maximum then climbs through the keys, so the running maximum is raised deep into a split."""
    pages, page = case.kv_cache.shape[:2]
    factor = torch.ones(pages * page, device=DEV)
    for b, n in enumerate(case.seq_lens.tolist()):
        pos = torch.arange(n, device=DEV)
        rows = case.block_table[b, pos // page].long() * page + pos % page
        factor[rows] = 1 + pos.float() * per_key
    case.kv_cache.mul_(factor.view(pages, page, 1).to(case.kv_cache.dtype))


def raises_after_first_tile(case, b: int, slack: float = 8.0, tile: int = 64) -> int:
    """How often head 0 of slot 0 of request b raises its running maximum (log2 units) past
    `slack` after its first tile of keys (verify_common.cuh, running_max)."""
    page = case.kv_cache.shape[1]
    n = int(case.seq_lens[b])
    pos = torch.arange(n, device=DEV)
    k = case.kv_cache[case.block_table[b, pos // page].long(), pos % page].double()
    s = (k @ case.q[b, 0, 0].double()) * SCALE * 1.4426950408889634
    m, raises = -np.inf, 0
    for i, mx in enumerate(s.split(tile)):
        mx = float(mx.max())
        if mx > m + slack:
            m, raises = mx, raises + (i > 0)
    return raises


@pytest.mark.parametrize("page", [1, 64])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_verify_attention_scores_that_climb(ops, verify_path, page, num_splits):
    """O is rescaled only when a row's maximum passes its reference by the slack; keys whose
    scores climb through the prefix take that path mid-split, over and over."""
    case = paged_case([4000, 300, 2500], 16, 8, page, seed=11 + page, device=DEV)
    ramp_keys(case, 1 / 256)
    assert raises_after_first_tile(case, 0) >= 3  # the case does what it is for
    check_attention(ops, case, num_splits=num_splits, kernel=verify_path)


# 31 and 32 splits: the two combine layouts' boundary (a warp per half row below 32).
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 31, 32, 64, 128])
@pytest.mark.parametrize("bits", [False, True])
def test_verify_attention_splits_and_bitmask(ops, verify_path, num_splits, bits):
    case = paged_case([0, 90, 777, 1500], 17, 8, 64, seed=num_splits + 10 * bits, device=DEV)
    check_attention(ops, case, num_splits=num_splits, bits=bits, kernel=verify_path)


# Combines of at most 4 CTAs an SM follow the wgmma kernel as programmatic dependents held
# to ceil(CTAs / SMs) an SM (verify_plan.cu, "combine"), others plainly: on an H200's 132
# SMs a warp per half row holds 8 CTAs at D 1, 136 at D 17 (2 an SM), 512 at D 64 (4); a CTA
# per quarter row (32 splits on) 128 at D 1, 384 at D 3 (3 an SM), plain at D 17 and 64.
@pytest.mark.parametrize("D", [1, 3, 17, 64])
@pytest.mark.parametrize("num_splits", [2, 7, 31, 32, 128])
def test_verify_attention_small_combines(ops, verify_path, D, num_splits):
    case = paged_case([0, 90, 777, 1500], D, 8, 64, seed=num_splits + D, device=DEV)
    check_attention(ops, case, num_splits=num_splits, kernel=verify_path)


def test_verify_held_combines_on_concurrent_streams(ops):
    """Two threads, each on its own stream, launch combines held to different counts an SM
    (8 and 512 CTAs: 1 and 4 an SM on an H200) over and over: every result matches the
    same launch run alone, bit for bit, and no launch fails (the held launches share one
    shared-memory attribute, verify_combine.cu)."""
    import threading
    cases = [paged_case([0, 900, 64, 3000], D, 8, 64, seed=30 + D, device=DEV) for D in (1, 64)]
    run = lambda c: ops.tree_verify(c.q, c.kv_cache, c.block_table, c.seq_lens, c.visibility, SCALE,
                                    num_splits=3)
    alone = [run(c) for c in cases]
    torch.cuda.synchronize()
    failures = []

    def worker(i):
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                for _ in range(40):
                    got = run(cases[i])
                    torch.cuda.current_stream().synchronize()
                    if not (torch.equal(got.out, alone[i].out) and torch.equal(got.lse, alone[i].lse)):
                        failures.append((i, "differs"))
                        return
        except Exception as e:  # a failed launch raises in the thread: report it here
            failures.append((i, repr(e)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures


@pytest.mark.parametrize("B", [8, 16])
@pytest.mark.parametrize("kernel,page", [("auto", 64), ("mma_sync", 64), ("wgmma_cp_async", 64), ("auto", 1)])
def test_verify_splits_follow_each_request_length(ops, kernel, page, B):
    """A per-request plan for long requests whose count passes the one-wave fill (H 8, D 65
    over 32k keys; B 8: 72 row tiles) gives each request the count of its own length: short
    ones leave later splits empty, which write only their LSEs and which the combine must
    weigh 0; one whose split 0 holds all its keys writes out and lse itself, and the combine
    must leave its rows (its empty splits' LSEs are +inf). At B 16 (144 row tiles, the last
    of each request 8 rows, the other 128 one wave) only the last row tile takes per-request
    counts (tail): the others take one split and write their rows, the combine only the last
    tile's. The workspace is poisoned with NaN first, so a split that wrote nothing shows.
    Page size 1 is the SGLang drop-in's (the TMA runs path)."""
    prefixes = [0, 1, 63, 64, 100, 700, 1500, 2100, 4000, 6000, 9000, 12000, 17000, 25000, 30000, 32768]
    prefixes = prefixes if B == 16 else prefixes[::2][:7] + [32768]
    D, H = 65, 8
    case = paged_case(prefixes, D, H, page, seed=77 + B, device=DEV)
    table = widened_table(case.block_table, -(-(32768 + D) // page) + 3)  # wider than any request
    plan = ops.TreeVerifyPlan(B, D, H, page, table.shape[1], kernel=kernel, per_request_splits=True)
    past_fill = torch.cuda.get_device_properties(0).multi_processor_count == 132 and kernel != "mma_sync"
    if past_fill:
        assert plan.num_splits > 1 and (plan.tail if B == 16 else plan.split_base == 1), plan
    for t in plan.workspace:
        if t is not None:
            t.fill_(float("nan"))
    out = torch.full((B, D, H, 512), float("nan"), dtype=torch.bfloat16, device=DEV)
    lse = torch.full((B, D, H), float("nan"), dtype=torch.float32, device=DEV)
    plan.run(case.q, case.kv_cache, table, case.seq_lens, case.visibility, SCALE, out=(out, lse))
    assert_matches_reference(case, out, lse)
    if past_fill:
        split1 = plan.workspace[1][:, 1]  # [B, R]: split 1's LSEs
        if B == 8:  # both forms ran: the shortest request wrote its own rows, the longest merged
            assert torch.isposinf(split1[0]).all() and torch.isfinite(split1[-1]).all()
        else:  # the main row tiles wrote no partials; the longest request's last row tile merged
            main = D * H // 64 * 64
            assert torch.isnan(split1[:, :main]).all() and torch.isfinite(split1[-1, main:]).all()


@pytest.mark.parametrize("num_splits", [2, 7, 31, 32, 128])
def test_verify_split_partials_cost_at_most_one_rounding(ops, verify_path, num_splits):
    """Split launches merge bf16 partials (verify_common.cuh, write_rows, says why): on
    the same inputs their error against the float64 reference stays within one bf16
    rounding (2**-9, relative) of the one-split launch's (H200: 1.7e-3 -> 2.2-2.4e-3)."""
    case = paged_case([3000, 1234, 5000], 16, 8, 64, seed=num_splits, device=DEV)
    whole = check_attention(ops, case, num_splits=1, kernel=verify_path)
    split = check_attention(ops, case, num_splits=num_splits, kernel=verify_path)
    assert split <= whole + 2 ** -9, (whole, split)


# The TMA copy: a partial last row tile, pages of 128 and 192 rows (a tile starts inside a
# page), ragged requests with P = 0 and a last key tile that ends inside its page (NaN past
# it must not reach P V).
TMA_GRID = [
    ([0, 1, 63, 650], 125, 8, 64),    # 1000 rows: 16 row tiles, the last 40 rows
    ([64, 3, 1000], 16, 64, 128),      # 16 row tiles
    ([0, 300, 129], 17, 64, 192),      # 17 row tiles; pages of 3 tiles
    ([700, 5], 24, 8, 64),            # 3 row tiles
]


@pytest.mark.parametrize("prefixes,D,H,page", TMA_GRID)
@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_verify_attention_tma_paths(ops, prefixes, D, H, page, num_splits):
    case = paged_case(prefixes, D, H, page, seed=D + page + (num_splits or 0), device=DEV)
    check_attention(ops, case, num_splits=num_splits)


# Page sizes off 64 on Hopper: a tile goes by TMA where its keys are 64 consecutive cache
# rows, else by cp.async, tile by tile. Block tables of one run a request (the last tile
# reads past the request's rows into another request's run or the NaN spares) and runs
# broken about every 16 pages (a request mixes both copies), ragged with P = 0.
RUNS_GRID = [
    ([0, 5, 64, 129], 16, 8, 1),
    ([250, 4100, 63], 5, 64, 1),
    ([3000, 700], 17, 16, 16),
    ([1000, 0, 2049], 33, 8, 32),
]


@pytest.mark.parametrize("layout", ["runs", "broken_runs"])
@pytest.mark.parametrize("prefixes,D,H,page", RUNS_GRID)
@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_verify_attention_tma_runs(ops, layout, prefixes, D, H, page, num_splits):
    case = paged_case(prefixes, D, H, page, seed=D + page + (num_splits or 0), device=DEV, layout=layout)
    if torch.cuda.get_device_capability() == (9, 0):
        assert ops.TreeVerifyPlan(len(prefixes), D, H, page, case.block_table.shape[1]).name == "wgmma_tma_runs"
    check_attention(ops, case, num_splits=num_splits)


@pytest.mark.parametrize("layout", ["runs", "broken_runs", "scattered"])
def test_verify_attention_tma_runs_cluster_merge(ops, layout):
    """The runs path's 2 splits merged in clusters: 4 x 4 row tiles at page size 1, P = 5."""
    case = paged_case([3000, 5, 1000, 77], 16, 16, 1, seed=9, device=DEV, layout=layout)
    if torch.cuda.get_device_properties(0).multi_processor_count == 132 and \
            torch.cuda.get_device_capability() == (9, 0):
        pl = ops.TreeVerifyPlan(4, 16, 16, 1, case.block_table.shape[1], num_splits=2)
        assert (pl.name, pl.merge) == ("wgmma_tma_runs", "cluster")
    check_attention(ops, case, num_splits=2)


# The cluster merge (Hopper, TMA path, 2 splits, 16 or more row tiles): a partial last
# row tile (rows past R merge nothing), P = 0 requests whose later splits hold no keys
# (weight 0), pages of 128. NaN-poisoned out and lse must be fully written.
MERGE_GRID = [
    ([0, 650, 40, 7, 300, 64], 17, 8, 64),   # 6 x 3 row tiles, the last of 8 rows; P = 0, P < 64
    ([8192, 5, 1000, 77], 16, 16, 128),      # 4 x 4 row tiles
    ([3000, 100], 64, 8, 64),                # 2 x 8 row tiles
]


@pytest.mark.parametrize("prefixes,D,H,page", MERGE_GRID)
def test_verify_attention_cluster_merge(ops, prefixes, D, H, page):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the cluster merge: Hopper (sm_90) only")
    case = paged_case(prefixes, D, H, page, seed=D + H, device=DEV)
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:  # fits 66 clusters of 2
        assert ops.TreeVerifyPlan(len(prefixes), D, H, page, case.block_table.shape[1],
                                  num_splits=2).merge == "cluster"
    check_attention(ops, case, num_splits=2)


def test_verify_attention_with_built_tree_mask(ops, verify_path):
    budgets = np.array([63, 10, 1, 63])
    tb = build_trees(*stage_a_inputs(4, 15, 1000, 63, seed=3), budgets)
    case = paged_case([100, 2000, 0, 64], tb.D, 16, 1, seed=4, visibility=tb.visibility, device=DEV)
    check_attention(ops, case, kernel=verify_path)


def test_verify_attention_argument_errors(ops):
    case = paged_case([10], 4, 8, 64, seed=0, device=DEV)
    with pytest.raises(InputError, match="q: expected dtype torch.bfloat16"):
        ops.tree_verify(case.q.float(), case.kv_cache, case.block_table, case.seq_lens, case.visibility, SCALE)
    with pytest.raises(InputError, match="visibility: expected shape"):
        ops.tree_verify(case.q, case.kv_cache, case.block_table, case.seq_lens, case.visibility[:, :2], SCALE)
    with pytest.raises(InputError, match="scale: expected a positive float"):
        ops.tree_verify(case.q, case.kv_cache, case.block_table, case.seq_lens, case.visibility, 0)
    with pytest.raises(InputError, match=r"num_splits: expected an integer in \[1, 128\]"):
        ops.tree_verify(case.q, case.kv_cache, case.block_table, case.seq_lens, case.visibility,
                             SCALE, num_splits=129)
    with pytest.raises(InputError, match="kv_cache: expected at least one page"):
        ops.tree_verify(case.q, case.kv_cache[:0], case.block_table, case.seq_lens, case.visibility, SCALE)
    with pytest.raises(InputError, match="block_table: expected at least one page a request"):
        ops.tree_verify(case.q, case.kv_cache, case.block_table[:, :0], case.seq_lens, case.visibility,
                             SCALE)
    # Views off a 16-byte boundary (the kernels copy these in 16-byte vectors) are refused by
    # name, before a launch could fault; out is left untouched.
    B, D, H, _ = case.q.shape
    n = B * D * H * 512
    big = torch.full((n + 8,), float("nan"), dtype=torch.bfloat16, device=DEV)
    out = big[4:4 + n].view(B, D, H, 512)
    with pytest.raises(InputError, match="out: expected a 16-byte aligned data pointer, got one 8 bytes past"):
        ops.tree_verify(case.q, case.kv_cache, case.block_table, case.seq_lens, case.visibility, SCALE,
                             out=(out, torch.empty(B, D, H, device=DEV)))
    assert torch.isnan(big).all()
    q_big = torch.cat([case.q.flatten(), case.q.flatten()[:4]])
    with pytest.raises(InputError, match="q: expected a 16-byte aligned data pointer"):
        ops.tree_verify(q_big[4:].view(case.q.shape), case.kv_cache, case.block_table, case.seq_lens,
                             case.visibility, SCALE)
    kv_big = torch.cat([case.kv_cache.flatten(), case.kv_cache.flatten()[:2]])
    with pytest.raises(InputError, match="kv_cache: expected a 16-byte aligned data pointer, got one 4 bytes"):
        ops.tree_verify(case.q, kv_big[2:].view(case.kv_cache.shape), case.block_table, case.seq_lens,
                             case.visibility, SCALE)
    ops.tree_verify(case.q, case.kv_cache, case.block_table, case.seq_lens, case.visibility, SCALE)
    torch.cuda.synchronize()  # no fault left behind


# ---------------------------------------------------------------- one round in one graph
def test_round_captures_in_one_cuda_graph(ops):
    B, L, V, budget, H, page = 8, 15, 500, 32, 8, 64
    D = budget + 1
    rng = np.random.default_rng(0)

    def inputs(seed):
        lp, ids = stage_a_inputs(B, L, V, budget, seed=seed)
        case = paged_case(list(rng.integers(0, 3000, B)), D, H, page, seed=seed, device=DEV)
        target = torch.as_tensor(rng.integers(0, V, (B, D)), device=DEV)
        return lp.to(DEV), ids.to(DEV), case, target

    lp, ids, case, target = inputs(1)
    budgets = torch.full((B,), budget, dtype=torch.int32, device=DEV)
    static = dict(lp=lp.clone(), ids=ids.clone(), q=case.q.clone(), target=target.clone())

    def round_(s):
        trees = ops.tree_build(s["lp"], s["ids"], budgets, d_max=D)
        out, lse = ops.tree_verify(case.q if s is None else s["q"], case.kv_cache, case.block_table,
                                   case.seq_lens, trees.visibility_bits, SCALE, num_splits=4)
        acc = ops.tree_accept(trees.tokens, s["target"], L, next_token=trees.next_token, next_sibling=trees.next_sibling)
        return trees, out, lse, acc

    g, captured = capture_graph(lambda: round_(static))
    for seed in (2, 3):
        lp, ids, case2, target = inputs(seed)
        static["lp"].copy_(lp); static["ids"].copy_(ids); static["target"].copy_(target)
        static["q"].copy_(case2.q)
        g.replay()
        torch.cuda.synchronize()
        eager = round_(dict(lp=lp, ids=ids, q=case2.q, target=target))
        assert torch.equal(captured[0].tokens, eager[0].tokens)
        assert torch.equal(captured[0].visibility_bits, eager[0].visibility_bits)
        assert torch.equal(captured[1], eager[1]) and torch.equal(captured[2], eager[2])
        for a, b in zip(captured[3], eager[3]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("num_splits", [2, 3, 32])
@pytest.mark.parametrize("prefixes,D", [([4000, 1000, 0, 300, 2000, 64], 17), ([4000, 0, 300, 2000], 1)])
def test_verify_attention_splits_replayed_in_cuda_graph(ops, verify_path, num_splits, prefixes, D):
    """Splits captured into a graph and replayed on fresh queries: merged in clusters (2 on
    Hopper's auto path: 18 row tiles) or by the combine kernel (both of its layouts; at D 1
    a combine of at most one CTA an SM, a held programmatic dependent after wgmma), which must
    still see finished partials."""
    case = paged_case(prefixes, D, 8, 64, seed=21, device=DEV)
    B, D, H, _ = case.q.shape
    q = case.q.clone()
    out = torch.empty(B, D, H, 512, dtype=torch.bfloat16, device=DEV)
    lse = torch.empty(B, D, H, dtype=torch.float32, device=DEV)
    run = lambda: ops.tree_verify(q, case.kv_cache, case.block_table, case.seq_lens, case.visibility,
                                  SCALE, kernel=verify_path, num_splits=num_splits, out=(out, lse))
    g, _ = capture_graph(run)
    for seed in (1, 2):
        q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(q))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref_o, ref_l = verify_attention_ref(q, case.kv_cache, case.block_table, case.seq_lens,
                                            case.visibility, SCALE)
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        assert (out.double() - ref_o).norm() / ref_o.norm() <= 5e-3
        assert (lse.double() - ref_l).abs().max() <= 1e-3


# ---------------------------------------------------------------- torch ops
def test_torch_ops_pass_opcheck_and_compile_into_one_graph(ops):
    """torch.ops.kdtree.*: torch.library.opcheck (schema, fake against real, dispatch) and a
    round under torch.compile(fullgraph=True) equal to the eager API."""
    import kdtree.torch_ops  # noqa: F401

    B, L, V, budget, H = 4, 15, 500, 32, 8
    D = budget + 1
    lp, ids = (t.to(DEV) for t in stage_a_inputs(B, L, V, budget, seed=11))
    budgets = torch.full((B,), budget, dtype=torch.int32, device=DEV)
    case = paged_case([100, 0, 900, 64], D, H, 64, seed=12, device=DEV)
    target = torch.randint(0, V, (B, D), device=DEV)
    r = torch.ops.kdtree.tree_build(lp, ids, budgets, None, None, D)
    torch.library.opcheck(torch.ops.kdtree.tree_build.default, (lp, ids, budgets, None, None, D))
    vis_args = (case.q, case.kv_cache, case.block_table, case.seq_lens, r[7], SCALE)
    torch.library.opcheck(torch.ops.kdtree.tree_verify.default, vis_args)
    torch.library.opcheck(torch.ops.kdtree.tree_accept.default, (r[1], target, L, r[3], r[0]))

    def round_(lp, ids, q, target):
        t = torch.ops.kdtree.tree_build(lp, ids, budgets, None, None, D)
        out, lse = torch.ops.kdtree.tree_verify(q, case.kv_cache, case.block_table, case.seq_lens, t[7], SCALE)
        acc = torch.ops.kdtree.tree_accept(t[1], target, L, t[3], t[0])
        return (t[1], t[7], out, lse) + tuple(acc)

    compiled = torch.compile(round_, fullgraph=True)
    got = compiled(lp, ids, case.q, target)
    trees = ops.tree_build(lp, ids, budgets, d_max=D)
    vo = ops.tree_verify(case.q, case.kv_cache, case.block_table, case.seq_lens, trees.visibility_bits, SCALE)
    acc = ops.tree_accept(trees.tokens, target, L, parents=trees.parents, node_counts=trees.node_counts)
    for g, w in zip(got, (trees.tokens, trees.visibility_bits, vo.out, vo.lse) + tuple(acc)):
        assert torch.equal(g, w)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ops_run_on_their_tensors_device_not_the_current_one(ops):
    """Tensors on the last GPU while device 0 is current: each op launches there, as a torch op
    does (the library launches on the current device), and device 0 is current again after."""
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    torch.cuda.set_device(0)
    B, L, budget, H = 3, 15, 64, 8
    lp, ids = stage_a_inputs(B, L, 32000, budget, seed=5)
    seq, roots = [100, 700, 0], [1, 2, 3]
    want = build_trees(lp, ids, [budget] * B, seq_lens=seq, root_tokens=roots)
    got = ops.tree_build(lp.to(dev), ids.to(dev), torch.full((B,), budget, dtype=torch.int32, device=dev),
                         seq_lens=torch.tensor(seq, dtype=torch.int32, device=dev),
                         root_tokens=torch.tensor(roots, device=dev), d_max=want.D)
    assert torch.cuda.current_device() == 0
    for f in ("node_counts", "tokens", "parents", "next_token", "next_sibling", "visibility_bits"):
        assert np.array_equal(getattr(got, f).cpu().numpy(), getattr(want, f)), f
    case = paged_case(seq, want.D, H, 64, seed=6, visibility=torch.from_numpy(want.visibility), device=dev)
    plan = ops.TreeVerifyPlan(B, want.D, H, page_size=64, max_pages=case.block_table.shape[1], device=dev)
    r = plan.run(case.q, case.kv_cache, case.block_table, case.seq_lens, got.visibility_bits, SCALE)
    assert torch.cuda.current_device() == 0
    ref_o, ref_l = verify_attention_ref(case.q, case.kv_cache, case.block_table, case.seq_lens,
                                        case.visibility, SCALE)
    assert (r.out.double() - ref_o).norm() / ref_o.norm() <= 5e-3
    assert (r.lse.double() - ref_l).abs().max() <= 1e-3
    target = follow_targets(want, 32000, 0.85, np.random.default_rng(7))
    acc = ops.tree_accept(got.tokens, torch.from_numpy(target).to(dev), L, parents=got.parents,
                          node_counts=got.node_counts)
    assert torch.cuda.current_device() == 0
    wanted = greedy_accept_batch(want.tokens, want.next_token, want.next_sibling, target, L)
    for g, w in zip(acc, wanted):
        assert np.array_equal(g.cpu().numpy(), w)
