"""The float64 tree-verify reference against a naive per-head loop, masks and LSE merges."""
import math

import pytest
import torch

from kdtree.reference.attention import (LATENT_DIM, merge_partials, softmax_scale, verify_attention_ref)
from kdtree.checks import InputError
from kdtree.harness.workloads import paged_case

SCALE = 0.130861


def naive(case, scale):
    """Per request, per slot, per head: explicit key list, float64."""
    B, D, H, _ = case.q.shape
    page = case.kv_cache.shape[1]
    out = torch.zeros(B, D, H, LATENT_DIM, dtype=torch.float64)
    lse = torch.zeros(B, D, H, dtype=torch.float64)
    for b in range(B):
        P = int(case.seq_lens[b]) - D
        for i in range(D):
            keys = list(range(P)) + [P + j for j in range(D) if case.visibility[b, i, j]]
            rows = torch.stack([case.kv_cache[int(case.block_table[b, k // page]), k % page]
                                for k in keys]).double()
            for h in range(H):
                s = rows @ case.q[b, i, h].double() * scale
                m = s.max()
                e = torch.exp(s - m)
                lse[b, i, h] = m + torch.log(e.sum())
                out[b, i, h] = (e / e.sum()) @ rows[:, :LATENT_DIM]
    return out, lse


@pytest.mark.parametrize("page_size", [1, 64])
def test_reference_matches_naive_loop(page_size):
    case = paged_case([0, 5, 70], D=6, H=2, page_size=page_size, seed=page_size)
    out, lse = verify_attention_ref(case.q, case.kv_cache, case.block_table, case.seq_lens,
                                    case.visibility, SCALE)
    want_o, want_l = naive(case, SCALE)
    assert torch.isfinite(out).all()
    assert torch.allclose(out, want_o, rtol=1e-10, atol=1e-12)
    assert torch.allclose(lse, want_l, rtol=1e-12, atol=1e-12)


def test_masked_tree_slots_are_invisible():
    case = paged_case([3, 9], D=6, H=2, page_size=1, seed=7)
    args = (case.block_table, case.seq_lens, case.visibility, SCALE)
    out, lse = verify_attention_ref(case.q, case.kv_cache, *args)
    D = 6
    checked = 0
    for b in range(2):
        P = int(case.seq_lens[b]) - D
        for i in range(D):
            hidden = [j for j in range(D) if not case.visibility[b, i, j]]
            if not hidden:
                continue
            kv = case.kv_cache.clone()
            for j in hidden:   # huge values in every row slot i must not see
                kv[int(case.block_table[b, P + j]), 0] = 1e4
            out2, lse2 = verify_attention_ref(case.q, kv, *args)
            assert torch.equal(out2[b, i], out[b, i]) and torch.equal(lse2[b, i], lse[b, i])
            assert not torch.equal(out2, out)   # the poison did reach the slots that see it
            checked += 1
    assert checked > 0


def test_lse_merge_of_two_halves_equals_the_whole():
    case = paged_case([40], D=4, H=3, page_size=1, seed=11)
    full_o, full_l = verify_attention_ref(case.q, case.kv_cache, case.block_table, case.seq_lens,
                                          case.visibility, SCALE)
    # half A: the first 20 prefix rows, as a prefix-only "request" with D = 0 visible tree slots;
    # emulate by attending with an explicit split of the key set.
    kv_rows = case.kv_cache[case.block_table[0, :44].long(), 0].double()
    q = case.q[0].double()
    s = torch.einsum("dhc,sc->dhs", q, kv_rows) * SCALE
    mask = torch.ones(4, 44, dtype=torch.bool)
    mask[:, 40:] = case.visibility[0]
    s = s.masked_fill(~mask[:, None], float("-inf"))
    parts = []
    for sl in (slice(0, 20), slice(20, 44)):
        ss = s[..., sl]
        l = torch.logsumexp(ss, -1)
        o = torch.einsum("dhs,sc->dhc", torch.exp(ss - l[..., None]), kv_rows[sl, :LATENT_DIM])
        parts.append((o, l))
    o, l = merge_partials(parts[0][0], parts[0][1], parts[1][0], parts[1][1])
    assert torch.allclose(o, full_o[0], atol=1e-12) and torch.allclose(l, full_l[0], atol=1e-12)


def test_prefix_zero_and_nan_pages_do_not_leak():
    case = paged_case([0, 0], D=3, H=1, page_size=64, seed=2)
    assert torch.isnan(case.kv_cache).any()
    out, lse = verify_attention_ref(case.q, case.kv_cache, case.block_table, case.seq_lens,
                                    case.visibility, SCALE)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    # root with P = 0 sees only itself: output is its own value row
    row = case.kv_cache[int(case.block_table[0, 0]), 0, :LATENT_DIM].double()
    assert torch.allclose(out[0, 0, 0], row)


def test_softmax_scale_values():
    assert math.isclose(softmax_scale(32), 0.130861, rel_tol=1e-5)
    assert math.isclose(softmax_scale(64), 0.144680, rel_tol=1e-5)
    assert math.isclose(softmax_scale(40), 0.135234, rel_tol=1e-5)


def test_bad_arguments_named():
    case = paged_case([4], D=2, H=1, page_size=1, seed=0)
    with pytest.raises(InputError, match="q: expected"):
        verify_attention_ref(case.q[..., :512], case.kv_cache, case.block_table, case.seq_lens,
                             case.visibility, SCALE)
    with pytest.raises(InputError, match="seq_lens\\[0\\]"):
        verify_attention_ref(case.q, case.kv_cache, case.block_table, case.seq_lens + 100,
                             case.visibility, SCALE)
    with pytest.raises(InputError, match="visibility: expected bool"):
        verify_attention_ref(case.q, case.kv_cache, case.block_table, case.seq_lens,
                             case.visibility.int(), SCALE)
