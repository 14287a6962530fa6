"""kdtree.sglang on the CPU: the worker's formats (spec sglang.md) against plain readings
of the spec, and patch() against a stand-in worker module."""
import inspect
import types

import numpy as np
import pytest
import torch

from kdtree.checks import InputError
from kdtree.harness.workloads import stage_a_inputs
from kdtree.reference.tree import build_tree
from kdtree import sglang
from kdtree.sglang import reference as ref
from kdtree.sglang.patch import imported_copies


def ancestors(parents, i):
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


def check_tuple_against_spec(t, L, budget, K):
    tokens, depths, parents, child_maps, vis, rnt, rns = t
    n = len(parents) - 1
    assert tokens.dtype == torch.int64 and depths.dtype == torch.int64 and tokens.shape == (n,)
    assert isinstance(parents, list) and parents[0] == -1 and all(parents[i] < i for i in range(1, n + 1))
    assert isinstance(child_maps, list) and len(child_maps) == n + 1
    for p in range(n + 1):   # {token: child} of exactly p's children
        kids = [i for i in range(1, n + 1) if parents[i] == p]
        assert child_maps[p] == {int(tokens[i - 1]): i for i in kids}
    assert vis.dtype == torch.bool and vis.shape == (n + 1, n + 1)
    for i in range(n + 1):
        assert set(np.flatnonzero(vis[i].numpy())) == ancestors(parents, i)
    for i in range(n + 1):   # first child, next sibling in index order
        kids = [c for c in range(1, n + 1) if parents[c] == i]
        assert int(rnt[i]) == (kids[0] if kids else -1)
    for c in range(1, n + 1):
        later = [s for s in range(c + 1, n + 1) if parents[s] == parents[c]]
        assert int(rns[c]) == (later[0] if later else -1)
    assert int(rns[0]) == -1 and rnt.dtype == torch.int64 and rns.dtype == torch.int64
    assert n == min(max(budget, 0), sum(min(budget, K) ** d for d in range(1, L + 1)) if budget > 0 else 0)
    assert all(1 <= int(d) <= L for d in depths)


@pytest.mark.parametrize("budget", [-3, 0, 1, 2, 16, 64, 300])
@pytest.mark.parametrize("V", [2, 3, 50, 4000])
def test_builder_tuple_matches_the_spec(budget, V):
    lp, ids = stage_a_inputs(1, 15, V, max(budget, 1), seed=budget * 31 + V, coarse_fraction=1.0)  # ties
    t = sglang.build_ddtree_tree_from_topk(lp[0], ids[0], budget)
    check_tuple_against_spec(t, 15, budget, lp.shape[2])
    if budget > 0:
        want = build_tree(lp[0].numpy(), ids[0].numpy(), budget)   # the heapq build, ties by path
        assert np.array_equal(t[0].numpy(), want.tokens) and t[2] == want.parents.tolist()


def test_builder_root_only_forms():
    lp, ids = stage_a_inputs(1, 15, 50, 8, seed=1)
    for t in (ref.build_ddtree_tree_from_topk(lp[0], ids[0], 0),
              ref.build_ddtree_tree_from_topk(lp[0, :0], ids[0, :0], 8)):
        tokens, depths, parents, maps, vis, rnt, rns = t
        assert tokens.shape == (0,) and depths.shape == (0,) and parents == [-1] and maps == [{}]
        assert vis.tolist() == [[True]] and rnt.tolist() == [-1] and rns.tolist() == [-1]


def test_builder_golden_cases(golden):
    for i, c in enumerate(golden):
        t = ref.build_ddtree_tree_from_topk(torch.from_numpy(c["top_lp"]), torch.from_numpy(c["top_ids"]),
                                            int(c["budget"]))
        assert t[0].numpy().tobytes() == c["tokens"].tobytes(), i
        assert t[4].numpy().tobytes() == c["visibility"].tobytes(), i
        assert t[2] == c["parents"].tolist(), i


def test_builder_refuses_bad_input():
    lp, ids = stage_a_inputs(1, 4, 50, 8, seed=2)
    with pytest.raises(InputError, match="budget: expected <= 1024"):
        ref.build_ddtree_tree_from_topk(lp[0], ids[0], 1025)
    with pytest.raises(InputError, match="top_log_probs, top_token_ids: expected two"):
        ref.build_ddtree_tree_from_topk(lp[0], ids[0, :2], 4)
    bad = lp[0].clone()
    bad[1, 1] = float("nan")
    with pytest.raises(InputError, match="NaN"):
        ref.build_ddtree_tree_from_topk(bad, ids[0], 4)


