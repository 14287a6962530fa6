"""SGLang's Triton attention backend verifying an MLA tree on kdtree's kernel.

A DDTree worker's target-verify forward runs, in every one of the model's attention layers,
``TritonAttnBackend.forward_extend`` with the round's custom mask (spec sglang.md, step 5),
which ends in SGLang's Triton extend kernel, ``self.extend_attention_fwd(...)``: 1.6-6.1 ms a
layer at batch 1 on an H200 where kdtree's tree-verify kernel takes 17-74 us
(docs/results.md). ``patch_attention()`` wraps that method on the class. SGLang's own method
still runs every call (its KV write, its output buffer, its choice of path, as each release
has them); in a target verify on an MLA backend, the wrapper hands it, for that call, a
stand-in for ``extend_attention_fwd`` that computes the attention on kdtree's kernel where
the arguments SGLang passes say it computes what the Triton kernel would:
- a custom mask; bf16 q ``[tokens, H, 576]`` of ``bs * num_draft_tokens`` rows, pool
  ``[slots, 1, 576]`` and output ``[tokens, H, 512]``;
- no K/V descale, logit cap, sliding window, sinks, temperature, score mod, lse output or
  prefix / extend skip, and no argument it does not know;
and otherwise calls the Triton kernel with the same arguments. kdtree's kernel reads the pool
through ``req_to_token`` in place (columns 0 .. prefix + q - 1: the prefix, then the verify
slots, which the worker assigns there before the forward, as EAGLE's does) and the tree part
of the custom mask (each row's last q columns) as the visibility. The first call of each kind
left to SGLang says why on stderr. The per-forward work (the requests' rows and lengths, the
mask's tree part: a few launches, no sync) runs at the first attention layer of each forward,
so a forward captured in a CUDA graph replays it with the graph's own metadata buffers; each
layer is then the attention kernel alone. The numbers are not SGLang's bit for bit (another
kernel, the same attention within bf16 rounding): hence its own opt-in,
``KDTREE_SGLANG_ATTENTION=1``.
"""
from __future__ import annotations

import collections
import importlib
import inspect
import sys

import torch

from .attention import VerifyAttention
from .patch import PatchError, env_patch
from .startup_hook import BACKEND_CLASS, BACKEND_MODULES

QK_DIM, V_DIM = 576, 512
# forward_extend's leading parameters, as the Triton backend's method takes them.
PARAMS = ("self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache")


class AttentionPatch:
    """An applied patch of ``cls.forward_extend``: ``taken`` (layer calls kdtree ran),
    ``left`` (a Counter of the reasons target-verify calls went to SGLang's kernel),
    ``undo()``; a context manager."""

    def __init__(self, cls, original, verbose: bool):
        self.cls, self.original, self.verbose = cls, original, verbose
        self.taken = 0
        self.left = collections.Counter()

    def say(self, why: str) -> None:
        """A call left to SGLang: counted, and said on stderr the first time."""
        if self.left[why] == 0 and self.verbose:
            print(f"kdtree.sglang: a tree-verify layer left to SGLang's Triton kernel: {why}", file=sys.stderr)
        self.left[why] += 1

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
    """Wraps ``TritonAttnBackend.forward_extend`` (of ``target``: the class, its module or the
    module's name; SGLang's by default) so that its tree verify runs on kdtree's kernel where
    it applies; returns the AttentionPatch."""
    cls, original = check_attention_patch(target)
    p = AttentionPatch(cls, original, verbose)

    def forward_extend(self, q, k, v, layer, forward_batch, *args, **kwargs):
        why = _why_not(self, q, layer, forward_batch)
        if why is not None:
            if why != "not a target verify":
                p.say(why)
            return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
        call = _TreeVerify(p, self, layer, forward_batch, self.extend_attention_fwd)
        self.extend_attention_fwd = call   # this call only: SGLang's method runs as it is
        try:
            return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
        finally:
            self.extend_attention_fwd = call.real
            if not call.called:
                p.say("SGLang's forward_extend took a path without extend_attention_fwd")

    # Opaque to torch.compile: the wrapper sets an attribute for one call and reads addresses.
    forward_extend = torch.compiler.disable(forward_extend)
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
    """Patches when KDTREE_SGLANG_ATTENTION=1; see kdtree.sglang.patch.env_patch."""
    return env_patch("KDTREE_SGLANG_ATTENTION", BACKEND_MODULES[0], patch_attention)


def _num(x) -> float:
    """An argument that may be None, a float or a tensor, as a float (0 for None)."""
    return 0.0 if x is None else float(x)


def _why_not(backend, q, layer, forward_batch):
    """None where a call may be kdtree's (the kernel's arguments decide the rest), else why
    not. Host attributes only: no sync."""
    mode = getattr(forward_batch, "forward_mode", None)
    if mode is None or not mode.is_target_verify():
        return "not a target verify"
    if not getattr(backend, "use_mla", False):
        return "not an MLA backend"
    if (layer.qk_head_dim, layer.v_head_dim) != (QK_DIM, V_DIM):
        return f"head dims {layer.qk_head_dim}/{layer.v_head_dim}, not MLA's {QK_DIM}/{V_DIM}"
    if q.dtype != torch.bfloat16:
        return f"q {q.dtype}, not bf16"
    bs = forward_batch.req_pool_indices.shape[0]
    if bs == 0 or q.shape[0] % bs or q.shape[0] // bs != getattr(backend, "num_draft_tokens", q.shape[0] // bs):
        return f"{q.shape[0]} query rows for {bs} requests of num_draft_tokens"
    if not isinstance(getattr(backend, "req_to_token", None), torch.Tensor):
        return "no req_to_token on the backend"
    if not callable(vars(backend).get("extend_attention_fwd")):
        return "no extend_attention_fwd of the backend's own"
    return None


