"""Synthetic workloads look like the real thing: ties, mixed entropy, poisoned paged caches."""
import numpy as np
import pytest
import torch

from kdtree.harness.workloads import (ACCEPT_POISON, MASK_POISON_BYTE, TREE_POISON, drafter_logits, page_order,
                                      paged_case, poisoned_accept, poisoned_trees, stage_a_inputs, widened_table)
from kdtree.reference.tree import build_tree


def test_drafter_logits_are_seeded_bf16_with_ties():
    a = drafter_logits(4, 15, 1000, seed=1)
    assert a.dtype == torch.bfloat16 and a.shape == (4, 15, 1000)
    assert torch.equal(a, drafter_logits(4, 15, 1000, seed=1))
    assert not torch.equal(a, drafter_logits(4, 15, 1000, seed=2))
    lp, _ = stage_a_inputs(4, 15, 1000, 64, seed=1)
    rows_with_ties = sum(int(len(torch.unique(r)) < r.numel()) for r in lp.reshape(-1, 64))
    assert rows_with_ties > 0.5 * 60
    top = lp[..., 0].exp()
    assert top.max() > 0.9 and top.min() < 0.05   # peaked and flat rows both present


def test_confident_drafts_give_deep_narrow_trees():
    """A drafter that is usually right: the top token at 0.5-0.95 where the row is not
    rounded, and trees far deeper than the mixed drafts' at the same budget."""
    lp, ids = stage_a_inputs(8, 15, 1000, 64, seed=3, coarse_fraction=0.0, drafts="confident")
    top = lp[..., 0].exp()
    assert top.min() > 0.45 and top.max() < 0.97   # bf16 logits: p within a few percent
    assert torch.equal(lp, stage_a_inputs(8, 15, 1000, 64, seed=3, coarse_fraction=0.0, drafts="confident")[0])
    depth = {}
    for drafts in ("mixed", "confident"):
        lp, ids = stage_a_inputs(8, 15, 1000, 64, seed=3, drafts=drafts)
        depth[drafts] = np.median([max(build_tree(lp[b].numpy(), ids[b].numpy(), 64).depths) for b in range(8)])
    assert depth["confident"] >= 10 and depth["mixed"] <= 6, depth
    with pytest.raises(ValueError, match="drafts: expected one of"):
        drafter_logits(1, 1, 10, seed=0, drafts="peaky")


@pytest.mark.parametrize("drafts", ["mixed", "confident"])
def test_a_one_token_vocabulary_is_certain(drafts):
    """V = 1 (the GPU fuzzing campaign's find: the confident drafter gave NaN there): every
    log-prob is 0 and the tree is the chain of that token."""
    lp, ids = stage_a_inputs(3, 5, 1, 16, seed=4, drafts=drafts)
    assert lp.shape == (3, 5, 1) and torch.equal(lp, torch.zeros_like(lp)) and not ids.any()
    assert list(build_tree(lp[0].numpy(), ids[0].numpy(), 16).depths) == [1, 2, 3, 4, 5]


