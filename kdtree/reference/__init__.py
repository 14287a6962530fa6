"""Plain CPU references the ops are checked against (spec ddtree.md, verify_attention.md).

The three batched references take the ops' arguments: ``tree_build`` (the heapq build,
numpy outputs in a TreeBatch), ``tree_verify`` (float64 attention in torch, any device)
and ``tree_accept`` (the greedy walk). ``build_tree`` and ``greedy_accept`` are the
one-request forms; ``stage_a`` turns drafter logits into the build's inputs.
"""
from __future__ import annotations

from ..checks import InputError
from .attention import softmax_scale
from .attention import verify_attention_ref as tree_verify
from .tree import (MAX_BUDGET, Tree, TreeBatch, build_tree, greedy_accept, greedy_accept_batch,
                   greedy_accept_parents_batch, pack_visibility, stage_a)
from .tree import build_trees as tree_build


def tree_accept(tokens, target, max_depth: int, *, parents=None, node_counts=None, next_token=None,
                next_sibling=None):
    """The ops' tree_accept on the CPU: ``(accept_index, accept_len, bonus)`` as numpy
    arrays, from the tree as parents= and node_counts= or as next_token= and next_sibling=."""
    if parents is not None and node_counts is not None and next_token is None and next_sibling is None:
        return greedy_accept_parents_batch(tokens, parents, node_counts, target, max_depth)
    if next_token is not None and next_sibling is not None and parents is None and node_counts is None:
        return greedy_accept_batch(tokens, next_token, next_sibling, target, max_depth)
    raise InputError("tree_accept: expected the tree as parents= and node_counts=, or as next_token= "
                     "and next_sibling=, not both and not neither")


__all__ = ["MAX_BUDGET", "Tree", "TreeBatch", "build_tree", "greedy_accept", "pack_visibility",
           "softmax_scale", "stage_a", "tree_accept", "tree_build", "tree_verify"]
