"""SGLang's Triton attention backend verifying an MLA tree on kdtree's kernel.

A DDTree worker's target-verify forward runs, in every one of the model's attention layers,
``TritonAttnBackend.forward_extend`` with the round's custom mask (spec sglang.md, step 5):
SGLang's Triton extend kernel, 1.6-6.1 ms a layer at batch 1 on an H200 where kdtree's
tree-verify kernel takes 17-74 us (docs/results.md). ``patch_attention()`` replaces that
method on the class; the replacement takes a call only where it computes what the Triton
kernel computes:
- the forward is a target verify with a custom mask, the backend is MLA's (latent 512 +
  rope 64, bf16 q and pool), no scale on K or V, no logit cap, no sliding window, no sinks,
  no temperature, no deterministic mode, q of ``bs * num_draft_tokens`` rows;
- and then it writes the verify slots' KV as SGLang does and runs kdtree's kernel over the
  pool, ``req_to_token`` read in place (columns 0 .. prefix + q - 1: the prefix, then the
  verify slots, which the worker assigns there before the forward), and the tree part of
  the custom mask (its last q columns a row) as the visibility.
Any other call goes to SGLang's own method, and the first call of each kind says why on
stderr. The per-forward work (the requests' rows and lengths, the mask's tree part: a few
launches, no sync) runs at the first attention layer of each forward, so a forward captured
in a CUDA graph replays it with the graph's own metadata buffers; each layer is then the
attention kernel alone. The numbers are not SGLang's bit for bit (another kernel, the same
attention within bf16 rounding): hence its own opt-in, ``KDTREE_SGLANG_ATTENTION=1``.
"""
from __future__ import annotations

import collections
import importlib
import inspect
import os
import sys

import torch

from .attention import VerifyAttention
from .patch import PatchError
from .startup_hook import BACKEND_CLASS, BACKEND_MODULES, watching

QK_DIM, V_DIM = 576, 512
# forward_extend's leading parameters, as the Triton backend's method takes them.
PARAMS = ("self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache")


class AttentionPatch:
    """An applied patch of ``cls.forward_extend``: ``taken`` (layer calls kdtree ran),
    ``left`` (a Counter of the reasons calls went to SGLang's method), ``undo()``; a context
    manager."""

    def __init__(self, cls, original, verbose: bool):
        self.cls, self.original, self.verbose = cls, original, verbose
        self.taken = 0
        self.left = collections.Counter()

    def undo(self) -> None:
        if self.original is not None:
            self.cls.forward_extend = self.original
            self.original = None
        _ACTIVE.pop(self.cls, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()

    def __repr__(self):
        state = "undone" if self.original is None else f"{self.taken} layer calls taken"
        return f"AttentionPatch({self.cls.__module__}.{self.cls.__name__}.forward_extend: {state})"


_ACTIVE: dict = {}


def _resolve(target):
    """The backend class: ``target`` itself, a module holding it, a module name, or None for
    SGLang's own."""
    if isinstance(target, type):
        return target
    if target is None or isinstance(target, str):
        names = BACKEND_MODULES if target is None else (target,)
        for name in names:
            try:
                target = importlib.import_module(name)
                break
            except ImportError as e:
                why = f"{name} does not import: {type(e).__name__}: {e}"
        else:
            raise PatchError(f"no SGLang Triton attention backend found ({why}); pass the backend class")
    cls = getattr(target, BACKEND_CLASS, None)
    if not isinstance(cls, type):
        raise PatchError(f"{getattr(target, '__name__', target)!r}: no {BACKEND_CLASS} class in it")
    return cls


def check_attention_patch(target=None):
    """What ``patch_attention(target)`` would replace, without replacing it: ``(cls,
    forward_extend)``; raises PatchError where it would refuse."""
    cls = _resolve(target)
    name = f"{cls.__module__}.{cls.__name__}"
    fn = cls.__dict__.get("forward_extend")
    if fn is None or not callable(fn):
        raise PatchError(f"{name}.forward_extend: not found on the class; this backend is not one kdtree knows")
    if getattr(fn, "_kdtree_original", None) is not None:
        raise PatchError(f"{name}.forward_extend: already kdtree's (undo() that patch first)")
    try:
        got = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        raise PatchError(f"{name}.forward_extend: its signature cannot be read") from None
    if got[:len(PARAMS)] != PARAMS:
        raise PatchError(f"{name}.forward_extend{got}: expected parameters {PARAMS} first; this backend "
                         "speaks another format, so nothing was replaced")
    return cls, fn


def patch_attention(target=None, verbose: bool = True) -> AttentionPatch:
    """Replaces ``TritonAttnBackend.forward_extend`` (of ``target``: the class, its module or
    the module's name; SGLang's by default) with kdtree's tree verify where it applies;
    returns the AttentionPatch."""
    cls, original = check_attention_patch(target)
    p = AttentionPatch(cls, original, verbose)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, *args, **kwargs):
        why = _why_not(self, q, k, v, layer, forward_batch, args, kwargs)
        if why is None:
            try:
                out = _verify(self, q, k, v, layer, forward_batch, save_kv_cache)
            except ValueError as e:   # kdtree's InputError: the call is SGLang's after all
                why = f"kdtree refused the inputs: {e}"
            else:
                p.taken += 1
                return out
        if why != "not a target verify":
            if p.left[why] == 0 and p.verbose:
                print(f"kdtree.sglang: a tree-verify layer left to SGLang's Triton kernel: {why}", file=sys.stderr)
            p.left[why] += 1
        return original(self, q, k, v, layer, forward_batch, save_kv_cache, *args, **kwargs)

    forward_extend._kdtree_original = original
    forward_extend.__doc__ = original.__doc__
    cls.forward_extend = forward_extend
    _ACTIVE[cls] = p
    if verbose:
        print(f"kdtree.sglang: replaced {cls.__module__}.{cls.__name__}.forward_extend (MLA tree verify)",
              file=sys.stderr)
    return p


