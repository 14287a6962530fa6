"""kdtree.sglang on the GPU against its CPU reference of the worker's round (spec sglang.md);
the whole round captured in one CUDA graph."""
import numpy as np
import pytest
import torch

from kdtree import sglang
from kdtree.checks import InputError
from kdtree.reference.attention import verify_attention_ref
from kdtree.harness.timing import capture_graph
from kdtree.harness.workloads import stage_a_inputs
from kdtree.sglang import reference as ref

pytestmark = pytest.mark.gpu
DEV = "cuda"
SCALE = 0.130861


def test_builder_on_cuda_is_byte_identical(golden):
    cases = [(torch.from_numpy(c["top_lp"]), torch.from_numpy(c["top_ids"]), int(c["budget"])) for c in golden]
    rng = np.random.default_rng(0)
    for seed in range(40):
        V, budget = int(rng.choice([2, 3, 40, 5000])), int(rng.choice([-1, 0, 1, 2, 16, 64, 256, 1024]))
        lp, ids = stage_a_inputs(1, int(rng.choice([1, 4, 15])), V, max(budget, 1), seed=seed, coarse_fraction=1.0)
        cases.append((lp[0], ids[0], budget))
    # All built first, compared after: a result must not share memory with the builder's
    # buffers, which the next call of the same budget rewrites.
    got_all = [sglang.build_ddtree_tree_from_topk(lp.to(DEV), ids.to(DEV), budget) for lp, ids, budget in cases]
    for i, ((lp, ids, budget), got) in enumerate(zip(cases, got_all)):
        want = ref.build_ddtree_tree_from_topk(lp, ids, budget)
        for k, (g, w) in enumerate(zip(got, want)):
            if isinstance(w, torch.Tensor):
                assert g.device.type == "cpu" and g.dtype == w.dtype and torch.equal(g, w), (i, k)
            else:
                assert g == w, (i, k)


