"""Input policy of the spec: NaN rejected, -inf clamped, bad shapes and dtypes named; stage A."""
import numpy as np
import pytest
import torch

from kdtree.checks import NEG_INF_FLOOR, InputError
from kdtree.reference.tree import build_tree, build_trees, stage_a


def arrays(L=3, K=4):
    lp = -np.arange(L * K, dtype=np.float32).reshape(L, K) / 8
    return lp, np.arange(L * K, dtype=np.int64).reshape(L, K)


def test_nan_rejected_with_index():
    lp, ids = arrays()
    lp[1, 2] = np.nan
    with pytest.raises(InputError, match=r"top_logprobs: NaN at index \(1, 2\)"):
        build_tree(lp, ids, 8)


def test_posinf_rejected():
    lp, ids = arrays()
    lp[0, 0] = np.inf
    with pytest.raises(InputError, match="top_logprobs: \\+inf"):
        build_tree(lp, ids, 8)


def test_neginf_clamped_like_the_floor():
    lp, ids = arrays()
    lp[:, 2:] = -np.inf
    clamped = lp.copy()
    clamped[:, 2:] = NEG_INF_FLOOR
    a, b = build_tree(lp, ids, 40), build_tree(clamped, ids, 40)
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.parents, b.parents)
    assert np.isfinite(a.scores).all()
    assert not np.isneginf(lp[:, :2]).any()  # input left untouched


@pytest.mark.parametrize("bad,match", [
    (lambda lp, ids: (lp.astype(np.float64), ids), "top_logprobs: expected dtype float32"),
    (lambda lp, ids: (lp, ids.astype(np.int32)), "top_ids: expected dtype int64"),
    (lambda lp, ids: (lp[0], ids), r"top_logprobs: expected 2-D \[L, K\]"),
    (lambda lp, ids: (lp, ids[:, :2]), "top_ids: expected the shape of top_logprobs"),
    (lambda lp, ids: ([1.0], ids), "top_logprobs: expected a numpy array or torch tensor"),
])
def test_bad_arguments_are_named(bad, match):
    lp, ids = arrays()
    with pytest.raises(InputError, match=match):
        build_tree(*bad(lp, ids), 4)


def test_negative_token_ids_are_refused():
    lp, ids = arrays()
    ids[0, 1] = -5
    with pytest.raises(InputError, match=r"top_ids: expected token ids >= 0, got -5 at index \(0, 1\)"):
        build_tree(lp, ids, 8)


def test_rows_outside_stage_a_are_still_built_by_the_heap_rule():
    """Unsorted rows and log-probs > 0: documented as accepted (the GPU takes its exact path)."""
    lp, ids = arrays()
    lp[1] = lp[1][::-1].copy()              # a rising row
    lp[0, 0] = 0.5                          # a positive log-prob
    t = build_tree(lp, ids, 8)
    assert t.tokens.size == 8 and t.scores[0] == pytest.approx(0.5)
    assert t.parents[0] == -1 and (t.parents[1:] < np.arange(1, 9)).all()


def test_only_the_columns_read_are_checked():
    lp, ids = arrays()
    ids[:, 3] = -1                       # past min(budget, K) = 3: never read
    assert build_tree(lp, ids, 3).tokens.size == 3


@pytest.mark.parametrize("budget", [0, -1, -1000])
def test_budget_at_or_below_zero_is_the_root_only_tree(budget):
    lp, ids = arrays()
    t = build_tree(lp, ids, budget)
    assert t.tokens.size == 0 and t.parents.tolist() == [-1]


def test_bad_budget():
    lp, ids = arrays()
    with pytest.raises(InputError, match="budget: expected <= 1024"):
        build_tree(lp, ids, 1025)
    with pytest.raises(InputError, match="budget: expected an integer"):
        build_tree(lp, ids, 2.5)


def test_torch_inputs_accepted():
    lp, ids = arrays()
    a = build_tree(torch.from_numpy(lp), torch.from_numpy(ids), 6)
    b = build_tree(lp, ids, 6)
    assert np.array_equal(a.tokens, b.tokens)


def test_stage_a_ties_go_to_lower_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]], dtype=torch.bfloat16)
    lp, ids = stage_a(logits, 4)
    assert ids.tolist() == [[1, 2, 4, 3]]
    assert lp.dtype == torch.float32 and ids.dtype == torch.int64
    want = torch.tensor([3.0, 3.0, 3.0, 2.0]) - torch.logsumexp(logits.float(), -1)
    assert torch.equal(lp[0], want)


def test_stage_a_k_capped_by_vocab_and_batched():
    logits = torch.randn(2, 3, 5)
    lp, ids = stage_a(logits, 64)
    assert lp.shape == (2, 3, 5)
    assert torch.allclose(torch.logsumexp(lp, -1), torch.zeros(2, 3), atol=1e-5)


def test_stage_a_rejects_nan_and_ints():
    with pytest.raises(InputError, match="logits: contains NaN"):
        stage_a(torch.tensor([[0.0, float("nan")]]), 1)
    with pytest.raises(InputError, match="logits: expected a floating dtype"):
        stage_a(torch.tensor([[1, 2]]), 1)


def test_batched_errors():
    lp, ids = arrays()
    with pytest.raises(InputError, match=r"budgets: expected shape \[2\]"):
        build_trees(np.stack([lp, lp]), np.stack([ids, ids]), np.array([3]))
    with pytest.raises(InputError, match="d_max: request 0 has 4 slots"):
        build_trees(lp[None], ids[None], np.array([3]), d_max=3)
