"""A drop-in for the CPU parts of SGLang's DDTree decode round (spec sglang.md), on the GPU.

- ``build_ddtree_tree_from_topk`` (builder.py): the worker's builder, same signature and
  7-tuple, byte for byte (a CUDA input is built by the GPU kernel).
- ``RoundBuilder`` (round.py): the batched round (bs >= 1, per-request budgets, bonus tokens
  and prefix lengths) written into static buffers in the worker's padded verify layout; with
  ``custom_mask`` and ``accept`` it runs with no host synchronisation, so the round can be
  captured in one CUDA graph (the CPU path keeps the worker at batch 1, graphs off).
- ``custom_mask``: step 4's mask for users who keep SGLang's own attention backend.
- ``accept``: step 6 from the target's argmax and the retrieve links.
- ``VerifyAttention`` (attention.py): tree-verify attention on SGLang's KV metadata: the
  token pool ``[slots, 1, 576]``, ``req_to_token`` read in place through
  ``req_pool_indices``, q and out in ``[bs * q, H, ...]``; ``prepare`` once a forward,
  ``run`` for each layer.
- ``patch()``: switch a running worker module over (``KDTREE_SGLANG=1`` does it on import),
  undoable; ``check_patch()`` says what it would replace; see kdtree.sglang.patch.
- ``patch_attention()`` (backend.py): SGLang's Triton attention backend verifies MLA trees on
  kdtree's kernel (``KDTREE_SGLANG_ATTENTION=1`` does it on import), undoable;
  ``check_attention_patch()`` says what it would replace.

Lengths, budgets and indices are taken as int32 or int64 and read in that dtype (a
conversion would be one more launch in the captured round).
"""
from __future__ import annotations

from . import reference
from .attention import VerifyAttention
from .backend import AttentionPatch, check_attention_patch, patch_attention, patch_attention_from_env, unpatch_attention
from .builder import build_ddtree_tree_from_topk
from .patch import Patch, PatchError, check_patch, patch, patch_from_env, unpatch
from .round import AcceptOutput, RoundBuilder, VerifyLayout, accept, custom_mask, mask_size

__all__ = ["AttentionPatch", "Patch", "PatchError", "RoundBuilder", "VerifyAttention", "VerifyLayout",
           "AcceptOutput", "accept", "build_ddtree_tree_from_topk", "check_attention_patch", "check_patch",
           "custom_mask", "mask_size", "patch", "patch_attention", "reference", "unpatch", "unpatch_attention"]

patch_from_env()
patch_attention_from_env()
