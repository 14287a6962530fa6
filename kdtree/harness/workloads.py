"""Seeded synthetic workloads that look like real decode rounds.

* Drafter logits in bf16, two kinds (`DRAFTS`): "mixed" entropy, peaked rows (one or
  two dominant tokens) among flat and wide ones, which gives shallow, wide trees; and
  "confident", a drafter that is usually right (the top token at probability 0.5-0.95),
  which gives deep, narrow trees. In both, coarse rows collapse onto a few bf16 steps so
  that exact ties are the normal case (as the spec warns they are).
* Paged latent caches with ragged prefix lengths, block tables that are shuffled or
  runs of consecutive pages (SGLang's page-size-1 allocator hands a prefill one run),
  and every unused page and row poisoned with NaN so that an over-read shows in the
  output.
* Outputs for the kernels' `out=` filled with values no kernel writes (`poisoned_trees`,
  `poisoned_accept`), so that an output left unwritten shows in a comparison.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..reference.attention import QK_DIM
from ..reference.tree import stage_a


DRAFTS = ("mixed", "confident")


def drafter_logits(B: int, L: int, V: int, seed: int, coarse_fraction: float = 0.3,
                   drafts: str = "mixed") -> torch.Tensor:
    """bf16 ``[B, L, V]`` logits of one of the `DRAFTS` kinds; a `coarse_fraction` of the
    rows is rounded to half units (tie-heavy)."""
    if drafts not in DRAFTS:
        raise ValueError(f"drafts: expected one of {DRAFTS}, got {drafts!r}")
    g = torch.Generator().manual_seed(seed)
    if drafts == "confident":
        return _confident_logits(B, L, V, g, coarse_fraction)
    x = torch.randn(B, L, V, generator=g)
    kind = torch.rand(B, L, 1, generator=g)
    temp = torch.where(kind < 0.4, 3.0, 1.0)                        # flat vs wide rows
    x = x * temp
    peak = torch.randint(0, V, (B, L, 2), generator=g)
    boost = torch.rand(B, L, 2, generator=g) * 12.0 * (kind > 0.6)  # peaked rows
    x.scatter_add_(-1, peak, boost)
    return _coarse_rows(x, g, coarse_fraction)


def _coarse_rows(x: torch.Tensor, g: torch.Generator, coarse_fraction: float) -> torch.Tensor:
    """A `coarse_fraction` of the rows rounded to half units (few levels: many ties), as bf16."""
    coarse = torch.rand(*x.shape[:-1], 1, generator=g) < coarse_fraction
    return torch.where(coarse, torch.round(x * 2) / 2, x).to(torch.bfloat16)


def _confident_logits(B: int, L: int, V: int, g: torch.Generator, coarse_fraction: float) -> torch.Tensor:
    """Each position's top token at probability p ~ U(0.5, 0.95) over a random tail (a
    vocabulary of one token has no tail: that token is certain)."""
    if V == 1:  # logsumexp of an empty tail is -inf, and -inf logits give NaN log-probs
        return torch.zeros(B, L, 1, dtype=torch.bfloat16)
    x = torch.randn(B, L, V, generator=g) * 2.0
    p = 0.5 + 0.45 * torch.rand(B, L, 1, generator=g)
    top = torch.randint(0, V, (B, L, 1), generator=g)
    tail = x.scatter(-1, top, float("-inf")).logsumexp(-1, keepdim=True)
    x.scatter_(-1, top, tail + torch.log(p / (1 - p)))  # softmax gives the top token p
    return _coarse_rows(x, g, coarse_fraction)


def stage_a_inputs(B: int, L: int, V: int, budget_max: int, seed: int, coarse_fraction: float = 0.3,
                   drafts: str = "mixed"):
    """float32 top-lp and int64 ids ``[B, L, min(budget_max, V)]`` from synthetic logits."""
    lp, ids = stage_a(drafter_logits(B, L, V, seed, coarse_fraction, drafts), max(1, budget_max))
    return lp, ids


def tied_one_deviation_rows(lp: torch.Tensor, step: float) -> torch.Tensor:
    """Log-prob rows ``[B, L, K]`` rounded to multiples of ``step`` (many equal sums), ranks 1
    and up at least a step below rank 0, sorted and <= 0: a confident drafter's trees lie one
    deviation off the first-child chain with ties between their nodes' scores."""
    x = torch.clamp(torch.round(lp.double() / step) * step, max=0.0)
    x[..., 1:] = torch.minimum(x[..., 1:], x[..., :1] - step)
    return torch.sort(x, dim=-1, descending=True).values.float()


