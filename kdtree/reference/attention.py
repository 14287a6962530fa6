"""Reference tree-verify attention in MLA absorbed form (shared/spec/verify_attention.md).

One latent KV head shared by all query heads: a cache row is ``[c (512) | k_pe (64)]``;
keys are the whole 576-wide row, values its first 512 columns. Query slot ``i`` of
request ``b`` attends to all ``P_b = seq_len_b - D`` prefix positions and to tree
slot ``j`` iff ``visibility[b, i, j]``. Written plainly, in float64 by default, as
the yardstick for the CUDA kernel.
"""
from __future__ import annotations

import math

import torch

from ..checks import InputError

LATENT_DIM = 512
ROPE_DIM = 64
QK_DIM = LATENT_DIM + ROPE_DIM  # 576


def softmax_scale(yarn_factor: float | None = None, qk_head_dim: int = 192) -> float:
    """``qk_head_dim**-0.5 * (0.1*ln(factor) + 1)**2``; K2-Instruct (factor 32): 0.130861."""
    scale = qk_head_dim ** -0.5
    if yarn_factor and yarn_factor > 1:
        scale *= (0.1 * math.log(yarn_factor) + 1.0) ** 2
    return scale


def check_verify_args(q, kv_cache, block_table, seq_lens, visibility):
    """Shape/dtype checks shared by the reference and the kernel bindings; returns (B, D, H)."""
    if q.dim() != 4 or q.shape[-1] != QK_DIM:
        raise InputError(f"q: expected [B, D, H, {QK_DIM}], got {tuple(q.shape)}")
    B, D, H, _ = q.shape
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != QK_DIM:
        raise InputError(f"kv_cache: expected [num_pages, page_size, {QK_DIM}], got {tuple(kv_cache.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != B:
        raise InputError(f"block_table: expected [{B}, max_pages], got {tuple(block_table.shape)}")
    if block_table.dtype != torch.int32:
        raise InputError(f"block_table: expected int32, got {block_table.dtype}")
    if seq_lens.shape != (B,) or seq_lens.dtype != torch.int32:
        raise InputError(f"seq_lens: expected int32 [{B}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if visibility.shape != (B, D, D) or visibility.dtype != torch.bool:
        raise InputError(f"visibility: expected bool [{B}, {D}, {D}], got {visibility.dtype} "
                         f"{tuple(visibility.shape)}")
    page = kv_cache.shape[1]
    cap = block_table.shape[1] * page
    for b, s in enumerate(seq_lens.tolist()):
        if s < D or s > cap:
            raise InputError(f"seq_lens[{b}]: expected D={D} <= seq_len <= max_pages*page_size={cap}, got {s}")
    return B, D, H


def gather_kv(kv_cache, block_table_row, seq_len: int):
    """The first ``seq_len`` cache rows of one request, in order, through its block table."""
    page = kv_cache.shape[1]
    pos = torch.arange(seq_len, device=kv_cache.device)
    pages = block_table_row.long()[pos // page]
    return kv_cache[pages, pos % page]


def verify_attention_ref(q, kv_cache, block_table, seq_lens, visibility, scale: float,
                         dtype=torch.float64):
    """Returns ``(out [B, D, H, 512], lse [B, D, H])`` in ``dtype``; lse is the natural log."""
    B, D, H = check_verify_args(q, kv_cache, block_table, seq_lens, visibility)
    out = torch.empty(B, D, H, LATENT_DIM, dtype=dtype, device=q.device)
    lse = torch.empty(B, D, H, dtype=dtype, device=q.device)
    for b in range(B):
        s = int(seq_lens[b])
        P = s - D
        kv = gather_kv(kv_cache, block_table[b], s).to(dtype)          # [S, 576]
        scores = torch.einsum("dhc,sc->dhs", q[b].to(dtype), kv) * scale  # [D, H, S]
        mask = torch.ones(D, s, dtype=torch.bool, device=q.device)
        mask[:, P:] = visibility[b]
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        lse_b = torch.logsumexp(scores, dim=-1)                          # [D, H]
        p = torch.exp(scores - lse_b[..., None])
        out[b] = torch.einsum("dhs,sc->dhc", p, kv[:, :LATENT_DIM])
        lse[b] = lse_b
    return out, lse


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Combine two attentions over disjoint key sets by their LSEs (split-KV merge)."""
    lse = torch.logaddexp(lse_a, lse_b)
    wa = torch.exp(lse_a - lse)[..., None]
    wb = torch.exp(lse_b - lse)[..., None]
    return out_a * wa + out_b * wb, lse


def attention_flops(B: int, D: int, H: int, P: int) -> int:
    """Spec's FLOP count: 2*B*D*H*(P+D)*(576+512)."""
    return 2 * B * D * H * (P + D) * (QK_DIM + LATENT_DIM)


def attention_bytes(B: int, D: int, H: int, P: int) -> int:
    """Minimum bytes: cache rows read once, q read, out (bf16) and lse (f32) written."""
    return B * (P + D) * QK_DIM * 2 + B * D * H * (QK_DIM * 2 + LATENT_DIM * 2 + 4)