class _SaysCuda(torch.Tensor):
    """A CPU tensor the builder takes for a CUDA one: its GPU path, without a GPU."""

    @property
    def is_cuda(self):
        return True


def test_builder_builds_on_the_cpu_where_kdtree_cannot_run(monkeypatch, capsys):
    from kdtree.sglang import builder

    def no_library(*a):
        raise RuntimeError("libkdtree is not built and could not be compiled here: no nvcc")

    monkeypatch.setattr(builder, "_build_on_gpu", no_library)
    monkeypatch.setattr(builder, "_said_fallback", False)
    for seed, budget in [(3, 16), (4, 64), (5, 1)]:
        lp, ids = stage_a_inputs(1, 15, 300, budget, seed=seed, coarse_fraction=0.5)
        got = sglang.build_ddtree_tree_from_topk(lp[0].as_subclass(_SaysCuda), ids[0].as_subclass(_SaysCuda), budget)
        want = ref.build_ddtree_tree_from_topk(lp[0], ids[0], budget)
        assert [torch.equal(g, w) if isinstance(w, torch.Tensor) else g == w for g, w in zip(got, want)] == [True] * 7
    err = capsys.readouterr().err
    assert err.count("tree builds run on the CPU") == 1 and "no nvcc" in err   # said once, with the cause


def test_builder_says_bad_input_rather_than_falling_back(monkeypatch):
    from kdtree.sglang import builder

    def refuses(*a):
        raise InputError("top_log_probs: NaN or +inf; log-probs must be finite or -inf")

    monkeypatch.setattr(builder, "_build_on_gpu", refuses)
    lp, ids = stage_a_inputs(1, 4, 50, 8, seed=2)
    with pytest.raises(InputError, match="top_log_probs: NaN"):
        sglang.build_ddtree_tree_from_topk(lp[0].as_subclass(_SaysCuda), ids[0].as_subclass(_SaysCuda), 8)


def mixed_round(seed, bs=5, q=33, V=60):
    rng = np.random.default_rng(seed)
    budgets = rng.choice([0, 1, 7, q - 1, q - 1], size=bs)
    lp, ids = stage_a_inputs(bs, 15, V, q - 1, seed=seed, coarse_fraction=0.5)
    trees = [ref.build_ddtree_tree_from_topk(lp[i], ids[i], int(budgets[i])) for i in range(bs)]
    bonus = rng.integers(0, V, bs)
    prefix = rng.choice([0, 1, 63, 700], size=bs)
    return lp, ids, budgets, trees, bonus, prefix


def test_padding_mask_and_accept_follow_the_spec():
    q = 33
    lp, ids, budgets, trees, bonus, prefix = mixed_round(3, q=q)
    tokens, positions, nxt, sib, vis = ref.pad_round(trees, bonus, prefix, q)
    for i, t in enumerate(trees):
        n = len(t[2]) - 1
        assert (tokens[i, n + 1:] == bonus[i]).all() and tokens[i, 0] == bonus[i]
        assert (positions[i, n + 1:] == prefix[i]).all() and positions[i, 0] == prefix[i]
        assert (positions[i, 1:n + 1] == prefix[i] + t[1].numpy()).all()
        assert (nxt[i, n + 1:] == -1).all() and (sib[i, n + 1:] == -1).all() and nxt.dtype == np.int32
        assert not vis[i, n + 1:].any() and not vis[i, :, n + 1:].any()
    mask, indptr = ref.custom_mask(vis, prefix)
    assert indptr[0] == 0 and (np.diff(indptr) == q * (prefix + q)).all() and mask.size == indptr[-1]
    for i in range(len(trees)):
        block = mask[indptr[i]:indptr[i + 1]].reshape(q, prefix[i] + q)
        assert block[:, :prefix[i]].all() and (block[:, prefix[i]:] == vis[i]).all()
    # accept: the target follows the first child for a few steps, then a random token
    rng = np.random.default_rng(4)
    target = rng.integers(0, 60, size=(len(trees), q))
    for i in range(len(trees)):
        cur = 0
        for _ in range(3):
            if nxt[i, cur] < 0:
                break
            c = rng.choice([int(nxt[i, cur])] + ([int(sib[i, nxt[i, cur]])] if sib[i, nxt[i, cur]] >= 0 else []))
            target[i, cur] = tokens[i, c]
            cur = c
    acc, commit, nexts = ref.accept([t[3] for t in trees], tokens, target, q)
    for i in range(len(trees)):
        k = int(commit[i])
        path = acc[i, :k] - i * q
        assert path[0] == 0 and (acc[i, k:] == -1).all()
        for a, b in zip(path[:-1], path[1:]):   # each step: a child whose token is the target
            assert trees[i][2][b] == a and tokens[i, b] == target[i, a]
        cur = path[-1]
        assert not any(   # the walk stops where no child matches
            tokens[i, c] == target[i, cur] for c in range(1, q) if c < len(trees[i][2]) and trees[i][2][c] == cur)
        assert (nexts[i, :k - 1] == tokens[i, path[1:]]).all() and nexts[i, k - 1] == target[i, cur]
        assert (nexts[i, k:] == 0).all()
    assert commit.max() >= 2   # some draft token accepted


