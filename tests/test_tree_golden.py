"""The CPU builder against the DDTree authors' reference implementation."""
import numpy as np

from kdtree.reference.tree import build_tree, greedy_accept


def test_golden_cases_cover_the_edge_cases(golden):
    budgets = {int(c["budget"]) for c in golden}
    assert {1, 1024} <= budgets
    # tiny vocabularies where the heap empties before the budget
    assert any(c["tokens"].shape[0] < int(c["budget"]) for c in golden)


def test_build_matches_reference_byte_for_byte(golden):
    for i, c in enumerate(golden):
        t = build_tree(c["top_lp"], c["top_ids"], int(c["budget"]))
        for field in ("tokens", "depths", "parents", "visibility"):
            got, want = getattr(t, field), c[field]
            assert got.dtype == want.dtype, (i, field, got.dtype, want.dtype)
            assert got.shape == want.shape, (i, field)
            assert got.tobytes() == want.tobytes(), (i, field)


def test_accept_matches_reference(golden):
    for i, c in enumerate(golden):
        t = build_tree(c["top_lp"], c["top_ids"], int(c["budget"]))
        accepted, bonus = greedy_accept(t, c["target"])
        assert np.array_equal(accepted, c["accepted"]), i
        assert bonus == int(c["bonus"]), i