@dataclass
class PagedCase:
    q: torch.Tensor            # bf16 [B, D, H, 576]
    kv_cache: torch.Tensor     # bf16 [num_pages, page_size, 576], NaN outside live rows
    block_table: torch.Tensor  # int32 [B, max_pages], shuffled page ids
    seq_lens: torch.Tensor     # int32 [B] = P_b + D
    visibility: torch.Tensor   # bool [B, D, D]
    prefix_lens: list


TABLE_LAYOUTS = ("scattered", "runs", "broken_runs")


def page_order(pages_per: list, spare_pages: int, layout: str, g: torch.Generator) -> torch.Tensor:
    """Page ids in the order the requests take them (request 0's first, the spares last).

    ``scattered``: a random permutation (no two neighbours consecutive but by chance);
    ``runs``: each request's pages are consecutive ids, the requests at shuffled places;
    ``broken_runs``: runs with about one page in 16 swapped with another of the request's,
    so that a request mixes tiles of consecutive rows and tiles that are not.
    """
    if layout not in TABLE_LAYOUTS:
        raise ValueError(f"layout: expected one of {TABLE_LAYOUTS}, got {layout!r}")
    num_pages = sum(pages_per) + spare_pages
    if layout == "scattered":
        return torch.randperm(num_pages, generator=g)
    first, at = [0] * len(pages_per), 0
    for b in torch.randperm(len(pages_per), generator=g).tolist():  # the runs' order in the cache
        first[b], at = at, at + pages_per[b]
    runs = []
    for b, n in enumerate(pages_per):
        ids = torch.arange(n) + first[b]
        if layout == "broken_runs" and n > 1:
            for i in torch.nonzero(torch.rand(n, generator=g) < 1 / 16).flatten().tolist():
                j = int(torch.randint(0, n, (1,), generator=g))
                ids[[i, j]] = ids[[j, i]]
        runs.append(ids)
    return torch.cat(runs + [torch.arange(spare_pages) + sum(pages_per)])