# ---------------------------------------------------------------- patch()
def stand_in(sig="(top_log_probs, top_token_ids, budget)"):
    m = types.ModuleType("fake_sglang_ddtree_worker")
    ns = {}
    exec(f"def build_ddtree_tree_from_topk{sig}:\n    return 'cpu path'\n", ns)
    m.build_ddtree_tree_from_topk = ns["build_ddtree_tree_from_topk"]
    m.other = lambda: "untouched"
    return m


def test_patch_replaces_names_it_and_undoes(capsys):
    m = stand_in()
    original = m.build_ddtree_tree_from_topk
    p = sglang.patch(m)
    assert p.replaced == ("build_ddtree_tree_from_topk",)
    assert "replaced fake_sglang_ddtree_worker.build_ddtree_tree_from_topk" in capsys.readouterr().err
    assert m.build_ddtree_tree_from_topk is sglang.build_ddtree_tree_from_topk
    lp, ids = stage_a_inputs(1, 15, 50, 8, seed=9)
    got = m.build_ddtree_tree_from_topk(lp[0], ids[0], 8)   # the worker's call, the worker's tuple
    assert len(got) == 7 and got[2] == build_tree(lp[0].numpy(), ids[0].numpy(), 8).parents.tolist()
    with pytest.raises(sglang.PatchError, match="already patched"):
        sglang.patch(m)
    p.undo()
    assert m.build_ddtree_tree_from_topk is original and m.other() == "untouched"
    with sglang.patch(m, verbose=False):
        assert m.build_ddtree_tree_from_topk is not original
    assert m.build_ddtree_tree_from_topk is original
    sglang.patch(m, verbose=False)
    assert sglang.unpatch(m) and m.build_ddtree_tree_from_topk is original and not sglang.unpatch(m)


def test_patch_refuses_what_it_does_not_know():
    with pytest.raises(sglang.PatchError, match="not found; this module is not a DDTree worker"):
        sglang.patch(types.ModuleType("empty"))
    m = stand_in("(top_log_probs, top_token_ids, budget, temperature)")
    original = m.build_ddtree_tree_from_topk
    with pytest.raises(sglang.PatchError, match=r"expected parameters \('top_log_probs', 'top_token_ids', 'budget'\)"):
        sglang.patch(m)
    assert m.build_ddtree_tree_from_topk is original   # nothing replaced
    with pytest.raises(sglang.PatchError, match="does not import"):
        sglang.patch("no_such_module_for_kdtree")
    with pytest.raises(sglang.PatchError, match="no SGLang DDTree worker module found"):
        sglang.patch()   # sglang is not installed here


def test_patch_from_env(monkeypatch, capsys):
    import sys

    from kdtree.sglang.patch import patch_from_env

    m = stand_in()
    monkeypatch.setitem(sys.modules, "fake_sglang_ddtree_worker", m)
    monkeypatch.setenv("KDTREE_SGLANG_MODULE", "fake_sglang_ddtree_worker")
    monkeypatch.setenv("KDTREE_SGLANG", "0")
    assert patch_from_env() is None
    monkeypatch.setenv("KDTREE_SGLANG", "1")
    p = patch_from_env()
    try:
        assert p.replaced == ("build_ddtree_tree_from_topk",)
    finally:
        p.undo()
    monkeypatch.setenv("KDTREE_SGLANG_MODULE", "no_such_module_for_kdtree")
    assert patch_from_env() is None and "not patched" in capsys.readouterr().err


def test_drop_in_signature_is_the_workers():
    """The worker's three parameters, then the DFlash + DDTree fork's optional workspace."""
    params = inspect.signature(sglang.build_ddtree_tree_from_topk).parameters
    assert tuple(params) == ("top_log_probs", "top_token_ids", "budget", "workspace")
    assert params["workspace"].default is None


