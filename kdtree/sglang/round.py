"""The batched round on the GPU (spec sglang.md, steps 3, 4 and 6): the padded verify
layout, the custom mask and the accept, into static buffers with no host sync, so that the
round captures in one CUDA graph."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import ops
from ..checks import InputError
from ..reference.tree import MAX_BUDGET


class VerifyLayout(NamedTuple):
    """Step 3's padded verify layout: ``tree_tokens i64 [bs, q]``, ``positions i64 [bs, q]``,
    ``retrieve_next_token`` and ``retrieve_next_sibling`` i32 [bs, q], ``visibility bool
    [bs, q, q]`` (pad rows and columns false)."""

    tree_tokens: torch.Tensor
    positions: torch.Tensor
    retrieve_next_token: torch.Tensor
    retrieve_next_sibling: torch.Tensor
    visibility: torch.Tensor


class AcceptOutput(NamedTuple):
    """Step 6: ``accept_index i64 [bs, q]`` (``i * q + slot``, -1 padded), ``commit_lens i32
    [bs]`` (root included), ``next_token_ids i64 [bs, q]`` (accepted tokens then the bonus)."""

    accept_index: torch.Tensor
    commit_lens: torch.Tensor
    next_token_ids: torch.Tensor


class RoundBuilder:
    """The batched round's static buffers for up to ``max_bs`` requests and verify width
    ``q = 1 + budget`` on ``device``: ``build`` writes the padded verify layout (and keeps the
    build's own outputs, e.g. ``trees.visibility_bits`` for kdtree's verify attention; the
    build runs without the prefix, so ``trees.positions`` are the depths).
    Every call launches on the current stream and never synchronises the host; the same
    buffers are returned each time (what a captured graph replays)."""

    def __init__(self, max_bs: int, budget: int, device="cuda"):
        for name, v, lo, hi in (("max_bs", max_bs, 1, 65535), ("budget", budget, 0, MAX_BUDGET)):
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise InputError(f"{name}: expected an integer in [{lo}, {hi}], got {v!r}")
        self.device = ops.cuda_device(device)
        self.max_bs, self.q = max_bs, budget + 1
        q, dev = self.q, self.device
        self.trees = ops.TreeBuildResult.empty(max_bs, q, dev, dense_visibility=True)
        self.layout = VerifyLayout(torch.empty(max_bs, q, dtype=torch.int64, device=dev),
                                   torch.empty(max_bs, q, dtype=torch.int64, device=dev),
                                   torch.empty(max_bs, q, dtype=torch.int32, device=dev),
                                   torch.empty(max_bs, q, dtype=torch.int32, device=dev),
                                   torch.empty(max_bs, q, q, dtype=torch.bool, device=dev))
        self._budgets = torch.empty(max_bs, dtype=torch.int32, device=dev)   # int64 budgets' copy
        self._filled = {}   # int -> an i32 [max_bs] buffer holding it, never rewritten
        self._rows = {}   # bs -> (TreeBuildResult, VerifyLayout): views of the first bs rows

    def _views(self, bs):
        if bs not in self._rows:
            full = {n: getattr(self.trees, n) for n in ops._OUT_FIELDS}
            trees = ops.TreeBuildResult(**{n: None if v is None else v[:bs] for n, v in full.items()})
            self._rows[bs] = trees, VerifyLayout(*(t[:bs] for t in self.layout))
        return self._rows[bs]

    def _budget_tensor(self, budgets, bs):
        """The build's i32 budgets: an int32 tensor as given; an int64 tensor copied; one int
        read from a buffer filled with it on its first use, so later calls (and a graph that
        captured one) launch nothing for it, and no other call rewrites what a graph reads."""
        if isinstance(budgets, int) and not isinstance(budgets, bool):
            if not 0 <= budgets <= self.q - 1:
                raise InputError(f"budgets: expected 0..{self.q - 1} (q - 1), got {budgets}")
            filled = self._filled.get(budgets)
            if filled is None:
                filled = torch.full((self.max_bs,), budgets, dtype=torch.int32, device=self.device)
                if not torch.cuda.is_current_stream_capturing():   # a captured fill runs only on replay
                    self._filled[budgets] = filled
            return filled[:bs]
        budgets = _lens("budgets", budgets, bs, self.device)
        if budgets.dtype is torch.int32:
            return budgets
        return self._budgets[:bs].copy_(budgets)   # a budget past q - 1 is cut to q - 1 (status bit)

    def build(self, top_log_probs, top_token_ids, budgets, bonus_tokens, prefix_lens) -> VerifyLayout:
        """``top_log_probs f32 [bs, L, k]``, ``top_token_ids i64 [bs, L, k]`` (rows sorted
        descending, k >= the largest budget), ``budgets`` (int32 or int64 [bs] tensor, each
        <= q - 1, or one int), ``bonus_tokens i64 [bs]`` (last round's bonus: each tree's
        root), ``prefix_lens`` (int32 or int64 [bs]). Returns views of the first bs rows of
        the layout. Two launches (the build and the layout), three with int64 budgets."""
        lp = ops._tensor("top_log_probs", top_log_probs, torch.float32, (None, None, None), self.device)
        bs = lp.shape[0]
        if not 1 <= bs <= self.max_bs:
            raise InputError(f"top_log_probs: expected 1..{self.max_bs} requests (max_bs), got {bs}")
        b = self._budget_tensor(budgets, bs)
        bonus = ops._tensor("bonus_tokens", bonus_tokens, torch.int64, (bs,), self.device)
        prefix = _lens("prefix_lens", prefix_lens, bs, self.device)
        trees, out = self._views(bs)
        ops.tree_build(lp, top_token_ids, b, root_tokens=bonus, d_max=self.q, out=trees)
        ops._launch("RoundBuilder.build", self.device, "kd_sglang_round_layout", *(t.data_ptr() for t in (
            trees.node_counts, trees.tokens, trees.depths, trees.next_token, trees.next_sibling, trees.visibility,
            bonus, prefix)), int(prefix.dtype is torch.int64), bs, self.q, *(t.data_ptr() for t in out))
        return out


def _lens(name, t, n, dev):
    """An int32 or int64 ``[n]`` tensor on dev, contiguous (a strided view is copied)."""
    if not isinstance(t, torch.Tensor) or t.shape != (n,) or t.dtype not in (torch.int32, torch.int64) \
            or t.device != dev:
        got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise InputError(f"{name}: expected an int32 or int64 [{n}] tensor on {dev}, got {got}")
    return t if t.is_contiguous() else t.contiguous()


def mask_size(bs: int, q: int, max_prefix_len: int) -> int:
    """Bytes a custom-mask buffer needs for bs requests of prefixes up to max_prefix_len."""
    return bs * q * (max_prefix_len + q)


def custom_mask(visibility, prefix_lens, out=None, mask_indptr=None):
    """Step 4 on the GPU: ``(mask, mask_indptr)``, the mask as bytes (bool, or uint8 for the
    Triton backend's graph path: pass such an ``out``) concatenated over requests, and
    ``mask_indptr i64 [bs + 1]``. ``visibility bool [bs, q, q]`` (the layout's),
    ``prefix_lens`` int32 or int64 [bs]. ``out`` (bool or uint8, 1-D) must hold
    ``mask_size(bs, q, max prefix)`` bytes; the blocks are packed at the front. One launch
    (it writes mask_indptr too). Without ``out`` the size is read from the device (a sync)."""
    vis = ops._tensor("visibility", visibility, torch.bool, (None, None, None))
    bs, q, q2 = vis.shape
    if q2 != q:
        raise InputError(f"visibility: expected [bs, q, q], got {tuple(vis.shape)}")
    dev = vis.device
    prefix = _lens("prefix_lens", prefix_lens, bs, dev)
    if mask_indptr is None:
        mask_indptr = torch.empty(bs + 1, dtype=torch.int64, device=dev)
    ops._tensor("mask_indptr", mask_indptr, torch.int64, (bs + 1,), dev)
    if out is None:   # the size read from the device: a sync, as documented
        out = torch.empty(q * int((prefix.long().clamp(min=0) + q).sum()), dtype=torch.bool, device=dev)
    if not isinstance(out, torch.Tensor) or out.dtype not in (torch.bool, torch.uint8) or out.dim() != 1 \
            or out.device != dev or not out.is_contiguous():
        raise InputError(f"out: expected a contiguous 1-D bool or uint8 tensor on {dev}")
    if bs == 0:
        mask_indptr.zero_()
        return out, mask_indptr
    ops._launch("custom_mask", dev, "kd_sglang_custom_mask", vis.data_ptr(), prefix.data_ptr(),
                int(prefix.dtype is torch.int64), bs, q, out.numel(), out.data_ptr(), mask_indptr.data_ptr())
    return out, mask_indptr


def accept(tree_tokens, retrieve_next_token, retrieve_next_sibling, target, out: AcceptOutput | None = None):
    """Step 6 on the GPU from the target's argmax ``target i64 [bs, q]`` and the retrieve
    links (both i32, as the layout's, or both i64 [bs, q]): an AcceptOutput, into ``out``
    when given. Two launches (the walk, the outputs); no host sync."""
    toks = ops._tensor("tree_tokens", tree_tokens, torch.int64, (None, None))
    bs, q = toks.shape
    dev = toks.device
    links = []
    for name, t in (("retrieve_next_token", retrieve_next_token), ("retrieve_next_sibling", retrieve_next_sibling)):
        if not isinstance(t, torch.Tensor) or t.shape != (bs, q) or t.dtype not in (torch.int32, torch.int64):
            raise InputError(f"{name}: expected an int32 or int64 [{bs}, {q}] tensor")
        links.append(t.contiguous())
    if links[0].dtype != links[1].dtype:
        links = [t.long() for t in links]
    r = ops.tree_accept(toks, target, q - 1, next_token=links[0], next_sibling=links[1])
    if out is None:
        out = AcceptOutput(torch.empty(bs, q, dtype=torch.int64, device=dev),
                           torch.empty(bs, dtype=torch.int32, device=dev),
                           torch.empty(bs, q, dtype=torch.int64, device=dev))
    else:
        if not isinstance(out, tuple) or len(out) != 3:
            raise InputError("out: expected an AcceptOutput (accept_index, commit_lens, next_token_ids)")
        ops._tensor("out.accept_index", out[0], torch.int64, (bs, q), dev)
        ops._tensor("out.commit_lens", out[1], torch.int32, (bs,), dev)
        ops._tensor("out.next_token_ids", out[2], torch.int64, (bs, q), dev)
        out = AcceptOutput(*out)
    ops._launch("accept", dev, "kd_sglang_accept_outputs",
                *(t.data_ptr() for t in (r.accept_index, r.accept_len, r.bonus, toks)), bs, q,
                *(t.data_ptr() for t in out))
    return out
