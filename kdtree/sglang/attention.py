"""Tree-verify attention on SGLang's KV metadata (spec sglang.md, section 2)."""
from __future__ import annotations

import torch

from .. import ops
from ..checks import InputError
from .round import _lens


class VerifyAttention:
    """Tree-verify attention planned on SGLang's KV metadata for ``bs`` requests of ``q``
    slots and ``num_heads`` heads whose sequences (prefix + q) stay within ``max_seq_len``.
    The pool is token-indexed (``kv_buffer [slots, 1, 576]``: page size 1, SGLang's DDTree
    default; a page-64 pool is read the same way, through its token slots). A forward calls
    ``prepare`` once (the requests' rows and lengths) and ``run`` for each layer."""

    def __init__(self, bs: int, q: int, num_heads: int, max_seq_len: int, device="cuda", kernel: str = "auto"):
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < q:
            raise InputError(f"max_seq_len: expected an integer >= q = {q}, got {max_seq_len!r}")
        # max_seq_len bounds the requests (SGLang passes its context length), so each request
        # takes the split count of its own length: one count for the context would give short
        # requests splits of a few keys each.
        self.plan = ops.TreeVerifyPlan(bs, q, num_heads, 1, max_seq_len, device=device, kernel=kernel,
                                       per_request_splits=True)
        self.bs, self.q, self.num_heads, self.max_seq_len = bs, q, num_heads, max_seq_len
        self._seq = torch.empty(bs, dtype=torch.int32, device=self.plan.device)
        self._rows_copy = torch.empty(bs, dtype=torch.int32, device=self.plan.device)
        self._rows = None   # prepare's: req_pool_indices as int32

    def prepare(self, req_pool_indices, prefix_lens) -> None:
        """The forward's metadata, for every layer's ``run``: ``req_pool_indices`` and
        ``prefix_lens`` int32 or int64 [bs] (the q verify slots' KV is at columns prefix ..
        prefix + q - 1 of req_to_token's row). One launch, two with int64 indices; no sync."""
        dev = self.plan.device
        rows = _lens("req_pool_indices", req_pool_indices, self.bs, dev)
        prefix = _lens("prefix_lens", prefix_lens, self.bs, dev)
        torch.add(prefix, self.q, out=self._seq)
        self._rows = rows if rows.dtype is torch.int32 else self._rows_copy.copy_(rows)

    def run(self, q, kv_buffer, req_to_token, req_pool_indices, prefix_lens, visibility, scale: float, out=None):
        """``q bf16 [bs * q, H, 576]``, ``kv_buffer bf16 [slots, 1, 576]`` (or ``[slots, 576]``),
        ``req_to_token i32 [max_reqs, max_context]`` (max_context >= max_seq_len),
        ``req_pool_indices`` and ``prefix_lens`` as ``prepare`` takes them, or both None for
        the last ``prepare``'s (a layer after the first: no launch of its own), ``visibility``
        the layout's bool ``[bs, q, q]`` or the build's bits. Returns ``(out bf16 [bs * q, H,
        512], lse f32 [bs * q, H])``."""
        if req_pool_indices is not None or prefix_lens is not None:
            self.prepare(req_pool_indices, prefix_lens)
        elif self._rows is None:
            raise InputError("req_pool_indices, prefix_lens: None before any prepare(); call prepare() once a "
                             "forward, or pass them")
        if isinstance(kv_buffer, torch.Tensor) and kv_buffer.dim() == 2:
            kv_buffer = kv_buffer[:, None]
        if not isinstance(req_to_token, torch.Tensor) or req_to_token.dim() != 2 or \
                req_to_token.shape[1] < self.max_seq_len:
            raise InputError(f"req_to_token: expected an int32 [max_reqs, >= {self.max_seq_len}] tensor")
        return self.plan.run(q, kv_buffer, req_to_token, self._seq, visibility, scale, req_rows=self._rows, out=out)