def test_patch_reaches_a_worker_that_imported_the_builder_by_name(monkeypatch, capsys):
    """The DFlash + DDTree fork: the utils module defines build_ddtree_tree_from_topk(...,
    workspace=None) and the worker module imported it by name, so its calls go through its own
    reference. patch() of the utils replaces that copy too, says so, and undo() restores both;
    the worker's call with its workspace gets the worker's 7-tuple."""
    import sys

    utils = stand_in("(top_log_probs, top_token_ids, budget, workspace=None)")
    utils.__name__ = "fake_dflash_ddtree_utils"
    worker = types.ModuleType("fake_dflash_ddtree_worker")
    worker.build_ddtree_tree_from_topk = original = utils.build_ddtree_tree_from_topk
    monkeypatch.setitem(sys.modules, "fake_dflash_ddtree_utils", utils)
    monkeypatch.setitem(sys.modules, "fake_dflash_ddtree_worker", worker)
    _, originals = sglang.check_patch(utils)
    assert [(m, n) for m, n in imported_copies(utils, originals)] == [(worker, "build_ddtree_tree_from_topk")]
    p = sglang.patch(utils)
    try:
        assert p.copies == ("fake_dflash_ddtree_worker.build_ddtree_tree_from_topk",)
        assert "fake_dflash_ddtree_utils.build_ddtree_tree_from_topk, fake_dflash_ddtree_worker." \
               "build_ddtree_tree_from_topk" in capsys.readouterr().err
        assert worker.build_ddtree_tree_from_topk is sglang.build_ddtree_tree_from_topk
        lp, ids = stage_a_inputs(1, 15, 50, 8, seed=9)
        got = worker.build_ddtree_tree_from_topk(lp[0], ids[0], 8, workspace=object())
        assert got[2] == build_tree(lp[0].numpy(), ids[0].numpy(), 8).parents.tolist()
        with pytest.raises(sglang.PatchError, match="already kdtree's"):
            sglang.patch(worker)   # the copy was switched with its source
    finally:
        p.undo()
    assert utils.build_ddtree_tree_from_topk is original and worker.build_ddtree_tree_from_topk is original


@pytest.mark.parametrize("sig", ["(top_log_probs, top_token_ids, budget, workspace)",
                                 "(top_log_probs, top_token_ids, budget, temperature=1.0)",
                                 "(top_log_probs, top_token_ids, budget, workspace=None, chain_len=0)",
                                 "(top_token_ids, top_log_probs, budget)"])
def test_patch_refuses_parameters_it_would_not_honour(sig):
    """A parameter kdtree's builder would drop or could not be given (no default, unknown, or
    the order changed) means another format: nothing is replaced."""
    m = stand_in(sig)
    original = m.build_ddtree_tree_from_topk
    with pytest.raises(sglang.PatchError, match=r"expected parameters \('top_log_probs', 'top_token_ids', "
                                                r"'budget'\) \(then optionally workspace=\)"):
        sglang.patch(m)
    assert m.build_ddtree_tree_from_topk is original


@pytest.mark.parametrize("D", [1, 2, 33, 65, 1025])
def test_builder_buffer_holds_every_field_once(D):
    """The CUDA builder's one-buffer tree: each field as TreeBuildResult.empty makes it
    (dtype, shape, contiguous), aligned, and the views tile the buffer without overlap, so
    one copy moves all of them and no field writes over another."""
    from kdtree import ops
    from kdtree.sglang.builder import _one_tree_buffer

    flat, trees = _one_tree_buffer(D, "cpu")
    like = ops.TreeBuildResult.empty(1, D, "cpu", dense_visibility=True)
    spans = []
    for name in ops._OUT_FIELDS:
        v, w = getattr(trees, name), getattr(like, name)
        assert (v.dtype, v.shape, v.is_contiguous()) == (w.dtype, w.shape, True), name
        at = v.data_ptr() - flat.data_ptr()
        assert at % v.element_size() == 0, name
        spans.append((at, at + v.nbytes))
    spans.sort()
    assert spans[0][0] == 0 and spans[-1][1] == flat.numel()
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_verify_attention_plans_per_request_splits(monkeypatch):
    """VerifyAttention plans for max_seq_len, SGLang's context length, not the batch's lengths:
    its one plan asks for per-request split counts, so that short requests keep splits of many
    keys (a count for the context would cut theirs into a few keys each)."""
    from kdtree.sglang import attention

    made = []

    class FakePlan:
        def __init__(self, *args, **kw):
            made.append((args, kw))
            self.device = torch.device("cpu")

    monkeypatch.setattr(attention.ops, "TreeVerifyPlan", FakePlan)
    sglang.VerifyAttention(16, 65, 8, 131072, device="cpu")
    assert made == [((16, 65, 8, 1, 131072), dict(device="cpu", kernel="auto", per_request_splits=True))]
