"""SGLang's own pieces as sweep peers, where SGLang imports: the DDTree worker's CPU tree
builder and the Triton kernel its attention backend runs to verify an MLA tree
(``extend_attention_fwd`` with the custom mask). Where a piece does not import, or is not
what the spec (../shared/spec/sglang.md) describes, the sweeps record a not_available row
that says why; nothing here installs or imitates SGLang.
"""
from __future__ import annotations

import functools
import importlib
import inspect

from ..sglang.patch import FUNCTIONS as WORKER_FUNCTIONS
from ..sglang.patch import MODULES as WORKER_MODULES
from ..sglang.startup_hook import hook_aside

BUILDER = "build_ddtree_tree_from_topk"
# Where extend_attention_fwd lives: SGLang 0.5.23's kernel namespace, then older releases'.
TRITON_MODULES = ("sglang.kernels.ops.attention.extend_attention",
                  "sglang.srt.layers.attention.triton_ops.extend_attention")
TRITON_FUNCTION = "extend_attention_fwd"
# Its leading parameters, which kdtree passes by name (checked before a call).
TRITON_PARAMS = ("q_extend", "k_extend", "v_extend", "o_extend", "k_buffer", "v_buffer", "qo_indptr",
                 "kv_indptr", "kv_indices", "custom_mask", "is_causal", "mask_indptr", "max_len_extend")
TRITON_PAGE = 1   # SGLang's token pool: one slot a token (its DDTree default)


def _find(modules, name: str, params: tuple):
    """(function, None) for the first of `modules` that imports and defines `name` whose
    parameters begin with `params`; else (None, why)."""
    tried = []
    for mod_name in modules:
        try:
            with hook_aside():
                mod = importlib.import_module(mod_name)
        except Exception as e:  # not installed, or a dependency missing: the reason is the row's
            tried.append(f"{mod_name}: {type(e).__name__}: {e}")
            continue
        fn = getattr(mod, name, None)
        if not callable(fn):
            tried.append(f"{mod_name}: no {name}")
            continue
        if getattr(fn, "__module__", None) == "kdtree.sglang.builder":   # the drop-in, patched in
            tried.append(f"{mod_name}.{name}: kdtree's drop-in, not SGLang's (patched: KDTREE_SGLANG=1 or patch())")
            continue
        try:
            got = tuple(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            tried.append(f"{mod_name}.{name}: signature unreadable")
            continue
        if got[:len(params)] != params:
            tried.append(f"{mod_name}.{name}{got[:len(params)]}: expected parameters {params}")
            continue
        return fn, None
    return None, "; ".join(tried)[:400]


@functools.cache
def sglang_version() -> str | None:
    try:
        return importlib.import_module("sglang.version").__version__
    except Exception:  # not importable: the peers' rows say why
        return None


# Looked up once a process: a sweep asks at every point, and an import that fails part-way
# through SGLang's package would be tried again each time.
@functools.cache
def builder():
    """SGLang's DDTree worker builder (spec step 2), or (None, why)."""
    return _find(WORKER_MODULES, BUILDER, WORKER_FUNCTIONS[BUILDER][0])   # its required parameters


@functools.cache
def triton_verify():
    """SGLang's Triton extend-attention kernel, or (None, why)."""
    return _find(TRITON_MODULES, TRITON_FUNCTION, TRITON_PARAMS)


def same_tree(got, want) -> bool:
    """Whether two builder results (spec step 2's 7-tuple) hold the same tree: node tokens,
    depths and parents."""
    import numpy as np

    return (np.array_equal(np.asarray(got[0]), np.asarray(want[0]))
            and np.array_equal(np.asarray(got[1]), np.asarray(want[1])) and list(got[2]) == list(want[2]))


def triton_inputs(q, cache, table, seq, vis):
    """kdtree's verify inputs in the layout SGLang's Triton backend hands extend_attention_fwd
    for a target-verify batch (page size 1; spec sglang.md section 2 and step 4): the D tree
    slots are the extend tokens, their K taken from the pool as the worker wrote them; the P
    prefix slots come through kv_indptr / kv_indices; the custom mask holds a [D, P + D] block
    a request (prefix columns true), uint8, as its graph path reads it. Returns a dict of
    extend_attention_fwd's leading arguments by name but the pool's (o_extend allocated
    here), and the tree slots' pool rows, for pool_args."""
    import torch

    B, D, H, C = q.shape
    if cache.shape[1] != TRITON_PAGE:
        raise ValueError(f"cache: SGLang's Triton verify is timed at page size {TRITON_PAGE}, got {cache.shape[1]}")
    S = int(seq[0])
    if not bool((seq == S).all()):
        raise ValueError("seq: expected one length for every request")
    P, dev = S - D, q.device
    slots = table[:, :S].long()
    mask = torch.ones(B, D, S, dtype=torch.uint8, device=dev)
    mask[:, :, P:] = vis.to(torch.uint8)
    args = dict(q_extend=q.reshape(B * D, H, C),
                o_extend=torch.empty(B * D, H, 512, dtype=q.dtype, device=dev),
                qo_indptr=torch.arange(0, (B + 1) * D, D, dtype=torch.int32, device=dev),
                kv_indptr=torch.arange(B + 1, dtype=torch.int32, device=dev) * P,
                kv_indices=slots[:, :P].reshape(-1).contiguous(),
                custom_mask=mask.reshape(-1), is_causal=True,
                mask_indptr=torch.arange(B + 1, dtype=torch.int64, device=dev) * (D * S),
                max_len_extend=D)
    return args, slots[:, P:]


def pool_args(cache, tree_slots) -> dict:
    """The pool's K / V views of `cache` ([slots, 1, 576] and its first 512 columns) and the
    tree slots' K / V (the extend tokens), gathered from it."""
    k_buffer = cache.view(-1, 1, cache.shape[-1])
    k_extend = k_buffer[tree_slots.reshape(-1)].contiguous()
    return dict(k_buffer=k_buffer, v_buffer=k_buffer[..., :512], k_extend=k_extend, v_extend=k_extend[..., :512])


def triton_call(fn, q, caches, table, seq, vis, scale: float):
    """A call of SGLang's kernel on these inputs reading the cache copies in turn (its
    arguments made once, outside any timing), and its output ``[B, D, H, 512]``, which each
    call writes."""
    import itertools

    args, tree_slots = triton_inputs(q, caches[0], table, seq, vis)
    pools = itertools.cycle([pool_args(c, tree_slots) for c in caches]).__next__
    params = inspect.signature(fn).parameters
    extra = {"sm_scale": scale}
    if "page_size" in params:
        extra["page_size"] = TRITON_PAGE
    if "k_scale" in params:   # 0.5.x: the fp8 scales, 1 for bf16
        extra.update(k_scale=1.0, v_scale=1.0)

    def call():
        fn(**{**args, **pools(), **extra})
    return call, args["o_extend"].view(*q.shape[:3], 512)
