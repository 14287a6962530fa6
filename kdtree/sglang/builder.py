"""The worker's ``build_ddtree_tree_from_topk`` (spec sglang.md, step 2) with the GPU
build behind it: what ``patch()`` puts in the worker's place."""
from __future__ import annotations

import sys
import threading

import torch

from .. import ops
from ..checks import InputError
from ..reference.tree import MAX_BUDGET
from . import reference


def build_ddtree_tree_from_topk(top_log_probs, top_token_ids, budget: int, workspace=None):
    """The worker's ``build_ddtree_tree_from_topk``: the same arguments and the same 7-tuple
    (CPU tensors and Python lists, as the worker's callers expect). CPU inputs take the
    heapq build; CUDA inputs are built by the GPU kernel into one buffer kept per (device,
    budget), copied back to pinned memory in one copy, then one sync. ``workspace`` (the
    DFlash + DDTree fork's CPU buffers) is taken and not used: the GPU build keeps its own.
    Where kdtree's library cannot load or launch here, the tree is built on the CPU as the
    worker's own builder would, and that is said once."""
    if not (isinstance(top_log_probs, torch.Tensor) and top_log_probs.is_cuda):
        return reference.build_ddtree_tree_from_topk(top_log_probs, top_token_ids, budget)
    try:
        return _build_on_gpu(top_log_probs, top_token_ids, budget)
    except ValueError:   # InputError: the caller's inputs, said as they are
        raise
    except RuntimeError as e:   # no library here, or none for this GPU: never the server's end
        _say_cpu_fallback(e)
        return reference.build_ddtree_tree_from_topk(top_log_probs, top_token_ids, budget)


_said_fallback = False


def _say_cpu_fallback(e) -> None:
    global _said_fallback
    if not _said_fallback:
        _said_fallback = True
        print(f"kdtree.sglang: tree builds run on the CPU, as SGLang's own: kdtree could not run: {e}",
              file=sys.stderr)


def _build_on_gpu(top_log_probs, top_token_ids, budget):
    if isinstance(budget, bool) or not isinstance(budget, int) or budget > MAX_BUDGET:
        raise InputError(f"budget: expected an integer <= {MAX_BUDGET}, got {budget!r}")
    if top_log_probs.dim() != 2 or not isinstance(top_token_ids, torch.Tensor) or \
            top_token_ids.shape != top_log_probs.shape:
        raise InputError("top_log_probs, top_token_ids: expected two [L, k] tensors of one shape")
    L = top_log_probs.shape[0]
    if budget <= 0 or L == 0:
        return reference._root_only()
    dev = top_log_probs.device
    buf = _builder_buffers(dev, budget)
    lp = top_log_probs.to(torch.float32).contiguous()[None]
    ids = top_token_ids.to(device=dev, dtype=torch.int64).contiguous()[None]
    ops.tree_build(lp, ids, buf.budget, d_max=budget + 1, dense_visibility=True, out=buf.trees)
    buf.host_flat.copy_(buf.flat, non_blocking=True)   # the whole tree in one copy
    torch.cuda.current_stream(dev).synchronize()   # the worker's callers want host objects
    h = buf.host
    if int(h.status[0]) & ops.STATUS_NAN_INPUT:
        raise InputError("top_log_probs: NaN or +inf; log-probs must be finite or -inf")
    n = int(h.node_counts[0])
    # Copies (clone), never views of the buffers: the next call rewrites them.
    tokens = h.tokens[0, 1:n + 1].clone()
    parents = h.parents[0, :n + 1].tolist()
    child_maps = [dict() for _ in range(n + 1)]
    for i, t in enumerate(tokens.tolist(), start=1):
        child_maps[parents[i]][t] = i
    return (tokens, h.depths[0, 1:n + 1].clone(), parents, child_maps, h.visibility[0, :n + 1, :n + 1].clone(),
            h.next_token[0, :n + 1].clone(), h.next_sibling[0, :n + 1].clone())


def _one_tree_buffer(D, device, pin_memory=False):
    """``(flat, trees)``: a TreeBuildResult for one request of D slots (with the dense
    visibility) whose fields are views of one byte buffer, so that one copy moves the whole
    tree. The fields' shapes and dtypes are TreeBuildResult.empty's; the widest dtype goes
    first, so every view starts aligned."""
    like = ops.TreeBuildResult.empty(1, D, "meta", dense_visibility=True)
    fields = sorted(((n, getattr(like, n)) for n in ops._OUT_FIELDS), key=lambda f: -f[1].element_size())
    flat = torch.empty(sum(m.nbytes for _, m in fields), dtype=torch.uint8, device=device, pin_memory=pin_memory)
    views, at = {}, 0
    for name, m in fields:
        views[name] = flat[at:at + m.nbytes].view(m.dtype).view(m.shape)
        at += m.nbytes
    return flat, ops.TreeBuildResult(**views)


class _BuilderBuffers:
    """One request's build at one budget on one device: the GPU outputs in one buffer, the
    budget, and the buffer's pinned host twin."""

    def __init__(self, dev, budget):
        self.flat, self.trees = _one_tree_buffer(budget + 1, dev)
        self.host_flat, self.host = _one_tree_buffer(budget + 1, "cpu", pin_memory=True)
        self.budget = torch.full((1,), budget, dtype=torch.int32, device=dev)


_BUILDERS = threading.local()   # a thread's buffers: a worker thread never waits on another's


def _builder_buffers(dev, budget) -> _BuilderBuffers:
    cache = getattr(_BUILDERS, "cache", None)
    if cache is None:
        cache = _BUILDERS.cache = {}
    key = (dev.index, budget)
    if key not in cache:
        cache[key] = _BuilderBuffers(dev, budget)
    return cache[key]