def unpatch_attention() -> bool:
    """Undoes every attention patch; whether one was undone."""
    patches = list(_ACTIVE.values())
    for p in patches:
        p.undo()
    return bool(patches)


def patch_attention_from_env():
    """Patches when KDTREE_SGLANG_ATTENTION=1; a refusal is printed, not raised."""
    flag = os.environ.get("KDTREE_SGLANG_ATTENTION", "")
    if flag in ("", "0"):
        return None
    if flag != "1":
        print(f"kdtree.sglang: KDTREE_SGLANG_ATTENTION={flag!r} ignored (expected 1 or 0)", file=sys.stderr)
        return None
    if watching(BACKEND_MODULES[0]):
        return None   # the startup hook patches the backend's module as it is imported
    try:
        return patch_attention()
    except PatchError as e:
        print(f"kdtree.sglang: KDTREE_SGLANG_ATTENTION=1 but not patched: {e}", file=sys.stderr)
        return None


def _num(x) -> float:
    """A layer attribute that may be None, a float or a tensor, as a float (0 for None)."""
    return 0.0 if x is None else float(x)


def _why_not(backend, q, k, v, layer, forward_batch, args, kwargs):
    """None where kdtree computes this call as SGLang's Triton kernel would, else why not
    (host attributes only: no sync)."""
    mode = getattr(forward_batch, "forward_mode", None)
    if mode is None or not mode.is_target_verify():
        return "not a target verify"
    meta = getattr(backend, "forward_metadata", None)
    if getattr(meta, "custom_mask", None) is None or getattr(meta, "mask_indptr", None) is None:
        return "no custom mask (a chain, not a tree)"
    if not getattr(backend, "use_mla", False):
        return "not an MLA backend"
    if (layer.qk_head_dim, layer.v_head_dim) != (QK_DIM, V_DIM):
        return f"head dims {layer.qk_head_dim}/{layer.v_head_dim}, not MLA's {QK_DIM}/{V_DIM}"
    if getattr(backend, "enable_deterministic", False):
        return "deterministic inference (SGLang's unified kernel)"
    if getattr(layer, "k_scale", None) is not None or getattr(layer, "v_scale", None) is not None:
        return "scaled K/V"
    if _num(getattr(layer, "logit_cap", None)) > 0:
        return "logit cap"
    if getattr(layer, "sliding_window_size", None) not in (None, -1):
        return "sliding window"
    if getattr(layer, "is_cross_attention", False):
        return "cross attention"
    if _num(getattr(layer, "xai_temperature_len", None)) > 0:
        return "attention temperature"
    if kwargs.get("sinks", args[0] if args else None) is not None:
        return "attention sinks"
    if (k is None) != (v is None):
        return "only one of k and v"
    bs = forward_batch.req_pool_indices.shape[0]
    if bs == 0 or q.shape[0] % bs or q.shape[0] // bs != getattr(backend, "num_draft_tokens", q.shape[0] // bs):
        return f"{q.shape[0]} query rows for {bs} requests of num_draft_tokens"
    if q.dtype != torch.bfloat16:
        return f"q {q.dtype}, not bf16"
    if backend.token_to_kv_pool.get_key_buffer(layer.layer_id).dtype != torch.bfloat16:
        return "the KV pool is not bf16"
    return None


