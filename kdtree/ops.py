"""Python bindings of libkdtree (ctypes over its C ABI, kernels/include/kdtree.h).

ctypes keeps the library independent of torch's C++ ABI: one build serves torch
2.11 and 2.13 alike. Each op checks shape, dtype, device and contiguity and names
the wrong argument; it then only allocates its outputs through torch (graph-safe)
and launches on torch's current stream: no host synchronisation, so a sequence
of ops can be captured in a CUDA graph. Sizes that depend on data (the padded
tree width D) must be passed in for capture; a convenience default that reads
them from the device synchronises, and says so.
"""
from __future__ import annotations

import ctypes
import functools
import operator
import os
import pathlib
from dataclasses import dataclass, field

import torch

from .attention import LATENT_DIM, QK_DIM
from .build import DEFAULT_BUILD_DIR, LIB_NAME
from .checks import InputError
from .tree import MAX_BUDGET

STATUS_BUDGET_CLAMPED = 1
STATUS_NAN_INPUT = 2
STATUS_WARP_LOOP = 4   # information: the request's rows were not certified for threshold selection
_P = ctypes.c_void_p
_I = ctypes.c_int


def library_path() -> pathlib.Path:
    return pathlib.Path(os.environ.get("KDTREE_LIB", DEFAULT_BUILD_DIR / LIB_NAME))


@functools.lru_cache(maxsize=1)
def lib() -> ctypes.CDLL:
    path = library_path()
    if not path.exists():
        raise RuntimeError(f"{path} not found: build it with `python -m kdtree build` "
                           "(or set KDTREE_LIB)")
    so = ctypes.CDLL(str(path))
    so.kd_build_trees.argtypes = [_P] * 5 + [_I] * 4 + [_P] * 10 + [_P]
    so.kd_tree_accept.argtypes = [_P] * 4 + [_I] * 3 + [_P] * 3 + [_P]
    so.kd_tree_accept_parents.argtypes = [_P] * 4 + [_I] * 3 + [_P] * 3 + [_P]
    so.kd_verify_attention.argtypes = ([_P] * 5 + [_I] * 7 + [ctypes.c_float, _I] + [_P] * 4 + [_P])
    so.kd_verify_small_launch.argtypes = [_I, _I, ctypes.POINTER(_I)]
    so.kd_verify_tile.argtypes = [_I, _I, _I] + [ctypes.POINTER(_I)] * 4
    so.kd_build_set_smem_limit.argtypes = [_I]
    so.kd_verify_set_path.argtypes = [_I]
    so.kd_verify_merges.argtypes = [_I] * 5 + [ctypes.POINTER(_I)]
    for f in (so.kd_build_trees, so.kd_tree_accept, so.kd_tree_accept_parents,
              so.kd_verify_attention, so.kd_verify_tile, so.kd_verify_small_launch,
              so.kd_build_set_smem_limit, so.kd_verify_set_path, so.kd_verify_merges):
        f.restype = _I
    return so


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


def _check(rc: int, what: str) -> None:
    if rc == 1001:
        raise InputError(f"{what}: a size is outside what the kernel supports")
    if rc != 0:
        raise RuntimeError(f"{what}: CUDA error {rc} at launch")


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
class GpuTrees:
    """Outputs of build_trees_gpu; the layout of kdtree.tree.TreeBatch plus a status word."""

    node_counts: torch.Tensor
    tokens: torch.Tensor
    depths: torch.Tensor
    parents: torch.Tensor
    positions: torch.Tensor
    next_token: torch.Tensor
    next_sibling: torch.Tensor
    visibility: torch.Tensor | None
    visibility_bits: torch.Tensor | None
    status: torch.Tensor  # int32 [B]: STATUS_* bits, 0 when the request built normally
    # What build_trees_gpu last checked these outputs for (see _OUT_FIELDS there).
    _checked: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def raise_on_status(self) -> None:
        """Synchronises. Raises for a request whose input was refused (NaN) or clamped."""
        st = self.status.cpu()
        if (st & STATUS_NAN_INPUT).any():
            b = int(torch.nonzero(st & STATUS_NAN_INPUT)[0])
            raise InputError(f"top_logprobs: NaN or +inf in request {b}; it was left root-only")
        if (st & STATUS_BUDGET_CLAMPED).any():
            b = int(torch.nonzero(st & STATUS_BUDGET_CLAMPED)[0])
            raise InputError(f"budgets[{b}]: exceeds d_max - 1; the tree was cut to d_max - 1 nodes")


