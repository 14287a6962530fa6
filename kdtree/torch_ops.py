"""The three ops as torch ops (``torch.ops.kdtree.*``), with fake implementations, so that
torch.compile traces through them and CUDA-graph capture inside a serving engine sees
them as single ops.

Functional forms: each op returns new tensors (torch.compile's cudagraph trees give them
static memory). ``tree_build`` needs ``d_max`` (no data-dependent shapes); the eager API in
``kdtree.ops`` stays the fast path for callers that manage static buffers themselves
(``out=``): a registered op adds torch's dispatch to every call.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import ops
from .reference.attention import LATENT_DIM

Tensor = torch.Tensor


@torch.library.custom_op("kdtree::tree_build", mutates_args=(), device_types="cuda")
def tree_build(top_logprobs: Tensor, top_ids: Tensor, budgets: Tensor, seq_lens: Optional[Tensor],
               root_tokens: Optional[Tensor], d_max: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                  Tensor, Tensor, Tensor]:
    """``(node_counts, tokens, depths, parents, positions, next_token, next_sibling,
    visibility_bits, status)``: kdtree.tree_build's fields, bit-packed visibility only."""
    r = ops.tree_build(top_logprobs, top_ids, budgets, seq_lens=seq_lens, root_tokens=root_tokens, d_max=d_max)
    return (r.node_counts, r.tokens, r.depths, r.parents, r.positions, r.next_token, r.next_sibling,
            r.visibility_bits, r.status)


@tree_build.register_fake
def _(top_logprobs, top_ids, budgets, seq_lens, root_tokens, d_max):
    r = ops.TreeBuildResult.empty(top_logprobs.shape[0], d_max, top_logprobs.device)
    return (r.node_counts, r.tokens, r.depths, r.parents, r.positions, r.next_token, r.next_sibling,
            r.visibility_bits, r.status)


@torch.library.custom_op("kdtree::tree_verify", mutates_args=(), device_types="cuda")
def tree_verify(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, visibility: Tensor,
                scale: float, num_splits: int = 0) -> tuple[Tensor, Tensor]:
    """``(out bf16 [B, D, H, 512], lse f32 [B, D, H])``; num_splits 0: the plan's choice."""
    r = ops.tree_verify(q, kv_cache, block_table, seq_lens, visibility, float(scale),
                        num_splits=num_splits or None)
    return r.out, r.lse


@tree_verify.register_fake
def _(q, kv_cache, block_table, seq_lens, visibility, scale, num_splits=0):
    B, D, H, _ = q.shape
    return q.new_empty(B, D, H, LATENT_DIM), q.new_empty(B, D, H, dtype=torch.float32)


@torch.library.custom_op("kdtree::tree_accept", mutates_args=(), device_types="cuda")
def tree_accept(tokens: Tensor, target: Tensor, max_depth: int, parents: Optional[Tensor] = None,
                node_counts: Optional[Tensor] = None, next_token: Optional[Tensor] = None,
                next_sibling: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(accept_index, accept_len, bonus)``: kdtree.tree_accept, either tree form."""
    r = ops.tree_accept(tokens, target, max_depth, parents=parents, node_counts=node_counts,
                        next_token=next_token, next_sibling=next_sibling)
    return r.accept_index, r.accept_len, r.bonus


@tree_accept.register_fake
def _(tokens, target, max_depth, parents=None, node_counts=None, next_token=None, next_sibling=None):
    return tuple(ops.TreeAcceptResult.empty(tokens.shape[0], max_depth, tokens.device))