def tree_visibility(custom_mask, mask_indptr, prefix_lens, bs: int, q: int, out=None, rows=None):
    """The tree part of SGLang's custom mask: request i's block ``[q, prefix_i + q]`` starts
    at ``mask_indptr[i]``, its last q columns are the tree; as bool ``[bs, q, q]`` (into
    ``out``). ``rows``: ``arange(q)`` on the mask's device, kept by a caller that asks each
    forward. A few launches, no sync (graph-capturable)."""
    dev = custom_mask.device
    if rows is None:
        rows = torch.arange(q, device=dev)
    P = prefix_lens[:bs].to(torch.int64)
    start = mask_indptr[:bs].to(torch.int64) + P          # row 0's first tree column
    idx = start[:, None, None] + (P + q)[:, None, None] * rows[None, :, None] + rows[None, None, :]
    vals = custom_mask.reshape(-1)[idx]
    if out is None:
        return vals != 0
    return torch.ne(vals, 0, out=out)


class _State:
    """One backend's kdtree state: a VerifyAttention, visibility and lse buffers per (bs, q,
    heads), and the last layer seen (a layer id at or below it starts a forward)."""

    def __init__(self):
        self.shapes = {}
        self.last_layer = None
        self.current = None


def _shape_state(backend, bs, qn, H, dev):
    st = backend.__dict__.get("_kdtree_verify")
    if st is None:
        st = backend.__dict__["_kdtree_verify"] = _State()
    key = (bs, qn, H, dev)
    entry = st.shapes.get(key)
    if entry is None:
        width = backend.req_to_token.shape[1]
        entry = st.shapes[key] = {
            "verify": VerifyAttention(bs, qn, H, width, device=dev),
            "vis": torch.empty(bs, qn, qn, dtype=torch.bool, device=dev),
            "lse": torch.empty(bs * qn, H, dtype=torch.float32, device=dev),
            "rows": torch.arange(qn, device=dev),
        }
    return st, entry


@torch.compiler.disable
def _verify(backend, q, k, v, layer, forward_batch, save_kv_cache):
    """The target verify of one layer on kdtree's kernel (the checks passed)."""
    H = layer.tp_q_head_num
    q3 = q.reshape(-1, H, QK_DIM)
    bs = forward_batch.req_pool_indices.shape[0]
    qn = q3.shape[0] // bs
    st, entry = _shape_state(backend, bs, qn, H, q3.device)
    va = entry["verify"]
    meta = backend.forward_metadata
    if st.last_layer is None or layer.layer_id <= st.last_layer or st.current is not entry:
        # A forward's first attention layer: the requests and the tree, once for every layer.
        va.prepare(forward_batch.req_pool_indices, forward_batch.seq_lens)
        tree_visibility(meta.custom_mask, meta.mask_indptr, forward_batch.seq_lens, bs, qn,
                        out=entry["vis"], rows=entry["rows"])
        st.current = entry
    st.last_layer = layer.layer_id
    if save_kv_cache and k is not None:
        backend.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
    o = q3.new_empty((q3.shape[0], H * V_DIM))
    va.run(q3, backend.token_to_kv_pool.get_key_buffer(layer.layer_id), backend.req_to_token, None, None,
           entry["vis"], layer.scaling, out=(o.view(-1, H, V_DIM), entry["lse"]))
    return o
