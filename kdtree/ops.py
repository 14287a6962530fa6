"""The three ops over libkdtree: tree build, tree-verify attention, tree accept.

Each op checks shape, dtype, device and contiguity and names the wrong argument; it then
only allocates its outputs through torch (graph-safe) and launches on the current stream of
its tensors' device: no host synchronisation, so a sequence of ops can be captured in a CUDA graph.
Every op returns a named result, and takes ``out=`` of that same type to write into
preallocated (static) buffers. Sizes that depend on data (the padded tree width D) must
be passed in for capture; a convenience default that reads them from the device
synchronises, and says so.

The library is called through ctypes (loader.py), so one build serves any torch >= 2.11.
"""
from __future__ import annotations

import ctypes
import math
import numbers
import operator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .checks import InputError
from .loader import KdBuildPlan, KdVerifyPlan, lib
from .reference.attention import LATENT_DIM, QK_DIM
from .reference.tree import MAX_BUDGET

STATUS_BUDGET_CLAMPED = 1
STATUS_NAN_INPUT = 2
STATUS_WARP_LOOP = 4   # information: the request's rows were not certified for threshold selection
MAX_POSITIONS = 2047   # draft positions L a build takes (MAX_DEPTH in kernels/src/tree_select.cuh)


def cuda_device(device=None) -> torch.device:
    """A CUDA device with its index (the current one for "cuda" or None)."""
    dev = torch.device("cuda") if device is None else torch.device(device)
    if dev.type != "cuda":
        raise InputError(f"device: expected a CUDA device, got {dev}")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        raise InputError(f"device: expected a CUDA device, but torch {torch.__version__} sees none "
                         "(a CPU build of torch, or no GPU visible to this process)")
    if dev.index is not None and dev.index >= n:
        raise InputError(f"device: expected cuda:0 to cuda:{n - 1}, got {dev}")
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


def _is_int(v) -> bool:
    """A plain integer: a bool is an int to Python, never a size here."""
    return isinstance(v, int) and not isinstance(v, bool)


def _check_sizes(*sizes) -> None:
    """(name, value, lo) triples: each value a plain integer >= lo, else InputError naming it."""
    for name, v, lo in sizes:
        if not _is_int(v) or v < lo:
            raise InputError(f"{name}: expected an integer >= {lo}, got {v!r}")


def _check_d_max(d_max) -> None:
    if not _is_int(d_max) or not 1 <= d_max <= MAX_BUDGET + 1:
        raise InputError(f"d_max: expected an integer 1 <= d_max <= {MAX_BUDGET + 1}, got {d_max!r}")


def _check_num_splits(num_splits) -> None:
    if num_splits is not None and (not _is_int(num_splits) or not 1 <= num_splits <= MAX_SPLITS):
        raise InputError(f"num_splits: expected an integer in [1, {MAX_SPLITS}] or None, got {num_splits!r}")


def _check_scale(scale) -> float:
    """The softmax scale as a float: any positive finite real (a Python or numpy float, an
    int); a tensor is refused, since reading it would synchronise."""
    if type(scale) is not float:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            hint = " (a tensor: pass float(t) once, outside the loop)" if isinstance(scale, torch.Tensor) else ""
            raise InputError(f"scale: expected a positive float (e.g. 0.130861 for K2), got "
                             f"{type(scale).__name__}{hint}")
        scale = float(scale)
    if not 0.0 < scale < math.inf:
        raise InputError(f"scale: expected a positive float (finite; e.g. 0.130861 for K2), got {scale!r}")
    return scale


def _ptr(t: torch.Tensor | None):
    # ctypes turns an int into a void* (c_void_p argtypes); None is NULL.
    return None if t is None else t.data_ptr()


# The current stream's raw handle by device index: torch's own accessor (what Triton's
# launcher calls) took 0.22 us where torch.cuda.current_stream(device) took 5.9 us on the
# H200 host, a tenth of a small build's caller latency. Absent in CPU builds of torch.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(device) -> int:
    if _raw_stream is not None and device.index is not None:
        return _raw_stream(device.index)
    return torch.cuda.current_stream(device).cuda_stream


# The current device by torch's own accessors (a CUDA build's; torch.cuda's wrappers otherwise).
_get_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
_set_device = getattr(torch._C, "_cuda_setDevice", torch.cuda.set_device)