def test_builder_on_cuda_without_a_library_builds_on_the_cpu(tmp_path):
    # A server whose kdtree has no library (KDTREE_LIB names none): the worker's trees still
    # come back, from the CPU build, and the log says why once.
    import os
    import subprocess
    import sys
    code = """
import torch
from kdtree import sglang
from kdtree.harness.workloads import stage_a_inputs
from kdtree.sglang import reference as ref
for seed, budget in [(0, 16), (1, 64), (2, 256)]:
    lp, ids = stage_a_inputs(1, 15, 500, budget, seed=seed, coarse_fraction=0.5)
    got = sglang.build_ddtree_tree_from_topk(lp[0].cuda(), ids[0].cuda(), budget)
    want = ref.build_ddtree_tree_from_topk(lp[0], ids[0], budget)
    assert all(torch.equal(g, w) if isinstance(w, torch.Tensor) else g == w for g, w in zip(got, want))
print("same trees")
"""
    env = dict(os.environ, KDTREE_LIB=str(tmp_path / "none" / "libkdtree.so"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "same trees" in r.stdout, r.stderr[-2000:]
    assert r.stderr.count("tree builds run on the CPU") == 1 and "KDTREE_LIB=" in r.stderr


def round_inputs(seed, bs, q, V=300):
    rng = np.random.default_rng(seed)
    budgets = rng.choice([0, 1, 5, q - 1, q - 1, q - 1], size=bs)
    lp, ids = stage_a_inputs(bs, 15, V, q - 1, seed=seed, coarse_fraction=0.5)
    bonus = rng.integers(0, V, bs)
    prefix = rng.choice([0, 1, 63, 64, 1000, 4097], size=bs)
    return lp, ids, budgets, bonus, prefix


def cpu_round(lp, ids, budgets, bonus, prefix, q, target=None):
    trees = [ref.build_ddtree_tree_from_topk(lp[i], ids[i], int(budgets[i])) for i in range(len(budgets))]
    layout = ref.pad_round(trees, bonus, prefix, q)
    return trees, layout


@pytest.mark.parametrize("bs,budget,lens", [(1, 16, torch.int64), (7, 64, torch.int32), (64, 64, torch.int64),
                                             (3, 256, torch.int32), (2, 1024, torch.int64)])
def test_round_builder_mask_and_accept_match_the_cpu_path(bs, budget, lens):
    """Budgets and prefix lengths as int32 or int64 tensors (read as given, or copied)."""
    q = budget + 1
    lp, ids, budgets, bonus, prefix = round_inputs(bs + budget, bs, q)
    rb = sglang.RoundBuilder(bs + 2, budget, DEV)
    for t in rb.layout:   # poisoned static buffers
        t.view(torch.uint8).fill_(0x5A)
    t = lambda a, dt=lens: torch.as_tensor(np.asarray(a), dtype=dt, device=DEV)
    got = rb.build(lp.to(DEV), ids.to(DEV), t(budgets), t(bonus, torch.int64), t(prefix))
    trees, want = cpu_round(lp, ids, budgets, bonus, prefix, q)
    for g, w in zip(got, want):
        assert g.dtype == {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                           np.dtype(bool): torch.bool}[w.dtype]
        assert np.array_equal(g.cpu().numpy(), w)
    # the mask, bool and uint8, into a buffer sized for the largest prefix
    want_mask, want_indptr = ref.custom_mask(want[4], prefix)
    for dt in (torch.bool, torch.uint8):
        buf = torch.full((sglang.mask_size(bs, q, int(prefix.max())) + 5,), 7, dtype=torch.uint8, device=DEV)
        mask, indptr = sglang.custom_mask(got.visibility, t(prefix), out=buf.view(dt))
        assert np.array_equal(indptr.cpu().numpy(), want_indptr)
        m = mask.view(torch.uint8)[:want_mask.size].cpu().numpy()
        assert np.array_equal(m, want_mask.astype(np.uint8))
        assert (buf[want_mask.size:] == 7).all()   # nothing past the blocks
    mask, indptr = sglang.custom_mask(got.visibility, t(prefix))   # sized on the device (a sync)
    assert mask.dtype == torch.bool and mask.numel() == want_mask.size
    assert np.array_equal(mask.cpu().numpy(), want_mask) and np.array_equal(indptr.cpu().numpy(), want_indptr)
    # accept from a target that follows the tree for a while
    rng = np.random.default_rng(bs)
    target = rng.integers(0, 300, size=(bs, q))
    tok, nxt = want[0], want[2]
    for i in range(bs):
        cur = 0
        while nxt[i, cur] >= 0 and rng.random() < 0.8:
            target[i, cur] = tok[i, nxt[i, cur]]
            cur = nxt[i, cur]
    w_acc = ref.accept([tr[3] for tr in trees], tok, target, q)
    out = sglang.AcceptOutput(torch.full((bs, q), 99, dtype=torch.int64, device=DEV),
                              torch.full((bs,), 99, dtype=torch.int32, device=DEV),
                              torch.full((bs, q), 99, dtype=torch.int64, device=DEV))
    g_acc = sglang.accept(got.tree_tokens, got.retrieve_next_token, got.retrieve_next_sibling,
                          t(target, torch.int64), out=out)
    for g, w in zip(g_acc, w_acc):
        assert np.array_equal(g.cpu().numpy(), w)
    assert w_acc[1].max() >= 2
    # the links widened to i64 (the build's own form) give the same
    g64 = sglang.accept(got.tree_tokens, got.retrieve_next_token.long(), got.retrieve_next_sibling.long(),
                        t(target, torch.int64))
    for g, w in zip(g64, w_acc):
        assert np.array_equal(g.cpu().numpy(), w)


@pytest.mark.parametrize("warmup", [0, 1])
def test_int_budgets_hold_in_graphs_and_eager_calls(warmup):
    """One int budget for the batch (the worker's server argument): a graph captured with it
    (its first use inside the capture, or after an eager call) keeps building with it after
    eager calls with other ints."""
    bs, budget = 4, 32
    q = budget + 1
    rb = sglang.RoundBuilder(bs, budget, DEV)
    lp, ids, _, bonus, prefix = round_inputs(9, bs, q)
    d = dict(lp=lp.to(DEV), ids=ids.to(DEV), bonus=torch.as_tensor(bonus, device=DEV),
             prefix=torch.as_tensor(prefix, device=DEV))
    graph, lay = capture_graph(lambda: rb.build(d["lp"], d["ids"], budget, d["bonus"], d["prefix"]), warmup=warmup)

    def check(k):
        _, want = cpu_round(lp, ids, np.full(bs, k), bonus, prefix, q)
        for g, w in zip(lay, want):
            assert np.array_equal(g.cpu().numpy(), w), k
    for k in (5, 0, budget, 1):
        for t in rb.layout:
            t.view(torch.uint8).fill_(0x5A)
        got = rb.build(d["lp"], d["ids"], k, d["bonus"], d["prefix"])
        assert got[0].data_ptr() == lay[0].data_ptr()
        check(k)
        graph.replay()
        check(budget)


@pytest.mark.parametrize("kernel", ["auto", "mma_sync"])
def test_verify_attention_on_sglang_metadata(kernel):
    """The token pool at page size 1, req_to_token read in place through req_pool_indices
    (rows out of order, a wider table than needed), q and out as [bs * q, H, ...]."""
    bs, q, H = 3, 17, 8
    prefix = torch.tensor([0, 333, 2049], dtype=torch.int32)
    g = torch.Generator().manual_seed(5)
    slots = int((prefix + q).sum()) + 50
    kv = torch.randn(slots, 1, 576, generator=g).to(torch.bfloat16)
    kv[-50:] = float("nan")   # unused slots never leak in
    max_ctx = 4096
    req_to_token = torch.full((8, max_ctx), slots - 1, dtype=torch.int32)
    perm = torch.randperm(slots - 50, generator=g).int()
    rows = torch.tensor([5, 0, 2], dtype=torch.int32)
    at = 0
    for i in range(bs):
        n = int(prefix[i]) + q
        req_to_token[rows[i], :n] = perm[at:at + n]
        at += n
    vis = torch.zeros(bs, q, q, dtype=torch.bool)
    for i in range(q):
        vis[:, i, i] = True
        if i:
            vis[:, i] |= vis[:, torch.randint(0, i, (1,), generator=g).item()]
    qx = torch.randn(bs * q, H, 576, generator=g).to(torch.bfloat16)
    va = sglang.VerifyAttention(bs, q, H, max_seq_len=3000, device=DEV, kernel=kernel)
    out, lse = va.run(qx.to(DEV), kv.to(DEV), req_to_token.to(DEV), rows.to(DEV), prefix.to(DEV), vis.to(DEV), SCALE)
    assert out.shape == (bs * q, H, 512) and lse.shape == (bs * q, H)
    table = req_to_token[rows.long(), :3000].contiguous()
    ref_o, ref_l = verify_attention_ref(qx.view(bs, q, H, 576), kv, table, prefix + q, vis, SCALE)
    assert not torch.isnan(out).any()
    o = out.view(bs, q, H, 512).double().cpu()
    assert (o - ref_o).norm() / ref_o.norm() <= 5e-3
    assert (lse.view(bs, q, H).double().cpu() - ref_l).abs().max() <= 1e-3
    # prepare once a forward (here from int64 metadata), then layers run on it
    out.fill_(float("nan"))
    va.prepare(rows.long().to(DEV), prefix.long().to(DEV))
    out2, lse2 = va.run(qx.to(DEV), kv.to(DEV), req_to_token.to(DEV), None, None, vis.to(DEV), SCALE, out=(out, lse))
    assert torch.equal(out2.view(bs, q, H, 512).double().cpu(), o) and out2.data_ptr() == out.data_ptr()
    fresh = sglang.VerifyAttention(bs, q, H, max_seq_len=3000, device=DEV, kernel=kernel)
    with pytest.raises(InputError, match="None before any prepare"):
        fresh.run(qx.to(DEV), kv.to(DEV), req_to_token.to(DEV), None, None, vis.to(DEV), SCALE)


def test_whole_round_is_captured_in_one_cuda_graph():
    bs, budget, V = 6, 32, 300
    q = budget + 1
    rb = sglang.RoundBuilder(bs, budget, DEV)
    lp, ids, budgets, bonus, prefix = round_inputs(1, bs, q, V)
    t = lambda a, dt=torch.int64: torch.as_tensor(np.asarray(a), dtype=dt, device=DEV)
    s = dict(lp=lp.to(DEV), ids=ids.to(DEV), budgets=t(budgets, torch.int32), bonus=t(bonus), prefix=t(prefix),
             target=torch.zeros(bs, q, dtype=torch.int64, device=DEV))
    mask_buf = torch.empty(sglang.mask_size(bs, q, 5000), dtype=torch.uint8, device=DEV)
    indptr = torch.empty(bs + 1, dtype=torch.int64, device=DEV)
    acc = sglang.AcceptOutput(torch.empty(bs, q, dtype=torch.int64, device=DEV),
                              torch.empty(bs, dtype=torch.int32, device=DEV),
                              torch.empty(bs, q, dtype=torch.int64, device=DEV))

    def round_():
        lay = rb.build(s["lp"], s["ids"], s["budgets"], s["bonus"], s["prefix"])
        sglang.custom_mask(lay.visibility, s["prefix"], out=mask_buf, mask_indptr=indptr)
        sglang.accept(lay.tree_tokens, lay.retrieve_next_token, lay.retrieve_next_sibling, s["target"], out=acc)
        return lay

    graph, lay = capture_graph(round_)
    for seed in (2, 3):
        lp, ids, budgets, bonus, prefix = round_inputs(seed, bs, q, V)
        trees, want = cpu_round(lp, ids, budgets, bonus, prefix, q)
        target = np.random.default_rng(seed).integers(0, V, size=(bs, q))
        target[:, 0] = want[0][:, 1]   # the first child accepted at least
        for k, v in dict(lp=lp, ids=ids, budgets=t(budgets, torch.int32), bonus=t(bonus), prefix=t(prefix),
                         target=t(target)).items():
            s[k].copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        for g, w in zip(lay, want):
            assert np.array_equal(g.cpu().numpy(), w)
        wm, wi = ref.custom_mask(want[4], prefix)
        assert np.array_equal(indptr.cpu().numpy(), wi)
        assert np.array_equal(mask_buf[:wm.size].cpu().numpy(), wm.astype(np.uint8))
        for g, w in zip(acc, ref.accept([tr[3] for tr in trees], want[0], target, q)):
            assert np.array_equal(g.cpu().numpy(), w)


def test_dropin_errors_name_the_argument():
    bs, budget = 2, 8
    q = budget + 1
    rb = sglang.RoundBuilder(bs, budget, DEV)
    lp, ids, _, bonus, prefix = round_inputs(4, bs, q)
    lp, ids = lp.to(DEV), ids.to(DEV)
    bonus, prefix = torch.as_tensor(bonus, device=DEV), torch.as_tensor(prefix, device=DEV)
    with pytest.raises(InputError, match=r"budgets: expected 0..8 \(q - 1\), got 9"):
        rb.build(lp, ids, 9, bonus, prefix)
    with pytest.raises(InputError, match=r"budgets: expected an int32 or int64 \[2\] tensor on cuda:0, got torch.float32"):
        rb.build(lp, ids, torch.ones(bs, device=DEV), bonus, prefix)
    with pytest.raises(InputError, match=r"prefix_lens: expected an int32 or int64 \[2\] tensor"):
        rb.build(lp, ids, budget, bonus, prefix[:1])
    with pytest.raises(InputError, match=r"prefix_lens: expected an int32 or int64 \[2\] tensor on cuda:0, got .* on cpu"):
        rb.build(lp, ids, budget, bonus, prefix.cpu())
    strided = torch.stack([prefix, prefix], 1)[:, 0]
    assert not strided.is_contiguous()
    lay = rb.build(lp, ids, budget, bonus, strided)   # read through a contiguous copy
    _, want = cpu_round(lp.cpu(), ids.cpu(), np.full(bs, budget), bonus.cpu().numpy(), prefix.cpu().numpy(), q)
    assert np.array_equal(lay.positions.cpu().numpy(), want[1])
    with pytest.raises(InputError, match=r"prefix_lens: expected an int32 or int64 \[2\] tensor"):
        sglang.custom_mask(lay.visibility, prefix.float())
    with pytest.raises(InputError, match=r"retrieve_next_sibling: expected an int32 or int64 \[2, 9\] tensor"):
        sglang.accept(lay.tree_tokens, lay.retrieve_next_token, lay.retrieve_next_sibling[:, :4], lay.tree_tokens)
    bad = lp[0].clone()
    bad[2, 1] = float("nan")
    with pytest.raises(InputError, match="top_log_probs: NaN or \\+inf"):
        sglang.build_ddtree_tree_from_topk(bad, ids[0], budget)
    va = sglang.VerifyAttention(bs, q, 8, 5000, device=DEV)
    with pytest.raises(InputError, match=r"req_pool_indices: expected an int32 or int64 \[2\] tensor"):
        va.prepare(torch.zeros(bs, dtype=torch.int16, device=DEV), prefix)
    with pytest.raises(InputError, match=r"prefix_lens: expected an int32 or int64 \[2\] tensor"):
        va.prepare(torch.zeros(bs, dtype=torch.int32, device=DEV), None)


@pytest.mark.parametrize("B,D,H,P", [(2, 17, 8, 300), (1, 65, 16, 1000), (3, 5, 64, 0), (2, 1, 8, 129)])
def test_sglang_triton_peer_reads_the_same_attention(B, D, H, P):
    """The verify sweep's SGLang peer, where SGLang's Triton kernel imports: the inputs laid out
    as its backend hands them over give kdtree's reference attention (so the sweep times the
    same work), on fresh random trees, with P = 0 and one slot among the shapes."""
    from kdtree.harness import sglang_peers
    from kdtree.harness.sweeps.verify_attn import gpu_case

    fn, why = sglang_peers.triton_verify()
    if fn is None:
        pytest.skip(f"SGLang's Triton kernel does not import here: {why[:120]}")
    q, cache, table, seq, vis = gpu_case(B, D, H, P, 1, seed=B * 1000 + D + H + P)  # the sweep's inputs
    call, out = sglang_peers.triton_call(fn, q, [cache], table, seq, vis, SCALE)
    out.fill_(float("nan"))
    call()
    torch.cuda.synchronize()
    want, _ = verify_attention_ref(q, cache, table, seq, vis, SCALE)
    err = (out.double() - want).abs().max().item()
    assert err < 2e-2, err


def _close(got, want):
    """A layer's bf16 output against the float64 reference: relative norm, no NaN."""
    g = got.double().cpu()
    return not torch.isnan(g).any() and float((g - want).norm() / want.norm()) <= 5e-3


def test_attention_patch_runs_the_kernel_on_sglangs_metadata():
    """SGLang's Triton backend (the stand-in of tests/sglang_backend.py) patched: every layer of
    a target-verify forward on kdtree's kernel (q as [tokens, H * 576], a uint8 mask, ragged
    prefixes with one of 0, rows out of order, verify slots NaN until their layer writes them),
    against the float64 attention; a second forward at another batch size prepares its own."""
    import sglang_backend as sb  # tests/sglang_backend.py
    from kdtree.sglang import backend

    H, q = 8, 17
    with backend.patch_attention(sb.TritonAttnBackend, verbose=False) as p:
        for bs, prefixes, seed in ((3, [700, 0, 65], 11), (1, [2100], 12)):
            case = sb.verify_forward(bs, q, H, prefixes, 3, DEV, seed=seed, mask_dtype=torch.uint8)
            be = sb.TritonAttnBackend(case.pool, case.req_to_token, q)
            be.init_forward_metadata(case.fb)
            got = sb.run_layers(be, case, H)
            assert be.kernel_calls == 0
            for g, w in zip(got, sb.reference_outputs(case, q, H)):
                assert g.shape == (bs * q, H * 512) and _close(g, w)
        assert p.taken == 6 and not p.left


def test_attention_patch_forward_replays_in_a_cuda_graph():
    """A patched forward captured once (SGLang's graph runner: static metadata buffers), then
    replayed on another forward's rows, prefixes, tree, pool and inputs written into them: the
    per-forward metadata is part of the graph, each layer the kernel alone."""
    import sglang_backend as sb  # tests/sglang_backend.py
    from kdtree.sglang import backend

    H, q, bs = 8, 9, 3
    # Prefix totals equal, so every buffer keeps its shape between the two forwards.
    a = sb.verify_forward(bs, q, H, [700, 0, 65], 4, DEV, seed=21, mask_dtype=torch.uint8, width=800)
    b = sb.verify_forward(bs, q, H, [5, 700, 60], 4, DEV, seed=22, mask_dtype=torch.uint8, width=800)
    be = sb.TritonAttnBackend(a.pool, a.req_to_token, q)
    be.init_forward_metadata(a.fb)
    want_b = sb.reference_outputs(b, q, H)
    with backend.patch_attention(sb.TritonAttnBackend, verbose=False) as p:
        graph, outs = capture_graph(lambda: sb.run_layers(be, a, H))
        graph.replay()   # the captured forward's own inputs first
        torch.cuda.synchronize()
        for g, w in zip(outs, sb.reference_outputs(a, q, H)):
            assert _close(g, w)
        mask_indptr = torch.zeros(bs + 1, dtype=torch.int64)
        mask_indptr[1:] = torch.cumsum(q * (torch.tensor(b.prefixes) + q), 0)
        for dst, src in [*zip(a.pool.kv, b.pool.kv), *zip(a.qs, b.qs), *zip(a.ks, b.ks),
                         (a.req_to_token, b.req_to_token), (a.fb.req_pool_indices, b.fb.req_pool_indices),
                         (a.fb.seq_lens, b.fb.seq_lens), (a.fb.out_cache_loc, b.fb.out_cache_loc),
                         (a.fb.spec_info.custom_mask, b.fb.spec_info.custom_mask),
                         (be.forward_metadata.mask_indptr, mask_indptr)]:
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        for g, w in zip(outs, want_b):
            assert _close(g, w)
        assert be.kernel_calls == 0 and not p.left


def test_attention_patch_matches_sglangs_triton_kernel():
    """Where SGLang's Triton extend kernel imports: the stand-in backend's target verify on
    SGLang's own kernel, then patched onto kdtree's, over the same forward (ragged prefixes, a
    uint8 mask): both against the float64 attention, and against each other."""
    import sglang_backend as sb  # tests/sglang_backend.py
    from kdtree.harness import sglang_peers
    from kdtree.sglang import backend

    fn, why = sglang_peers.triton_verify()
    if fn is None:
        pytest.skip(f"SGLang's Triton kernel does not import here: {why[:120]}")
    H, q = 8, 17
    outs = []
    for patched in (False, True):
        case = sb.verify_forward(2, q, H, [300, 1000], 2, DEV, seed=13, mask_dtype=torch.uint8)
        be = sb.TritonAttnBackend(case.pool, case.req_to_token, q)
        be.extend_attention_fwd = be._count(fn)
        be.init_forward_metadata(case.fb)
        if patched:
            with backend.patch_attention(sb.TritonAttnBackend, verbose=False) as p:
                outs.append(sb.run_layers(be, case, H))
            assert p.taken == 2 and be.kernel_calls == 0
        else:
            outs.append(sb.run_layers(be, case, H))
            assert be.kernel_calls == 2
        torch.cuda.synchronize()
        for g, w in zip(outs[-1], sb.reference_outputs(case, q, H)):
            assert _close(g, w), patched
    for a, b in zip(*outs):
        assert float((a.double() - b.double()).abs().max()) < 3e-2