def build_trees_gpu(top_logprobs, top_ids, budgets, seq_lens=None, root_tokens=None,
                    d_max: int | None = None, visibility: bool = True,
                    visibility_bits: bool = True, out: GpuTrees | None = None) -> GpuTrees:
    """Best-first build of B trees on the GPU, byte-identical to kdtree.tree.build_trees.

    ``top_logprobs f32 [B, L, K]``, ``top_ids i64 [B, L, K]``, ``budgets i32 [B]``,
    ``seq_lens i32 [B]`` (prefix lengths for positions), ``root_tokens i64 [B]``.
    ``d_max`` (padded slots) defaults to ``max(budgets) + 1``, which synchronises.
    ``out`` reuses preallocated outputs (static buffers for CUDA graphs).
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
    if L > 2047:
        raise InputError(f"top_logprobs: expected L <= 2047 positions, got {L}")
    if d_max is None:
        d_max = int(budgets.max().clamp(min=0)) + 1 if B else 1  # host sync, documented
    if not 1 <= d_max <= MAX_BUDGET + 1:
        raise InputError(f"d_max: expected 1 <= d_max <= {MAX_BUDGET + 1}, got {d_max}")
    D = d_max
    fresh = out is None
    if fresh:
        out = _alloc_trees(B, D, dev, visibility, visibility_bits)
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
    rc = lib().kd_build_trees(
        _ptr(lp), _ptr(top_ids), _ptr(budgets), _ptr(seq_lens), _ptr(root_tokens), B, L, K, D,
        *ptrs, _stream(dev))
    _check(rc, "build_trees_gpu")
    return out


# The outputs in kd_build_trees' argument order.
_OUT_FIELDS = ("node_counts", "tokens", "depths", "parents", "positions", "next_token",
               "next_sibling", "visibility", "visibility_bits", "status")


def _alloc_trees(B, D, dev, visibility=True, visibility_bits=True) -> GpuTrees:
    W = (D + 31) // 32
    i64 = dict(dtype=torch.int64, device=dev)
    return GpuTrees(
        node_counts=torch.empty(B, dtype=torch.int32, device=dev),
        tokens=torch.empty(B, D, **i64), depths=torch.empty(B, D, **i64),
        parents=torch.empty(B, D, dtype=torch.int32, device=dev),
        positions=torch.empty(B, D, **i64), next_token=torch.empty(B, D, **i64),
        next_sibling=torch.empty(B, D, **i64),
        visibility=torch.empty(B, D, D, dtype=torch.bool, device=dev) if visibility else None,
        visibility_bits=torch.empty(B, D, W, dtype=torch.int32, device=dev) if visibility_bits else None,
        status=torch.empty(B, dtype=torch.int32, device=dev))


def _check_trees_out(out: GpuTrees, B, D, dev) -> None:
    for name, dtype, shape in (("node_counts", torch.int32, (B,)), ("tokens", torch.int64, (B, D)),
                               ("depths", torch.int64, (B, D)), ("parents", torch.int32, (B, D)),
                               ("positions", torch.int64, (B, D)), ("next_token", torch.int64, (B, D)),
                               ("next_sibling", torch.int64, (B, D)), ("status", torch.int32, (B,))):
        _tensor(f"out.{name}", getattr(out, name), dtype, shape, dev)
    if out.visibility is not None:
        _tensor("out.visibility", out.visibility, torch.bool, (B, D, D), dev)
    if out.visibility_bits is not None:
        _tensor("out.visibility_bits", out.visibility_bits, torch.int32, (B, D, (D + 31) // 32), dev)


# ---------------------------------------------------------------- accept
def tree_accept(candidates, next_token, next_sibling, target, max_depth: int):
    """Greedy walk per request: ``(accept_index i32 [B, max_depth+1], accept_len i32 [B], bonus i64 [B])``."""
    c = _tensor("candidates", candidates, torch.int64, (None, None))
    dev = c.device
    B, D = c.shape
    for name, t in (("next_token", next_token), ("next_sibling", next_sibling), ("target", target)):
        _tensor(name, t, torch.int64, (B, D), dev)
    accept_index, accept_len, bonus = _accept_outputs(B, max_depth, dev, None)
    rc = lib().kd_tree_accept(_ptr(c), _ptr(next_token), _ptr(next_sibling), _ptr(target), B, D,
                              max_depth, _ptr(accept_index), _ptr(accept_len), _ptr(bonus),
                              _stream(dev))
    _check(rc, "tree_accept")
    return accept_index, accept_len, bonus


ACCEPT_PARENTS_MAX_SLOTS = 4096  # kd_tree_accept_parents keeps 12 bytes a slot in shared memory


def tree_accept_parents(candidates, parents, node_counts, target, max_depth: int, out=None):
    """Greedy accept from parent indices (the build's ``parents`` and ``node_counts``):
    ``tree_accept``'s result on trees whose lists give children in ascending slot order.

    Every slot tests its own token against its parent's target at once, so the time does
    not grow with the siblings a list walk passes over. Nodes are slots ``1..n``
    (``n = node_counts[b]``); a slot outside them, or whose parent is not in ``[0, i)``,
    is not in the tree. ``out``: preallocated ``(accept_index, accept_len, bonus)``.
    """
    c = _tensor("candidates", candidates, torch.int64, (None, None))
    dev = c.device
    B, D = c.shape
    _tensor("parents", parents, torch.int32, (B, D), dev)
    _tensor("node_counts", node_counts, torch.int32, (B,), dev)
    _tensor("target", target, torch.int64, (B, D), dev)
    if D > ACCEPT_PARENTS_MAX_SLOTS:
        raise InputError(f"candidates: expected at most {ACCEPT_PARENTS_MAX_SLOTS} slots a request "
                         f"for the parents form, got D = {D} (tree_accept walks lists of any width)")
    accept_index, accept_len, bonus = _accept_outputs(B, max_depth, dev, out)
    rc = lib().kd_tree_accept_parents(_ptr(c), _ptr(parents), _ptr(node_counts), _ptr(target), B,
                                      D, max_depth, _ptr(accept_index), _ptr(accept_len),
                                      _ptr(bonus), _stream(dev))
    _check(rc, "tree_accept_parents")
    return accept_index, accept_len, bonus


def _accept_outputs(B, max_depth, dev, out):
    if not isinstance(max_depth, int) or max_depth < 0:
        raise InputError(f"max_depth: expected an integer >= 0, got {max_depth!r}")
    if out is None:
        return (torch.empty(B, max_depth + 1, dtype=torch.int32, device=dev),
                torch.empty(B, dtype=torch.int32, device=dev), torch.empty(B, dtype=torch.int64, device=dev))
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise InputError("out: expected a tuple (accept_index, accept_len, bonus)")
    return (_tensor("out[0] (accept_index)", out[0], torch.int32, (B, max_depth + 1), dev),
            _tensor("out[1] (accept_len)", out[1], torch.int32, (B,), dev),
            _tensor("out[2] (bonus)", out[2], torch.int64, (B,), dev))


# ---------------------------------------------------------------- attention
MAX_SPLITS = 128


@functools.lru_cache(maxsize=256)
def _small_launch(index: int, B: int, max_seq: int) -> bool:
    """Whether B requests over max_seq keys make a small launch on device `index` (the
    kernel library's rule: its 32-key mma.sync tiles would not reach every SM), where one
    row tile of a small tree runs the mma.sync kernel, not the wgmma kernel."""
    small = _I()
    with torch.cuda.device(index):
        _check(lib().kd_verify_small_launch(B, max_seq, ctypes.byref(small)), "kd_verify_small_launch")
    return bool(small.value)


def _launch_is_small(device, B: int | None, max_seq: int | None) -> bool:
    # No launch given: one that fills the GPU.
    if B is None or max_seq is None:
        return False
    return _small_launch(torch.device(device).index or 0, B, max_seq)


def _launch_facts(device, R: int, page_size: int, B: int | None, max_seq: int | None):
    """`_device_facts` for the kernel a launch of B requests over max_seq keys takes."""
    small = _launch_is_small(device, B, max_seq)
    return _device_facts(torch.device(device).index or 0, R, page_size, small)


@functools.lru_cache(maxsize=64)
def _device_facts(index: int, R: int, page_size: int = 64, small: bool = False):
    """(query rows per CTA, keys per tile, CTAs one wave holds, wgmma copy path) for R rows,
    this page size and launch size (`_small_launch`) on device `index` (copy path: 0
    cp.async, 1 TMA, 2 TMA to pairs)."""
    rows, keys, wave, copy = _I(), _I(), _I(), _I()
    with torch.cuda.device(index):
        _check(lib().kd_verify_tile(R, page_size, int(small), ctypes.byref(rows), ctypes.byref(keys),
                                    ctypes.byref(wave), ctypes.byref(copy)), "kd_verify_tile")
    return rows.value, keys.value, max(1, wave.value), copy.value


# "wgmma_cp_async": the wgmma kernel with its cp.async key copy even where TMA fits (the
# path of page sizes that are not multiples of 64); "wgmma_combine": key splits merged by
# the combine kernel even where they could merge in a cluster. For tests and same-run A/Bs.
VERIFY_PATHS = ("auto", "mma_sync", "wgmma_cp_async", "wgmma_combine")


def set_verify_path(path: str) -> str:
    """Pick the verify kernel: "auto" (wgmma on Hopper, mma.sync elsewhere), "mma_sync"
    (the kernel other GPUs run, also on Hopper: for tests), "wgmma_cp_async" (as auto,
    keys copied by cp.async, not TMA) or "wgmma_combine" (as auto, key splits always
    merged through bf16 partials and the combine kernel). Returns the previous
    setting."""
    if path not in VERIFY_PATHS:
        raise InputError(f"path: expected one of {VERIFY_PATHS}, got {path!r}")
    old = lib().kd_verify_set_path(VERIFY_PATHS.index(path))
    _device_facts.cache_clear()  # the tile (and so the split) follows the path
    return VERIFY_PATHS[old]


def verify_kernel(R: int, device, page_size: int = 64, B: int | None = None,
                  max_seq: int | None = None) -> str:
    """Which verify kernel runs for R query rows on `device` now: "mma_sync", "wgmma"
    (cp.async copy), "wgmma_tma" or "wgmma_tma_x2" (key tiles multicast to pairs of row
    tiles; a launch whose splits merge in clusters, `split_merge`, runs "wgmma_tma").
    B and max_seq (block-table columns x page size) give the launch; without them, one
    that fills the GPU."""
    rows, keys, _, copy = _launch_facts(device, R, page_size, B, max_seq)
    if keys != 64:  # the mma.sync tiles stream 32 keys
        return "mma_sync"
    return {0: "wgmma", 1: "wgmma_tma"}.get(copy, f"wgmma_tma_x{copy}")


def split_merge(B: int, R: int, num_splits: int, device, page_size: int = 64,
                max_seq: int | None = None) -> str:
    """How a launch of B requests of R rows merges its key splits on `device` now: "none"
    (one split), "cluster" (in the attention kernel, through distributed shared memory:
    Hopper's TMA path, 2 splits, 16 or more row tiles of 64 rows, clusters that all fit at
    once) or "combine_kernel" (bf16 partials, then the combine kernel). max_seq as for
    `verify_kernel`."""
    if num_splits <= 1:
        return "none"
    merges = _I()
    with torch.cuda.device(torch.device(device).index or 0):
        small = int(_launch_is_small(device, B, max_seq))
        _check(lib().kd_verify_merges(B, R, page_size, num_splits, small, ctypes.byref(merges)),
               "kd_verify_merges")
    return "cluster" if merges.value else "combine_kernel"


def choose_splits(B: int, R: int, max_seq: int, device, page_size: int = 64) -> int:
    """Splits over the keys so that the grid fills one wave of the GPU without spilling into
    a second (read off the device, no sync); each split keeps one or two key tiles."""
    rows, keys, wave, _ = _launch_facts(device, R, page_size, B, max_seq)
    row_tiles = -(-R // rows)
    ctas = B * row_tiles
    tiles = -(-max_seq // keys)
    want = wave // max(ctas, 1)
    # One or two row tiles (small trees): a split of a single key tile is fastest (the
    # GPU is far from full); more rows re-read Q and write partials per split, so each
    # split keeps two tiles there (H200 measurements in kernels/NOTES.md).
    min_tiles = 1 if row_tiles <= 2 else 2
    return max(1, min(want, max(1, tiles // min_tiles), MAX_SPLITS))


def verify_attention(q, kv_cache, block_table, seq_lens, visibility, scale: float,
                     num_splits: int | None = None, out=None, lse=None):
    """Tree-verify attention: ``(out bf16 [B, D, H, 512], lse f32 [B, D, H])``.

    ``visibility`` is the build's bool ``[B, D, D]`` or its bit-packed int32
    ``[B, D, ceil(D/32)]``. ``num_splits`` defaults to a split that fills the GPU.
    """
    q = _tensor("q", q, torch.bfloat16, (None, None, None, QK_DIM))
    dev = q.device
    B, D, H, _ = q.shape
    kv = _tensor("kv_cache", kv_cache, torch.bfloat16, (None, None, QK_DIM), dev)
    page_size = kv.shape[1]
    if kv.shape[0] < 1 or page_size < 1:
        raise InputError(f"kv_cache: expected at least one page of at least one row, got shape {tuple(kv.shape)}")
    bt = _tensor("block_table", block_table, torch.int32, (B, None), dev)
    if bt.shape[1] < 1:
        raise InputError("block_table: expected at least one page a request, got 0 columns")
    _tensor("seq_lens", seq_lens, torch.int32, (B,), dev)
    if not isinstance(visibility, torch.Tensor):
        raise InputError(f"visibility: expected a torch tensor, got {type(visibility).__name__}")
    if visibility.dtype == torch.bool:
        _tensor("visibility", visibility, torch.bool, (B, D, D), dev)
        bits = 0
    else:
        _tensor("visibility", visibility, torch.int32, (B, D, (D + 31) // 32), dev)
        bits = 1
    if not isinstance(scale, float) or not scale > 0:
        raise InputError(f"scale: expected a positive float (e.g. 0.130861 for K2), got {scale!r}")
    R = D * H
    if num_splits is None:
        num_splits = choose_splits(B, R, bt.shape[1] * page_size, dev, page_size)
    if not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise InputError(f"num_splits: expected an integer in [1, {MAX_SPLITS}], got {num_splits!r}")
    if out is None:
        out = torch.empty(B, D, H, LATENT_DIM, dtype=torch.bfloat16, device=dev)
    _tensor("out", out, torch.bfloat16, (B, D, H, LATENT_DIM), dev)
    if lse is None:
        lse = torch.empty(B, D, H, dtype=torch.float32, device=dev)
    _tensor("lse", lse, torch.float32, (B, D, H), dev)
    # The kernels copy q, the cache and out in 16-byte vectors: a view at an odd offset
    # would fault on the GPU, so it is refused here by name.
    pq, pkv, pout = q.data_ptr(), kv.data_ptr(), out.data_ptr()
    if (pq | pkv | pout) & 15:
        for name, ptr in (("q", pq), ("kv_cache", pkv), ("out", pout)):
            if ptr & 15:
                raise InputError(f"{name}: expected a 16-byte aligned data pointer, got one {ptr % 16} "
                                 "bytes past it (a view at an offset?)")
    part_o = part_l = None
    if num_splits > 1:
        part_o = torch.empty(B, num_splits, R, LATENT_DIM, dtype=torch.bfloat16, device=dev)
        part_l = torch.empty(B, num_splits, R, dtype=torch.float32, device=dev)
    rc = lib().kd_verify_attention(pq, pkv, _ptr(bt), _ptr(seq_lens), _ptr(visibility),
                                   bits, B, D, H, page_size, kv.shape[0], bt.shape[1], float(scale),
                                   num_splits, pout, _ptr(lse), _ptr(part_o), _ptr(part_l),
                                   _stream(dev))
    _check(rc, "verify_attention")
    return out, lse