def _launch(what: str, dev: torch.device, entry: str, *args) -> None:
    """Calls the library's ``entry`` with ``args`` and ``dev``'s current stream, on ``dev``.

    The library launches on the current device and reads that device's limits, while a torch
    op follows its tensors: so ``dev`` is made current for the call and the caller's device
    restored after (one C call where they already agree). Raises on a failed launch."""
    idx = dev.index
    prev = _get_device()
    if prev != idx:
        _set_device(idx)
    try:
        rc = getattr(lib(), entry)(*args, _stream(dev))
    finally:
        if prev != idx:
            _set_device(prev)
    _check(rc, what)


# Launch errors a user can act on (cudaError_t values): what to do about each.
_NO_CODE = "this library holds no code this GPU runs (`python -m kdtree info` says what each GPU runs)"
_OLD_DRIVER = "the driver is older than the library's CUDA 13 (kdtree needs driver >= 580)"
_LAUNCH_HINTS = {35: _OLD_DRIVER, 36: _OLD_DRIVER, 98: _NO_CODE, 209: _NO_CODE, 222: _OLD_DRIVER}


def _check(rc: int, what: str) -> None:
    if rc == 0:
        return
    if rc == 1001:
        raise InputError(f"{what}: a size is outside what the kernel supports")
    said = lib().kd_error_string(rc).decode(errors="replace")
    hint = _LAUNCH_HINTS.get(rc)
    raise RuntimeError(f"{what}: CUDA error {rc} at launch ({said})" + (f": {hint}" if hint else ""))


def _tensor(name, t, dtype, shape, device=None):
    """Checks a kernel argument; the common (valid) case costs a few attribute reads, since
    these checks sit on every launch's host path (the caller latency the sweeps report).
    The fast test reads the device index once (``get_device``: -1 off the GPU) instead of
    ``is_cuda`` and a ``torch.device`` compare, and an exact ``type`` test instead of
    ``isinstance`` (about half the cost); tensor subclasses take the full test. A fully given
    shape compares as one tuple (a generator over the dims cost ~4x more)."""
    if type(t) is torch.Tensor:
        idx = t.get_device()
        if (idx >= 0 and t.dtype is dtype and (device is None or idx == device.index)
                and (t.shape == shape or _shape_matches(t.shape, shape)) and t.is_contiguous()):
            return t
    elif (isinstance(t, torch.Tensor) and t.dtype is dtype and t.is_cuda
            and (device is None or t.device == device) and _shape_matches(t.shape, shape)
            and t.is_contiguous()):
        return t
    _explain(name, t, dtype, shape, device)  # raises


def _shape_matches(got, shape) -> bool:
    """got (a torch.Size) against shape, whose None entries match any size."""
    if got == shape:
        return True
    if len(got) != len(shape):
        return False
    for a, s in zip(got, shape):
        if s is not None and a != s:
            return False
    return True


