"""The heap build against a brute-force oracle and structural properties.

The oracle enumerates every rank path, scores it the way the spec's pushes do,
sorts by (score desc, path asc) and keeps the top `budget`. Log-probs are drawn
from a coarse dyadic grid (exact in float64) so that every sum is exact and ties
are everywhere: then the top-`budget` prefixes in the total order are exactly
what the heap must pop, in that order.
"""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kdtree.reference.tree import build_tree, visibility_from_parents


def dyadic_rows(rng, L, K, levels=6):
    lp = -rng.integers(0, levels, size=(L, K)).astype(np.float32) / 4
    lp = -np.sort(-lp, axis=1)  # descending per row
    ids = np.stack([rng.permutation(10_000)[:K] for _ in range(L)]).astype(np.int64)
    return lp.astype(np.float32), ids


def path_score(lp, path):
    """Score as the heap builds it: first child from the parent, siblings from the left one."""
    s = float(lp[0][0])
    for d, r in enumerate(path):
        if d > 0:
            s = s + float(lp[d][0])
        for k in range(r):
            s = (s - float(lp[d][k])) + float(lp[d][k + 1])
    return s


def oracle(lp, ids, budget):
    L, K0 = lp.shape
    K = min(budget, K0)
    paths = [p for depth in range(1, L + 1) for p in itertools.product(range(K), repeat=depth)]
    paths.sort(key=lambda p: (-path_score(lp, p), p))
    chosen = paths[:max(budget, 0)]
    index = {p: i + 1 for i, p in enumerate(chosen)}
    parents = [-1] + [index[p[:-1]] if len(p) > 1 else 0 for p in chosen]
    tokens = [int(ids[len(p) - 1][p[-1]]) for p in chosen]
    return np.array(tokens, np.int64), np.array([len(p) for p in chosen], np.int64), np.array(parents, np.int32)


@pytest.mark.parametrize("seed", range(40))
def test_against_bruteforce_oracle(seed):
    rng = np.random.default_rng(seed)
    L = int(rng.integers(1, 5))
    K = int(rng.integers(1, 4))
    budget = int(rng.integers(1, 60))
    lp, ids = dyadic_rows(rng, L, K)
    t = build_tree(lp, ids, budget)
    tokens, depths, parents = oracle(lp, ids, budget)
    assert np.array_equal(t.tokens, tokens)
    assert np.array_equal(t.depths, depths)
    assert np.array_equal(t.parents, parents)


def check_structure(t, lp, budget):
    L, K0 = lp.shape
    K = max(0, min(budget, K0))
    reachable = sum(K ** d for d in range(1, L + 1))
    n = t.n
    assert n == min(max(budget, 0), reachable)
    assert t.parents.dtype == np.int32 and t.parents[0] == -1
    assert all(0 <= t.parents[i] < i for i in range(1, n + 1))
    # prefix-closed with depths consistent: a node sits one below its parent
    full_depth = np.concatenate([[0], t.depths])
    assert all(full_depth[i] == full_depth[t.parents[i]] + 1 for i in range(1, n + 1))
    assert (t.depths >= 1).all() and (t.depths <= L).all()
    # siblings carry distinct tokens
    for p in range(n + 1):
        kids = [i for i in range(1, n + 1) if t.parents[i] == p]
        assert len({int(t.tokens[i - 1]) for i in kids}) == len(kids)
        # LCRS links walk exactly the children, in index order
        walk, c = [], int(t.next_token[p])
        while c != -1:
            walk.append(c)
            c = int(t.next_sibling[c])
        assert walk == kids
    # visibility is the ancestor closure
    vis = np.zeros((n + 1, n + 1), bool)
    for i in range(n + 1):
        j = i
        while j != -1:
            vis[i, j] = True
            j = int(t.parents[j])
    assert np.array_equal(t.visibility, vis)
    # pops non-increasing (exact for lp <= 0 up to float64 rounding of a sibling step)
    assert (np.diff(t.scores) <= 1e-9 * (1 + np.abs(t.scores[1:]))).all()


@settings(max_examples=200, deadline=None)
@given(L=st.integers(1, 15), K=st.integers(1, 40), budget=st.integers(-2, 300),
       seed=st.integers(0, 2**32 - 1), coarse=st.booleans())
def test_structure_properties(L, K, budget, seed, coarse):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((L, K)).astype(np.float32) * 3
    if coarse:
        x = np.round(x * 2) / 2
    lp = -np.sort(np.abs(x), axis=1).astype(np.float32)   # <= 0, descending
    ids = rng.permutation(1 << 20)[:L * K].reshape(L, K).astype(np.int64)
    check_structure(build_tree(lp, ids, budget), lp, budget)


@pytest.mark.parametrize("budget,L,K", [(1, 15, 1), (1, 15, 64), (14, 15, 14), (7, 15, 7),
                                        (1024, 15, 1024), (1024, 3, 2), (300, 15, 1), (50, 2, 3)])
def test_edge_budgets(budget, L, K):
    rng = np.random.default_rng(budget * 31 + L)
    lp = np.round(-np.sort(np.abs(rng.standard_normal((L, K)) * 2), axis=1) * 2).astype(np.float32) / 2
    ids = rng.permutation(1 << 18)[:L * K].reshape(L, K).astype(np.int64)
    t = build_tree(lp, ids, budget)
    check_structure(t, lp, budget)


def test_budget_1_is_the_top_token():
    lp = np.array([[-0.5, -0.5, -1.0], [-0.1, -2.0, -3.0]], np.float32)
    ids = np.array([[7, 3, 9], [4, 5, 6]], np.int64)
    t = build_tree(lp, ids, 1)
    assert t.tokens.tolist() == [7] and t.parents.tolist() == [-1, 0]


def test_tie_order_prefers_smaller_path():
    # All log-probs 0: every score ties; order is lexicographic with prefixes first:
    # (0,) (0,0) (0,1) (1,) (1,0) (1,1)
    lp = np.zeros((2, 2), np.float32)
    ids = np.array([[10, 11], [20, 21]], np.int64)
    t = build_tree(lp, ids, 6)
    assert t.parents.tolist() == [-1, 0, 1, 1, 0, 4, 4]
    assert t.tokens.tolist() == [10, 20, 21, 11, 20, 21]


def test_root_only_trees():
    lp = np.zeros((3, 2), np.float32)
    ids = np.zeros((3, 2), np.int64)
    for t in (build_tree(lp, ids, 0), build_tree(lp, ids, -5), build_tree(lp[:0], ids[:0], 8)):
        assert t.n == 0 and t.parents.tolist() == [-1]
        assert t.visibility.tolist() == [[True]]
        assert t.next_token.tolist() == [-1] and t.positions(5).tolist() == [5]


def test_positions():
    lp = np.array([[-0.1, -1.0], [-0.2, -1.0]], np.float32)
    ids = np.array([[1, 2], [3, 4]], np.int64)
    t = build_tree(lp, ids, 3)
    assert t.positions(100).tolist() == (100 + np.concatenate([[0], t.depths])).tolist()


def test_visibility_from_parents_chain():
    vis = visibility_from_parents(np.array([-1, 0, 1, 2], np.int32))
    assert np.array_equal(vis, np.tril(np.ones((4, 4), bool)))
