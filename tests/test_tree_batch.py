"""Batched build (the GPU kernel's layout) and greedy accept."""
import numpy as np
import pytest

from kdtree.reference.tree import (PAD_TOKEN, build_tree, build_trees, greedy_accept, greedy_accept_batch,
                         greedy_accept_parents_batch, pack_visibility)
from kdtree.harness.workloads import follow_targets, stage_a_inputs


def test_batched_equals_per_request_and_padding_is_unreachable():
    budgets = np.array([1, 16, 0, 40, 7])
    lp, ids = stage_a_inputs(len(budgets), 15, 300, 40, seed=3)
    seq = np.array([10, 0, 5, 1000, 64])
    roots = np.array([11, 12, 13, 14, 15])
    tb = build_trees(lp, ids, budgets, seq_lens=seq, root_tokens=roots)
    D = 41
    assert tb.D == D and tb.visibility_bits.shape == (5, D, 2)
    for b, bud in enumerate(budgets):
        t = build_tree(lp[b].numpy(), ids[b].numpy(), int(bud))
        n = t.n
        assert tb.node_counts[b] == n == bud
        assert tb.tokens[b, 0] == roots[b]
        assert np.array_equal(tb.tokens[b, 1:n + 1], t.tokens)
        assert np.array_equal(tb.parents[b, :n + 1], t.parents)
        assert np.array_equal(tb.visibility[b, :n + 1, :n + 1], t.visibility)
        assert np.array_equal(tb.positions[b, :n + 1], t.positions(int(seq[b])))
        # padding: unreachable leaves of the root
        pad = slice(n + 1, D)
        assert (tb.tokens[b, pad] == PAD_TOKEN).all() and (tb.parents[b, pad] == 0).all()
        assert (tb.positions[b, pad] == seq[b] + 1).all()
        for i in range(n + 1, D):
            row = np.zeros(D, bool)
            row[[0, i]] = True
            assert np.array_equal(tb.visibility[b, i], row)
        links = np.concatenate([tb.next_token[b], tb.next_sibling[b]])
        assert not np.isin(links, np.arange(n + 1, D)).any()
        assert (tb.visibility[b, :n + 1, n + 1:] == 0).all()


def test_pack_visibility_roundtrip():
    rng = np.random.default_rng(0)
    vis = rng.random((3, 70, 70)) < 0.3
    bits = pack_visibility(vis)
    assert bits.dtype == np.int32 and bits.shape == (3, 70, 3)
    u = bits.view(np.uint32)
    unpacked = ((u[..., :, None] >> np.arange(32, dtype=np.uint32)) & 1).reshape(3, 70, 96)[..., :70]
    assert np.array_equal(unpacked.astype(bool), vis)


def child_map_walk(t, target):
    """Independent accept: dict of children by token, per node."""
    children = {}
    for i in range(1, t.n + 1):
        children.setdefault(int(t.parents[i]), {})[int(t.tokens[i - 1])] = i
    acc, cur = [0], 0
    while int(target[cur]) in children.get(cur, {}):
        cur = children[cur][int(target[cur])]
        acc.append(cur)
    return acc, int(target[cur])


@pytest.mark.parametrize("seed", range(25))
def test_accept_follows_tree_for_k_steps(seed):
    rng = np.random.default_rng(seed)
    budget = int(rng.choice([1, 5, 16, 64, 256]))
    lp, ids = stage_a_inputs(1, 15, 200, budget, seed=seed)
    t = build_tree(lp[0].numpy(), ids[0].numpy(), budget)
    # A target that follows a random root-to-node path for k steps, then diverges.
    target = rng.integers(0, 200, size=t.n + 1).astype(np.int64)
    node = int(rng.integers(0, t.n + 1))
    path = []
    while node > 0:
        path.append(node)
        node = int(t.parents[node])
    path.reverse()
    k = int(rng.integers(0, len(path) + 1))
    cur = 0
    for c in path[:k]:
        target[cur] = t.tokens[c - 1]
        cur = c
    acc, bonus = greedy_accept(t, target)
    assert acc.tolist()[:k + 1] == [0] + path[:k]
    want = child_map_walk(t, target)
    assert acc.tolist() == want[0] and bonus == want[1]


def test_accept_none_and_full_depth():
    lp = np.zeros((4, 1), np.float32)          # a chain of 4
    ids = np.array([[5], [6], [7], [8]], np.int64)
    t = build_tree(lp, ids, 4)
    acc, bonus = greedy_accept(t, np.array([9, 9, 9, 9, 9], np.int64))
    assert acc.tolist() == [0] and bonus == 9
    acc, bonus = greedy_accept(t, np.array([5, 6, 7, 8, 42], np.int64))
    assert acc.tolist() == [0, 1, 2, 3, 4] and bonus == 42