def _explain(name, t, dtype, shape, device):
    """The error for an argument _tensor refused: the first rule it breaks."""
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name}: expected a torch tensor, got {type(t).__name__}")
    if not t.is_cuda:
        raise InputError(f"{name}: expected a CUDA tensor, got device {t.device}")
    if device is not None and t.device != device:
        raise InputError(f"{name}: expected device {device}, got {t.device}")
    if t.dtype != dtype:
        raise InputError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if t.dim() != len(shape) or any(s is not None and a != s for a, s in zip(t.shape, shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise InputError(f"{name}: expected shape {want}, got {list(t.shape)}")
    raise InputError(f"{name}: expected a contiguous tensor")


# ---------------------------------------------------------------- tree build
@dataclass
class TreeBuildResult:
    """tree_build's outputs, padded to D slots a request (the layout of
    kdtree.reference.TreeBatch) plus a status word.

    ``node_counts i32 [B]``; ``tokens``, ``depths``, ``positions``, ``next_token``,
    ``next_sibling`` i64 ``[B, D]``; ``parents i32 [B, D]``; ``visibility_bits i32
    [B, D, ceil(D/32)]`` (bit j%32 of word j//32: slot i sees slot j); ``visibility bool
    [B, D, D]`` only when asked for (``dense_visibility=True``), else None; ``status i32
    [B]``: STATUS_* bits, 0 when the request built normally.
    """

    node_counts: torch.Tensor
    tokens: torch.Tensor
    depths: torch.Tensor
    parents: torch.Tensor
    positions: torch.Tensor
    next_token: torch.Tensor
    next_sibling: torch.Tensor
    visibility_bits: torch.Tensor
    visibility: torch.Tensor | None
    status: torch.Tensor
    # What tree_build last checked these outputs for (see _OUT_FIELDS there).
    _checked: tuple | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def empty(cls, B: int, D: int, device, dense_visibility: bool = False) -> "TreeBuildResult":
        """Uninitialised outputs for B requests of D slots: static buffers for ``out=``."""
        dev = torch.device(device)
        W = (D + 31) // 32
        i64 = dict(dtype=torch.int64, device=dev)
        return cls(
            node_counts=torch.empty(B, dtype=torch.int32, device=dev),
            tokens=torch.empty(B, D, **i64), depths=torch.empty(B, D, **i64),
            parents=torch.empty(B, D, dtype=torch.int32, device=dev),
            positions=torch.empty(B, D, **i64), next_token=torch.empty(B, D, **i64),
            next_sibling=torch.empty(B, D, **i64),
            visibility_bits=torch.empty(B, D, W, dtype=torch.int32, device=dev),
            visibility=torch.empty(B, D, D, dtype=torch.bool, device=dev) if dense_visibility else None,
            status=torch.empty(B, dtype=torch.int32, device=dev))

    def raise_on_status(self) -> None:
        """Synchronises. Raises for a request whose input was refused (NaN) or clamped."""
        st = self.status.cpu()
        if (st & STATUS_NAN_INPUT).any():
            b = int(torch.nonzero(st & STATUS_NAN_INPUT)[0])
            raise InputError(f"top_logprobs: NaN or +inf in request {b}; it was left root-only")
        if (st & STATUS_BUDGET_CLAMPED).any():
            b = int(torch.nonzero(st & STATUS_BUDGET_CLAMPED)[0])
            raise InputError(f"budgets[{b}]: exceeds d_max - 1; the tree was cut to d_max - 1 nodes")


def tree_build(top_logprobs, top_ids, budgets, *, seq_lens=None, root_tokens=None,
               d_max: int | None = None, dense_visibility: bool = False,
               out: TreeBuildResult | None = None) -> TreeBuildResult:
    """Best-first build of B draft trees on the GPU, byte-identical to
    ``kdtree.reference.tree_build`` (the heapq build of the spec, ties included).

    ``top_logprobs f32 [B, L, K]`` (rows sorted descending), ``top_ids i64 [B, L, K]``,
    ``budgets i32 [B]`` (nodes a request, 0..1024), ``seq_lens i32 [B]`` (prefix lengths for
    ``positions``; zeros if None), ``root_tokens i64 [B]`` (slot 0's token; 0 if None).
    ``d_max`` (slots a request, padded) defaults to ``max(budgets) + 1``, which synchronises:
    pass it inside a captured decode loop. The bit-packed visibility is always written; the
    dense bool mask only with ``dense_visibility=True`` (it costs build time, and the verify
    op reads the bits). ``out`` reuses a ``TreeBuildResult`` (static buffers).

    Values are not checked here (that would synchronise): token ids are copied as given
    (the reference refuses negative ones), -inf log-probs are clamped to ``NEG_INF_FLOOR``,
    ``budgets <= 0`` give the root-only tree. Rows outside stage A's contract (not sorted
    descending, or log-probs > 0) are still built exactly, by a slower fallback path; the
    result's status flags which rows took it.
    """
    lp = _tensor("top_logprobs", top_logprobs, torch.float32, (None, None, None))
    dev = lp.device
    B, L, K = lp.shape
    _tensor("top_ids", top_ids, torch.int64, (B, L, K), dev)
    _tensor("budgets", budgets, torch.int32, (B,), dev)
    if seq_lens is not None:
        _tensor("seq_lens", seq_lens, torch.int32, (B,), dev)
    if root_tokens is not None:
        _tensor("root_tokens", root_tokens, torch.int64, (B,), dev)
    if L > MAX_POSITIONS:
        raise InputError(f"top_logprobs: expected L <= {MAX_POSITIONS} positions, got {L}")
    if d_max is None:
        d_max = int(budgets.max().clamp(min=0)) + 1 if B else 1  # host sync, documented
    _check_d_max(d_max)
    D = d_max
    fresh = out is None
    if fresh:
        out = TreeBuildResult.empty(B, D, dev, dense_visibility)
    elif not isinstance(out, TreeBuildResult):
        raise InputError(f"out: expected a TreeBuildResult (TreeBuildResult.empty), got {type(out).__name__}")
    fields = tuple(getattr(out, name) for name in _OUT_FIELDS)
    ptrs = tuple(map(_ptr, fields))
    # Reused outputs (the static buffers of a decode loop) are checked in full once per
    # (B, D, device), tensors and data pointers: the full check reads 10 tensors' attributes,
    # a third of a small build's host time. The same tensor objects keep their dtype and
    # device; the record holds them, so no new allocation can take their addresses, and a
    # storage that is resized or replaced gets a new pointer.
    key = (B, D, dev.index)
    seen = out._checked
    if seen is None or seen[0] != key or seen[1] != ptrs or not all(map(operator.is_, fields, seen[2])):
        if not fresh:
            _check_trees_out(out, B, D, dev)
        out._checked = (key, ptrs, fields)
    _launch("tree_build", dev, "kd_build_trees", _ptr(lp), _ptr(top_ids), _ptr(budgets), _ptr(seq_lens),
            _ptr(root_tokens), B, L, K, D, *ptrs)
    return out


def tree_build_plan(B: int, L: int, K: int, d_max: int, *, visibility: bool = True, device=None) -> dict:
    """The launch choices ``tree_build`` makes for ``B`` requests of ``L x K`` log-probs and
    ``d_max`` slots on ``device``: ``kernel`` ("wide": one CTA an SM; "two_cta": two an SM),
    ``node_buffer`` (the threshold selection's nodes; 0: the exact warp loop only),
    ``staged_ld``, ``path_keys``, ``vis_smem`` and ``smem_bytes`` (dynamic shared memory a CTA).
    For tests and tools: ``tree_build`` makes its own."""
    _check_sizes(("B", B, 0), ("L", L, 0), ("K", K, 0))
    if L > MAX_POSITIONS:
        raise InputError(f"L: expected L <= {MAX_POSITIONS} positions, got {L}")
    _check_d_max(d_max)
    plan = KdBuildPlan()
    with torch.cuda.device(cuda_device(device)):
        _check(lib().kd_build_plan_make(B, L, K, d_max, int(bool(visibility)), ctypes.byref(plan)),
               "tree_build_plan")
    return {"kernel": "wide" if plan.wide else "two_cta", "node_buffer": plan.node_buffer,
            "staged_ld": plan.staged_ld, "path_keys": bool(plan.path_keys), "vis_smem": bool(plan.vis_smem),
            "smem_bytes": plan.smem_bytes}


# The outputs in kd_build_trees' argument order.
_OUT_FIELDS = ("node_counts", "tokens", "depths", "parents", "positions", "next_token",
               "next_sibling", "visibility", "visibility_bits", "status")


def _check_trees_out(out: TreeBuildResult, B, D, dev) -> None:
    for name, dtype, shape in (("node_counts", torch.int32, (B,)), ("tokens", torch.int64, (B, D)),
                               ("depths", torch.int64, (B, D)), ("parents", torch.int32, (B, D)),
                               ("positions", torch.int64, (B, D)), ("next_token", torch.int64, (B, D)),
                               ("next_sibling", torch.int64, (B, D)), ("status", torch.int32, (B,)),
                               ("visibility_bits", torch.int32, (B, D, (D + 31) // 32))):
        _tensor(f"out.{name}", getattr(out, name), dtype, shape, dev)
    if out.visibility is not None:
        _tensor("out.visibility", out.visibility, torch.bool, (B, D, D), dev)


# ---------------------------------------------------------------- accept
class TreeAcceptResult(NamedTuple):
    """tree_accept's outputs: ``accept_index i32 [B, max_depth + 1]`` (global slot ids
    ``b * D + i`` of the accepted path from the root, -1 padded), ``accept_len i32 [B]``
    (draft nodes accepted, root excluded), ``bonus i64 [B]`` (the target's token at the
    last accepted slot: the next root)."""

    accept_index: torch.Tensor
    accept_len: torch.Tensor
    bonus: torch.Tensor

    @classmethod
    def empty(cls, B: int, max_depth: int, device) -> "TreeAcceptResult":
        dev = torch.device(device)
        return cls(torch.empty(B, max_depth + 1, dtype=torch.int32, device=dev),
                   torch.empty(B, dtype=torch.int32, device=dev), torch.empty(B, dtype=torch.int64, device=dev))


ACCEPT_PARENTS_MAX_SLOTS = 4096  # kd_tree_accept_parents keeps 12 bytes a slot in shared memory


def tree_accept(tokens, target, max_depth: int, *, parents=None, node_counts=None, next_token=None,
                next_sibling=None, out: TreeAcceptResult | None = None) -> TreeAcceptResult:
    """Greedy accept of B trees from the target's argmax ``target i64 [B, D]``.

    ``tokens i64 [B, D]`` (slot 0 the root). The tree comes in one of two forms:
    - ``parents i32 [B, D]`` and ``node_counts i32 [B]`` (the build's): every slot tests its
      own token against its parent's target at once, so the time does not grow with the
      siblings a walk passes over (D <= 4096). Nodes are slots ``1..n``; a slot outside
      them, or whose parent is not in ``[0, i)``, is not in the tree.
    - ``next_token`` and ``next_sibling`` ``[B, D]``, both i64 or both i32 (left-child /
      right-sibling lists, SGLang's ``verify_tree_greedy`` inputs): a walk, any D.
    Both give the same result on the build's trees. ``max_depth``: the draft length L.
    """
    by_parents = parents is not None and node_counts is not None
    if by_parents == (next_token is not None and next_sibling is not None) or \
            (parents is None) != (node_counts is None) or (next_token is None) != (next_sibling is None):
        raise InputError("tree_accept: expected the tree as parents= and node_counts=, or as next_token= "
                         "and next_sibling=, not both and not neither")
    _check_sizes(("max_depth", max_depth, 0))
    c = _tensor("tokens", tokens, torch.int64, (None, None))
    dev = c.device
    B, D = c.shape
    _tensor("target", target, torch.int64, (B, D), dev)
    if out is None:
        out = TreeAcceptResult.empty(B, max_depth, dev)
    elif not isinstance(out, tuple) or len(out) != 3:
        raise InputError("out: expected a TreeAcceptResult (accept_index, accept_len, bonus)")
    else:
        _tensor("out.accept_index", out[0], torch.int32, (B, max_depth + 1), dev)
        _tensor("out.accept_len", out[1], torch.int32, (B,), dev)
        _tensor("out.bonus", out[2], torch.int64, (B,), dev)
        out = TreeAcceptResult(*out)
    if by_parents:
        _tensor("parents", parents, torch.int32, (B, D), dev)
        _tensor("node_counts", node_counts, torch.int32, (B,), dev)
        if D > ACCEPT_PARENTS_MAX_SLOTS:
            raise InputError(f"tokens: expected at most {ACCEPT_PARENTS_MAX_SLOTS} slots a request with "
                             f"parents=, got D = {D} (next_token=/next_sibling= take any width)")
        _launch("tree_accept", dev, "kd_tree_accept_parents", _ptr(c), _ptr(parents), _ptr(node_counts),
                _ptr(target), B, D, max_depth, _ptr(out[0]), _ptr(out[1]), _ptr(out[2]))
    else:
        link = next_token.dtype if isinstance(next_token, torch.Tensor) else None
        if link is not torch.int32:
            link = torch.int64   # the message for anything else names int64, the build's
        _tensor("next_token", next_token, link, (B, D), dev)
        _tensor("next_sibling", next_sibling, link, (B, D), dev)
        _launch("tree_accept", dev, "kd_tree_accept", _ptr(c), _ptr(next_token), _ptr(next_sibling),
                int(link is torch.int64), _ptr(target), B, D, max_depth, _ptr(out[0]), _ptr(out[1]), _ptr(out[2]))
    return out


# ---------------------------------------------------------------- attention
MAX_SPLITS = 128
# Per-call kernel choice (KD_VERIFY_* in kdtree.h): "auto" is the device's best (wgmma on
# Hopper, mma.sync elsewhere); the others force a path, for tests and same-run A/Bs.
VERIFY_KERNELS = ("auto", "mma_sync", "wgmma_cp_async", "wgmma_combine")
_KERNEL_NAMES = {0: "mma_sync", 1: "wgmma"}
_COPY_NAMES = {0: "cp_async", 1: "tma", 3: "tma_runs"}
_MERGE_NAMES = {0: "none", 1: "cluster", 2: "combine_kernel"}
_COMBINE_NAMES = {0: "plain", 1: "programmatic", 2: "programmatic_held"}


class TreeVerifyResult(NamedTuple):
    """tree_verify's outputs: ``out bf16 [B, D, H, 512]`` and ``lse f32 [B, D, H]``
    (natural log, for merging with another partial attention)."""

    out: torch.Tensor
    lse: torch.Tensor

    @classmethod
    def empty(cls, B: int, D: int, H: int, device) -> "TreeVerifyResult":
        dev = torch.device(device)
        return cls(torch.empty(B, D, H, LATENT_DIM, dtype=torch.bfloat16, device=dev),
                   torch.empty(B, D, H, dtype=torch.float32, device=dev))


class TreeVerifyPlan:
    """Tree-verify attention planned once for a shape, then run many times (FlashInfer's
    plan/run): the kernel, key copy, splits and split merge (and, where the combine kernel
    merges, how it follows the attention kernel: ``combine``, one of ``plain``,
    ``programmatic`` or ``programmatic_held``) are chosen by the library's
    one heuristics table (kernels/src/verify_plan.cu) when the plan is made, on the current
    (or given) CUDA device, and the split workspace is allocated then.

    ``B`` requests of ``D`` tree slots and ``H`` heads, over a paged latent cache of
    ``page_size`` keys a page and block tables of ``max_pages`` columns. ``kernel``: one of
    VERIFY_KERNELS. ``num_splits``: None lets the library choose it for ``max_pages``' keys;
    an integer forces every request to it. ``per_request_splits`` (with ``num_splits`` None):
    each request takes the library's count for its own keys (``split_base`` > 0 where that
    differs from one count for all), for block tables much wider than their requests, as a
    server's context length makes them; requests as long as the table pay a few percent.
    Where ``D * H`` leaves the last row tile part full (SGLang's ``D = budget + 1``) and the
    other row tiles fill the GPU's waves, only that last row tile is split (``tail``: the others
    take one split each and write their rows). A plan's workspace serves one launch at a time
    (one stream).
    """

    def __init__(self, B: int, D: int, H: int, page_size: int, max_pages: int, *, device=None,
                 kernel: str = "auto", num_splits: int | None = None, per_request_splits: bool = False,
                 own_workspace: bool = True):
        _check_sizes(("B", B, 0), ("D", D, 1), ("H", H, 1), ("page_size", page_size, 1), ("max_pages", max_pages, 1))
        if kernel not in VERIFY_KERNELS:
            raise InputError(f"kernel: expected one of {VERIFY_KERNELS}, got {kernel!r}")
        _check_num_splits(num_splits)
        if not isinstance(per_request_splits, bool):
            raise InputError(f"per_request_splits: expected True or False, got {per_request_splits!r}")
        if per_request_splits and num_splits is not None:
            raise InputError(f"per_request_splits: takes the library's counts, so num_splits must be None, "
                             f"got {num_splits!r}")
        self.device = cuda_device(device)
        self.kernel_request = kernel
        self._plan = KdVerifyPlan()
        with torch.cuda.device(self.device):
            _check(lib().kd_verify_plan_make(B, D, H, page_size, max_pages, VERIFY_KERNELS.index(kernel),
                                             num_splits or 0, int(per_request_splits), ctypes.byref(self._plan)),
                   "TreeVerifyPlan")
        pl = self._plan
        self.B, self.D, self.H, self.page_size, self.max_pages = B, D, H, page_size, max_pages
        self.kernel = _KERNEL_NAMES[pl.kernel]
        self.copy = _COPY_NAMES[pl.copy] if pl.kernel == 1 else "cp_async"
        self.num_splits, self.split_base, self.tail = pl.num_splits, pl.split_base, bool(pl.tail)
        self.merge = _MERGE_NAMES[pl.merge]
        self.combine = _COMBINE_NAMES[pl.combine] if self.merge == "combine_kernel" else None
        self.rows_per_cta, self.keys_per_tile = pl.rows_per_cta, pl.keys_per_tile
        self.small_launch = bool(pl.small_launch)
        self._ref = ctypes.byref(pl)
        self.workspace = _workspace(B, pl.num_splits, D * H, self.device) if own_workspace else (None, None)

    def __repr__(self):
        return (f"TreeVerifyPlan(B={self.B}, D={self.D}, H={self.H}, page_size={self.page_size}, "
                f"max_pages={self.max_pages}: kernel={self.kernel}, copy={self.copy}, "
                f"num_splits={self.num_splits}, split_base={self.split_base}, tail={self.tail}, merge={self.merge}, "
                f"combine={self.combine})")

    @property
    def name(self) -> str:
        """The kernel and copy as one label: mma_sync, wgmma (cp.async), wgmma_tma, wgmma_tma_runs
        (page sizes off 64: TMA for tiles of consecutive cache rows)."""
        if self.kernel == "mma_sync":
            return "mma_sync"
        return "wgmma" if self.copy == "cp_async" else f"wgmma_{self.copy}"

    def run(self, q, kv_cache, block_table, seq_lens, visibility, scale: float, *, req_rows=None,
            out: TreeVerifyResult | None = None) -> TreeVerifyResult:
        """Runs the plan. ``q bf16 [B, D, H, 576]`` (or SGLang's ``[B*D, H, 576]``);
        ``kv_cache bf16 [num_pages, page_size, 576]`` (SGLang's token pool ``[slots, 1, 576]``
        at page size 1); ``block_table i32 [rows, >= max_pages]``: request b reads row
        ``req_rows[b]`` (``req_rows i32 [B]``, SGLang's ``req_pool_indices``) or row b, so
        SGLang's ``req_to_token`` is used in place; ``seq_lens i32 [B]`` = prefix + D;
        ``visibility`` the build's ``visibility_bits i32 [B, D, ceil(D/32)]`` or a bool
        ``[B, D, D]``; ``scale`` the model's softmax scale (K2-Instruct: 0.130861, never
        576 ** -0.5). ``out``: a TreeVerifyResult to write into (q's layout: ``out.out`` is
        ``[B, D, H, 512]`` or ``[B*D, H, 512]``)."""
        return _run_verify(self, q, kv_cache, block_table, seq_lens, visibility, scale, req_rows, out,
                           self.workspace)


def _workspace(B, num_splits, R, dev):  # the splits' partials (None without splits)
    if num_splits <= 1:
        return None, None
    return (torch.empty(B, num_splits, R, LATENT_DIM, dtype=torch.bfloat16, device=dev),
            torch.empty(B, num_splits, R, dtype=torch.float32, device=dev))


def _run_verify(plan, q, kv_cache, block_table, seq_lens, visibility, scale, req_rows, out, workspace):
    B, D, H = plan.B, plan.D, plan.H
    dev = plan.device
    flat = q.dim() == 3 if isinstance(q, torch.Tensor) else False
    qshape = (B * D, H, QK_DIM) if flat else (B, D, H, QK_DIM)
    q = _tensor("q", q, torch.bfloat16, qshape, dev)
    kv = _tensor("kv_cache", kv_cache, torch.bfloat16, (None, plan.page_size, QK_DIM), dev)
    if kv.shape[0] < 1:
        raise InputError(f"kv_cache: expected at least one page of {plan.page_size} rows, got shape {tuple(kv.shape)}")
    bt = _tensor("block_table", block_table, torch.int32, (None, None), dev)
    if bt.shape[1] < plan.max_pages:
        raise InputError(f"block_table: expected at least max_pages = {plan.max_pages} columns, got {bt.shape[1]}")
    if req_rows is None:
        if bt.shape[0] != B:
            raise InputError(f"block_table: expected {B} rows (one a request; or pass req_rows), got {bt.shape[0]}")
    else:
        _tensor("req_rows", req_rows, torch.int32, (B,), dev)
    _tensor("seq_lens", seq_lens, torch.int32, (B,), dev)
    if not isinstance(visibility, torch.Tensor):
        raise InputError(f"visibility: expected a torch tensor, got {type(visibility).__name__}")
    if visibility.dtype == torch.bool:
        _tensor("visibility", visibility, torch.bool, (B, D, D), dev)
        bits = 0
    else:
        _tensor("visibility", visibility, torch.int32, (B, D, (D + 31) // 32), dev)
        bits = 1
    scale = _check_scale(scale)
    oshape = (B * D, H, LATENT_DIM) if flat else (B, D, H, LATENT_DIM)
    if out is None:
        out = TreeVerifyResult(torch.empty(oshape, dtype=torch.bfloat16, device=dev),
                               torch.empty(B * D if flat else B, *((H,) if flat else (D, H)),
                                           dtype=torch.float32, device=dev))
    else:
        if not isinstance(out, tuple) or len(out) != 2:
            raise InputError("out: expected a TreeVerifyResult (out, lse)")
        _tensor("out.out", out[0], torch.bfloat16, oshape, dev)
        _tensor("out.lse", out[1], torch.float32, oshape[:-1], dev)
        out = TreeVerifyResult(*out)
    # The kernels copy q, the cache and out in 16-byte vectors: a view at an odd offset
    # would fault on the GPU, so it is refused here by name.
    pq, pkv, pout = q.data_ptr(), kv.data_ptr(), out[0].data_ptr()
    if (pq | pkv | pout) & 15:
        for name, ptr in (("q", pq), ("kv_cache", pkv), ("out", pout)):
            if ptr & 15:
                raise InputError(f"{name}: expected a 16-byte aligned data pointer, got one {ptr % 16} "
                                 "bytes past it (a view at an offset?)")
    part_o, part_l = workspace
    _launch("tree_verify", dev, "kd_verify_run", plan._ref, pq, pkv, kv.shape[0], _ptr(bt), bt.shape[1],
            _ptr(req_rows), _ptr(seq_lens), _ptr(visibility), bits, scale, pout, _ptr(out[1]), _ptr(part_o),
            _ptr(part_l))
    return out


# tree_verify's plans by shape. A server's shapes drift (the block table widens with the
# context), so the cache is bounded: past PLAN_CACHE_MAX it starts again (a plan is one C call).
PLAN_CACHE_MAX = 1024
_PLANS: dict = {}


def _cached_plan(key, make):
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= PLAN_CACHE_MAX:
            _PLANS.clear()
        plan = _PLANS[key] = make()
    return plan


def tree_verify(q, kv_cache, block_table, seq_lens, visibility, scale: float, *, kernel: str = "auto",
                num_splits: int | None = None, out: TreeVerifyResult | None = None) -> TreeVerifyResult:
    """Tree-verify attention in MLA absorbed form, planned and run in one call.

    ``q bf16 [B, D, H, 576]``, ``kv_cache bf16 [num_pages, page_size, 576]``,
    ``block_table i32 [B, max_pages]``, ``seq_lens i32 [B]`` (= prefix + D), ``visibility``
    the build's ``visibility_bits`` (or a bool ``[B, D, D]``), ``scale`` the model's softmax
    scale. The plan of each shape is made once and kept (TreeVerifyPlan says what it
    chooses); the split workspace comes from torch's allocator each call, so concurrent
    streams never share it. Returns a TreeVerifyResult; ``out=`` writes into one.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        _tensor("q", q, torch.bfloat16, (None, None, None, QK_DIM))  # raises with the reason
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 3:
        raise InputError(f"kv_cache: expected a [num_pages, page_size, {QK_DIM}] tensor, got "
                         f"{tuple(kv_cache.shape) if isinstance(kv_cache, torch.Tensor) else type(kv_cache).__name__}")
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
        raise InputError("block_table: expected an int32 [B, max_pages] tensor")
    B, D, H, _ = q.shape
    if block_table.shape[1] < 1:
        raise InputError("block_table: expected at least one page a request, got 0 columns")
    if kv_cache.shape[0] < 1 or kv_cache.shape[1] < 1:
        raise InputError(f"kv_cache: expected at least one page of at least one row, got shape {tuple(kv_cache.shape)}")
    _check_num_splits(num_splits)
    dev = q.get_device()
    key = (B, D, H, kv_cache.shape[1], block_table.shape[1], dev, kernel, num_splits)
    if dev < 0:
        _tensor("q", q, torch.bfloat16, (B, D, H, QK_DIM))  # raises: not on a GPU
    plan = _cached_plan(key, lambda: TreeVerifyPlan(B, D, H, kv_cache.shape[1], block_table.shape[1],
                                                    device=torch.device("cuda", dev), kernel=kernel,
                                                    num_splits=num_splits, own_workspace=False))
    return _run_verify(plan, q, kv_cache, block_table, seq_lens, visibility, scale, None, out,
                       _workspace(B, plan.num_splits, D * H, plan.device))
