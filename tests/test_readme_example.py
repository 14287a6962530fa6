"""The README's kernel example, run as written, against the CPU references (GPU only)."""
import pathlib
import re

import numpy as np
import pytest

from kdtree.reference.tree import build_trees, greedy_accept_batch

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> str:
    text = README.read_text()
    m = re.search(r"<!-- example:start -->\s*```python\n(.*?)```\s*<!-- example:end -->", text, re.S)
    assert m, "README.md lost its example block"
    return m.group(1)


def test_readme_example_block_is_found():
    assert "kdtree.tree_build" in readme_example() and "plan.run" in readme_example()


@pytest.mark.gpu
def test_readme_example_runs_and_matches_the_references():
    ns = {}
    exec(compile(readme_example(), "README.md example", "exec"), ns)
    trees, L = ns["trees"], ns["L"]
    cpu = lambda t: t.cpu().numpy()
    want = build_trees(cpu(ns["top_lp"]), cpu(ns["top_ids"]), cpu(ns["budgets"]),
                       seq_lens=cpu(ns["prefix"]), root_tokens=cpu(ns["roots"]), d_max=ns["D"])
    for f in ("node_counts", "tokens", "parents", "next_token", "next_sibling", "visibility_bits"):
        assert np.array_equal(cpu(getattr(trees, f)), getattr(want, f)), f
    acc = greedy_accept_batch(want.tokens, want.next_token, want.next_sibling, cpu(ns["target"]), L)
    for got, w in zip((ns["accept_index"], ns["accept_len"], ns["bonus"]), acc):
        assert np.array_equal(cpu(got), w)
    out = ns["out"]
    assert out.shape == (4, ns["D"], ns["H"], 512) and bool(out.float().isfinite().all())