def test_accept_batch_matches_single():
    budgets = np.array([3, 30, 0, 17])
    lp, ids = stage_a_inputs(4, 15, 50, 30, seed=9)
    roots = np.array([1, 2, 3, 4])
    tb = build_trees(lp, ids, budgets, root_tokens=roots)
    # make acceptance likely: the target at each node points to its first child
    target = follow_targets(tb, 50, 0.8, np.random.default_rng(1))
    idx, alen, bonus = greedy_accept_batch(tb.tokens, tb.next_token, tb.next_sibling, target, 15)
    assert idx.shape == (4, 16) and idx.dtype == np.int32
    for b in range(4):
        t = build_tree(lp[b].numpy(), ids[b].numpy(), int(budgets[b]))
        acc, bon = greedy_accept(t, target[b, :t.n + 1])
        assert alen[b] == len(acc) - 1
        assert idx[b, :len(acc)].tolist() == [b * tb.D + a for a in acc]
        assert (idx[b, len(acc):] == -1).all()
        assert bonus[b] == bon
    assert alen.max() > 1  # the test exercised real acceptance


def test_accept_target_shape_named():
    t = build_tree(np.zeros((2, 2), np.float32), np.zeros((2, 2), np.int64), 3)
    with pytest.raises(ValueError, match=r"target: expected shape \[4\]"):
        greedy_accept(t, np.zeros(3, np.int64))


@pytest.mark.parametrize("seed", range(6))
def test_accept_from_parents_equals_the_list_walk(seed):
    """On built trees (ragged budgets: padding slots have parent 0 and PAD_TOKEN) the
    parents form gives the list walk's result; root targets of PAD_TOKEN check that
    padding slots are not taken for children of the root."""
    rng = np.random.default_rng(seed)
    B, V = 40, 12
    budgets = rng.integers(0, 60, B)
    budgets[0] = 60
    lp, ids = stage_a_inputs(B, 15, V, 60, seed=seed, coarse_fraction=0.5)
    tb = build_trees(lp, ids, budgets, root_tokens=rng.integers(0, V, B))
    target = follow_targets(tb, V, 0.85, rng)
    target[::3, 0] = PAD_TOKEN
    for max_depth in (0, 1, 15):
        want = greedy_accept_batch(tb.tokens, tb.next_token, tb.next_sibling, target, max_depth)
        got = greedy_accept_parents_batch(tb.tokens, tb.parents, tb.node_counts, target, max_depth)
        for g, w in zip(got, want):
            assert np.array_equal(g, w)
    assert want[1].max() >= 3 and (want[1] == 0).any()


def test_accept_from_parents_rules():
    """Smallest matching child wins; slots past n or with a parent outside [0, i) are not
    nodes; node counts are clamped to [0, D - 1]."""
    cand = np.array([[0, 5, 5, 6, 7, 7]], np.int64)
    target = np.array([[5, 6, 0, 7, 0, 0]], np.int64)
    par = np.array([[-1, 0, 0, 1, 3, 3]], np.int32)
    run = lambda p, n, md=15: greedy_accept_parents_batch(cand, p, np.array([n], np.int32), target, md)
    idx, alen, bonus = run(par, 5)
    assert idx[0, :4].tolist() == [0, 1, 3, 4] and alen[0] == 3 and bonus[0] == 0
    assert run(par, 3)[1][0] == 2            # slot 4 is past n = 3
    assert run(par, 99)[1][0] == 3           # n clamped to D - 1
    assert run(par, -4)[1][0] == 0 and run(par, -4)[2][0] == 5
    bad = par.copy()
    bad[0, 1] = 1                            # a parent that is not a smaller slot
    assert run(bad, 5)[0][0, :2].tolist() == [0, 2]  # slot 2 (token 5) takes over: a leaf
    assert run(par, 5, md=1)[0][0].tolist() == [0, 1]
    with pytest.raises(ValueError, match="parents: expected dtype int32"):
        greedy_accept_parents_batch(cand, par.astype(np.int64), np.array([5], np.int32), target, 15)
    with pytest.raises(ValueError, match=r"node_counts: expected shape \[1\]"):
        greedy_accept_parents_batch(cand, par, np.array([5, 5], np.int32), target, 15)