def paged_case(prefix_lens, D: int, H: int, page_size: int, seed: int, visibility=None,
               spare_pages: int = 2, device="cpu", layout: str = "scattered") -> PagedCase:
    """A paged latent cache holding ``P_b + D`` live rows per request, everything else NaN.

    ``visibility`` defaults to random trees (random parents, ancestor closure); ``layout``
    orders the block tables' page ids (``page_order``).
    """
    g = torch.Generator().manual_seed(seed)
    B = len(prefix_lens)
    seq = [int(p) + D for p in prefix_lens]
    pages_per = [(s + page_size - 1) // page_size for s in seq]
    max_pages = max(pages_per)
    num_pages = sum(pages_per) + spare_pages
    perm = page_order(pages_per, spare_pages, layout, g)
    cache = torch.full((num_pages, page_size, QK_DIM), float("nan"), dtype=torch.bfloat16)
    table = torch.full((B, max_pages), -1, dtype=torch.int32)
    used = 0
    for b in range(B):
        ids = perm[used:used + pages_per[b]]
        used += pages_per[b]
        table[b, :pages_per[b]] = ids.to(torch.int32)
        rows = torch.randn(seq[b], QK_DIM, generator=g).to(torch.bfloat16)
        flat = torch.full((pages_per[b] * page_size, QK_DIM), float("nan"), dtype=torch.bfloat16)
        flat[:seq[b]] = rows
        cache[ids.long()] = flat.view(pages_per[b], page_size, QK_DIM)
    # Unused table entries point at a poisoned spare page, as a stale table would.
    spare = perm[used] if spare_pages else 0
    table[table < 0] = int(spare)
    q = torch.randn(B, D, H, QK_DIM, generator=g).to(torch.bfloat16)
    if visibility is None:
        visibility = random_visibility(B, D, g)
    vis = torch.as_tensor(visibility, dtype=torch.bool)
    return PagedCase(q.to(device), cache.to(device), table.to(device),
                     torch.tensor(seq, dtype=torch.int32, device=device), vis.to(device),
                     list(prefix_lens))


def widened_table(block_table: torch.Tensor, pages: int) -> torch.Tensor:
    """``block_table`` [B, n] padded with page 0 to ``pages`` columns (unchanged where n >=
    pages): a table as wide as a server's context around shorter requests."""
    extra = pages - block_table.shape[1]
    if extra <= 0:
        return block_table
    return torch.cat([block_table, block_table.new_zeros(block_table.shape[0], extra)], dim=1)


def random_visibility(B: int, D: int, g: torch.Generator) -> torch.Tensor:
    """Ancestor closure of random trees (parent of i drawn from 0..i-1, biased to recent nodes)."""
    vis = torch.zeros(B, D, D, dtype=torch.bool)
    for b in range(B):
        for i in range(D):
            if i > 0:
                lo = max(0, i - 8)
                p = int(torch.randint(lo, i, (1,), generator=g))
                vis[b, i] = vis[b, p]
            vis[b, i, i] = True
    return vis


def follow_targets(trees, V: int, follow: float, rng: np.random.Generator) -> np.ndarray:
    """Target argmaxes i64 [B, D] for built trees (a kdtree.tree.TreeBatch): random tokens,
    each slot's replaced by its first child's token with probability ``follow`` (how often a
    draft's first guess is right)."""
    target = rng.integers(0, V, size=(trees.tokens.shape[0], trees.D)).astype(np.int64)
    for b in range(target.shape[0]):
        for i in range(trees.D):
            c = trees.next_token[b, i]
            if c != -1 and rng.random() < follow:
                target[b, i] = trees.tokens[b, c]
    return target


# Output poisons: an int the build never writes, bytes that are no bool, and a word past
# every slot index, length and token the accept kernels write.
TREE_POISON = -7
MASK_POISON_BYTE = 0x5A
ACCEPT_POISON = 0x5A5A5A5A


def poisoned_trees(B: int, D: int, device, dense: bool = True):
    """A ``TreeBuildResult`` for ``tree_build(out=...)`` with every output poisoned: the
    integer ones `TREE_POISON`, the dense mask's bytes `MASK_POISON_BYTE` (its None where
    ``dense`` is False)."""
    from ..ops import TreeBuildResult  # the library is loaded only at a kernel's call
    out = TreeBuildResult.empty(B, D, device, dense_visibility=dense)
    for t in vars(out).values():
        if not isinstance(t, torch.Tensor):
            continue
        if t.dtype == torch.bool:
            t.view(torch.uint8).fill_(MASK_POISON_BYTE)
        else:
            t.fill_(TREE_POISON)
    return out


def poisoned_accept(B: int, max_depth: int, device) -> tuple:
    """``(accept_index i32 [B, max_depth + 1], accept_len i32 [B], bonus i64 [B])`` for
    ``tree_accept(out=...)``, every element `ACCEPT_POISON`."""
    return (torch.full((B, max_depth + 1), ACCEPT_POISON, dtype=torch.int32, device=device),
            torch.full((B,), ACCEPT_POISON, dtype=torch.int32, device=device),
            torch.full((B,), ACCEPT_POISON, dtype=torch.int64, device=device))