def test_paged_case_layout():
    c = paged_case([0, 63, 64, 130], D=5, H=2, page_size=64, seed=4)
    assert c.seq_lens.tolist() == [5, 68, 69, 135]
    used = set()
    for b, s in enumerate(c.seq_lens.tolist()):
        pages = c.block_table[b, :(s + 63) // 64].tolist()
        assert not used & set(pages)
        used |= set(pages)
        rows = torch.cat([c.kv_cache[p] for p in pages])
        assert torch.isfinite(rows[:s].float()).all()
        assert torch.isnan(rows[s:].float()).all()
    assert c.block_table.tolist() != sorted(c.block_table.tolist())


def test_table_layouts():
    """Block tables shuffled, in runs of consecutive pages (one a request), or runs broken
    about every 16 pages; each a permutation of the cache's pages, and the cache's live
    rows the same keys whatever the order."""
    g = torch.Generator().manual_seed(3)
    for layout in ("scattered", "runs", "broken_runs"):
        assert sorted(page_order([5, 300, 1], 2, layout, g).tolist()) == list(range(308))
    steps = {}
    for layout in ("scattered", "runs", "broken_runs"):
        case = paged_case([600, 2000], 16, 8, 1, seed=7, layout=layout)
        t, seq = case.block_table.long(), case.seq_lens.tolist()
        steps[layout] = [float((t[b, 1:s] - t[b, :s - 1] == 1).float().mean()) for b, s in enumerate(seq)]
        assert not torch.isnan(case.kv_cache[t[1, :seq[1]], 0]).any()  # every live key has its row
    assert max(steps["scattered"]) < 0.05
    assert steps["runs"] == [1.0, 1.0]
    assert all(0.6 < s < 0.97 for s in steps["broken_runs"]), steps
    with pytest.raises(ValueError, match="layout: expected one of"):
        page_order([1], 0, "sorted", g)


def test_widened_table_pads_with_page_zero():
    """A table as wide as a server's context: the requests' pages first, then page 0; a
    table already that wide comes back as it is."""
    case = paged_case([100, 5], 3, 8, 16, seed=2)
    wide = widened_table(case.block_table, 20)
    assert wide.shape == (2, 20) and wide.dtype == torch.int32
    assert torch.equal(wide[:, :case.block_table.shape[1]], case.block_table)
    assert (wide[:, case.block_table.shape[1]:] == 0).all()
    assert widened_table(case.block_table, 3) is case.block_table


def test_timed_calls_read_every_cache_copy_equally():
    """A graph of replay_inner(n, want) calls, each taking rotation's next copy, reads each
    of the n copies the same number of times (so no copy sits in L2 more than another)."""
    from kdtree.harness.sweeps.verify_attn import replay_inner, rotation

    for n, want in [(1, 3), (3, 3), (5, 3), (7, 10)]:
        calls = replay_inner(n, want)
        assert calls >= want and calls % n == 0
        take = rotation(list(range(n)))
        seen = [take() for _ in range(calls)]
        assert seen[:n] == list(range(n))
        assert all(seen.count(i) == calls // n for i in range(n))


@pytest.mark.parametrize("dense", [True, False])
def test_poisoned_trees_poison_every_output(dense):
    """Each output of the build's `out=` holds the poison, none a value a build writes (slots
    and depths are >= 0, parents >= -1, a mask byte 0 or 1), so an unwritten one shows."""
    out = poisoned_trees(3, 40, "cpu", dense)
    tensors = {k: v for k, v in vars(out).items() if isinstance(v, torch.Tensor)}
    assert (out.visibility is None) == (not dense)
    assert len(tensors) == (10 if dense else 9)
    for name, t in tensors.items():
        if t.dtype == torch.bool:
            assert (t.view(torch.uint8) == MASK_POISON_BYTE).all(), name
        else:
            assert (t == TREE_POISON).all(), name
    assert TREE_POISON < -1 and MASK_POISON_BYTE not in (0, 1)


def test_poisoned_accept_shapes_and_poison():
    idx, n, bonus = poisoned_accept(4, 15, "cpu")
    assert idx.shape == (4, 16) and idx.dtype == torch.int32
    assert n.shape == (4,) and n.dtype == torch.int32 and bonus.dtype == torch.int64
    for t in (idx, n, bonus):
        assert (t == ACCEPT_POISON).all()
    assert ACCEPT_POISON > 1025  # past any slot index or accepted length (D <= 1025)


def test_reference_inputs_are_the_reference_sweeps_points():
    """The profiling and timing scripts' inputs (sweeps.tree_build.reference_inputs) are the
    reference set's tree-build points: its L, vocabulary and seed as config/reference.yaml
    (over config/config.yaml) sets them, each point's seed as the sweep draws it."""
    import pathlib

    import yaml

    from kdtree.harness.sweeps import tree_build as tb

    root = pathlib.Path(__file__).resolve().parent.parent
    cfg = yaml.safe_load((root / "config" / "config.yaml").read_text())["sweep_tree_build"]
    cfg.update(yaml.safe_load((root / "config" / "reference.yaml").read_text())["sweep_tree_build"])
    assert (tb.REFERENCE_L, tb.REFERENCE_VOCAB, tb.REFERENCE_SEED) == (cfg["L"], cfg["vocab"], cfg["seed"])
    got = tb.reference_inputs(16, 64, 64, "confident")
    want = stage_a_inputs(16, cfg["L"], cfg["vocab"], 64, seed=tb.point_seed(cfg["seed"], 16, 64), drafts="confident")
    assert all(torch.equal(g, w) for g, w in zip(got, want))
