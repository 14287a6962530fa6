"""Synthetic workloads look like the real thing: ties, mixed entropy, poisoned paged caches."""
import torch

from kdtree.harness.workloads import drafter_logits, paged_case, stage_a_inputs


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