# extend_attention_fwd's keyword arguments, each with the values at which the call is plain
# tree-verify attention; those that change nothing kdtree computes; anything else unknown.
NEUTRAL = {"logit_cap": lambda x: _num(x) <= 0, "sliding_window_size": lambda x: x is None or x < 0,
           "sinks": lambda x: x is None, "window_kv_offsets": lambda x: x is None,
           "xai_temperature_len": lambda x: _num(x) <= 0, "lse_extend": lambda x: x is None,
           "skip_prefix_custom_mask": lambda x: x is True, "skip_prefix": lambda x: not x,
           "skip_extend": lambda x: not x, "score_mod": lambda x: x is None, "aux_tensors": lambda x: x is None,
           "identity_kv_indices": lambda x: not x}
IGNORED = {"page_size", "extend_seq_lens_cpu", "max_bs"}


def _why_not_kernel(args, kwargs):
    """None where extend_attention_fwd(*args, **kwargs) is the attention kdtree computes."""
    if len(args) != 16:
        return f"extend_attention_fwd called with {len(args)} positional arguments, not 16"
    q, o, k_buffer, custom_mask, mask_indptr, k_descale, v_descale = (args[0], args[3], args[4], args[9], args[11],
                                                                      args[13], args[14])
    if custom_mask is None or mask_indptr is None:
        return "no custom mask (a chain, not a tree)"
    if _num(k_descale) != 1.0 or _num(v_descale) != 1.0:
        return "scaled K/V"
    for name, value in kwargs.items():
        if name in NEUTRAL and not NEUTRAL[name](value):
            # The option's name, never its value: one reason a kind of call, said once.
            return {"logit_cap": "logit cap", "sliding_window_size": "sliding window", "sinks": "attention sinks",
                    "xai_temperature_len": "attention temperature"}.get(name, f"{name} set")
        if name not in NEUTRAL and name not in IGNORED:
            return f"an argument kdtree does not know: {name}"
    if q.dim() != 3 or q.shape[2] != QK_DIM or o.shape != (q.shape[0], q.shape[1], V_DIM):
        return f"q {tuple(q.shape)} / out {tuple(o.shape)}, not [tokens, H, {QK_DIM}] / [tokens, H, {V_DIM}]"
    if k_buffer.dtype != torch.bfloat16:
        return "the KV pool is not bf16"
    return None


class _TreeVerify:
    """extend_attention_fwd for one forward_extend call: kdtree's kernel where the arguments
    allow, else ``real`` (SGLang's) with the same arguments."""

    def __init__(self, patch, backend, layer, forward_batch, real):
        self.patch, self.backend, self.layer, self.fb = patch, backend, layer, forward_batch
        self.real = real
        self.called = False

    def __call__(self, *args, **kwargs):
        self.called = True
        why = _why_not_kernel(args, kwargs)
        if why is None:
            try:
                _verify(self.backend, self.layer, self.fb, args)
            except ValueError as e:   # kdtree's InputError: the call is SGLang's after all
                why = f"kdtree refused the inputs: {e}"
            except RuntimeError as e:   # no library here, or none for this GPU: never the server's end
                why = f"kdtree could not run: {e}"
            else:
                if self.patch.taken == 0 and self.patch.verbose:   # the switch is seen to work, once
                    print(f"kdtree.sglang: a tree-verify layer ran on kdtree's kernel ({args[0].shape[0]} query rows, "
                          f"{args[0].shape[1]} heads); others will not be said", file=sys.stderr)
                self.patch.taken += 1
                return None
        self.patch.say(why)
        return self.real(*args, **kwargs)


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
    heads); the last layer seen and the metadata prepared from (the shape's entry, the
    tensors' addresses)."""

    def __init__(self):
        self.shapes = {}
        self.last_layer = None
        self.current = None
        self.metadata = None


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


def _verify(backend, layer, forward_batch, args):
    """One layer's tree verify on kdtree's kernel, into extend_attention_fwd's output."""
    q, o, k_buffer, custom_mask, mask_indptr, scale = args[0], args[3], args[4], args[9], args[11], args[15]
    bs, H = forward_batch.req_pool_indices.shape[0], q.shape[1]
    qn = q.shape[0] // bs
    st, entry = _shape_state(backend, bs, qn, H, q.device)
    va = entry["verify"]
    # A forward starts where the layers start again or its metadata is other tensors (two
    # micro-batches interleaving their layers on one backend, say): then the requests and the
    # tree, once for every layer of it.
    metadata = (forward_batch.req_pool_indices.data_ptr(), forward_batch.seq_lens.data_ptr(),
                custom_mask.data_ptr(), mask_indptr.data_ptr())
    if st.last_layer is None or layer.layer_id <= st.last_layer or st.current is not entry or \
            st.metadata != metadata:
        va.prepare(forward_batch.req_pool_indices, forward_batch.seq_lens)
        tree_visibility(custom_mask, mask_indptr, forward_batch.seq_lens, bs, qn, out=entry["vis"],
                        rows=entry["rows"])
        st.current, st.metadata = entry, metadata
    st.last_layer = layer.layer_id
    va.run(q, k_buffer, backend.req_to_token, None, None, entry["vis"], scale, out=(o, entry["lse"]))
