"""The three ops as torch ops (``torch.ops.kdtree.*``), with fake implementations, so that
torch.compile traces through them and CUDA-graph capture inside a serving engine sees
them as single ops.

Functional forms: each op returns new tensors (torch.compile's cudagraph trees give them
static memory). ``tree_build`` needs ``d_max`` (no data-dependent shapes); the eager API in
``kdtree.ops`` stays the fast path for callers that manage static buffers themselves
(``out=``): a registered op allocates its outputs on every call (tree_build's ten tensors are
most of its extra host time) and adds torch's dispatch.

Registered with ``torch.library.Library`` (a schema, a CUDA kernel, a fake), not
``torch.library.custom_op``: the latter wraps every eager call in Python layers (an autograd
kernel, an output-aliasing check): ~15 us a call more on the H200 host. The ops are
inference-only (no autograd formula). The CPU key takes the same kernel, so a CPU tensor gets
kdtree's InputError naming the argument, not the dispatcher's "no kernel for CPU".
"""
from __future__ import annotations

import torch

from . import ops
from .reference.attention import LATENT_DIM

_LIB = torch.library.Library("kdtree", "DEF")  # held for the process: the ops live as long as it
_LIB.define("tree_build(Tensor top_logprobs, Tensor top_ids, Tensor budgets, Tensor? seq_lens, "
            "Tensor? root_tokens, SymInt d_max) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
            "Tensor, Tensor)")
_LIB.define("tree_verify(Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, Tensor visibility, "
            "float scale, SymInt num_splits=0) -> (Tensor, Tensor)")
_LIB.define("tree_accept(Tensor tokens, Tensor target, SymInt max_depth, Tensor? parents=None, "
            "Tensor? node_counts=None, Tensor? next_token=None, Tensor? next_sibling=None) -> (Tensor, Tensor, Tensor)")


def _build_fields(r: ops.TreeBuildResult) -> tuple:
    return (r.node_counts, r.tokens, r.depths, r.parents, r.positions, r.next_token, r.next_sibling,
            r.visibility_bits, r.status)


def _tree_build(top_logprobs, top_ids, budgets, seq_lens, root_tokens, d_max):
    """``(node_counts, tokens, depths, parents, positions, next_token, next_sibling,
    visibility_bits, status)``: kdtree.tree_build's fields, bit-packed visibility only."""
    return _build_fields(ops.tree_build(top_logprobs, top_ids, budgets, seq_lens=seq_lens, root_tokens=root_tokens,
                                        d_max=d_max))


def _tree_build_fake(top_logprobs, top_ids, budgets, seq_lens, root_tokens, d_max):
    return _build_fields(ops.TreeBuildResult.empty(top_logprobs.shape[0], d_max, top_logprobs.device))


def _tree_verify(q, kv_cache, block_table, seq_lens, visibility, scale, num_splits=0):
    """``(out bf16 [B, D, H, 512], lse f32 [B, D, H])``; num_splits 0: the plan's choice."""
    r = ops.tree_verify(q, kv_cache, block_table, seq_lens, visibility, float(scale), num_splits=num_splits or None)
    return r.out, r.lse


def _tree_verify_fake(q, kv_cache, block_table, seq_lens, visibility, scale, num_splits=0):
    B, D, H, _ = q.shape
    return q.new_empty(B, D, H, LATENT_DIM), q.new_empty(B, D, H, dtype=torch.float32)


def _tree_accept(tokens, target, max_depth, parents=None, node_counts=None, next_token=None, next_sibling=None):
    """``(accept_index, accept_len, bonus)``: kdtree.tree_accept, either tree form."""
    r = ops.tree_accept(tokens, target, max_depth, parents=parents, node_counts=node_counts,
                        next_token=next_token, next_sibling=next_sibling)
    return r.accept_index, r.accept_len, r.bonus


def _tree_accept_fake(tokens, target, max_depth, parents=None, node_counts=None, next_token=None,
                      next_sibling=None):
    return tuple(ops.TreeAcceptResult.empty(tokens.shape[0], max_depth, tokens.device))


for _name, _impl, _fake in (("tree_build", _tree_build, _tree_build_fake),
                            ("tree_verify", _tree_verify, _tree_verify_fake),
                            ("tree_accept", _tree_accept, _tree_accept_fake)):
    _LIB.impl(_name, _impl, "CUDA")
    _LIB.impl(_name, _impl, "CPU")
    torch.library.register_fake(f"kdtree::{_name}", _fake, lib=_LIB)

tree_build = torch.ops.kdtree.tree_build
tree_verify = torch.ops.kdtree.tree_verify
tree_accept = torch.ops.kdtree.tree_accept
