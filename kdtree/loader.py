"""Finds, builds and loads libkdtree, and declares its C ABI (kernels/include/kdtree.h).

Where the library comes from, first match wins:
1. ``KDTREE_LIB``: a path the caller names (the pipeline's rules pass their own build);
2. the package's own build, compiled when the package was installed with nvcc present
   (``kdtree/_lib/libkdtree.so`` beside this file);
3. the per-user JIT cache, ``$KDTREE_CACHE_DIR`` or ``~/.cache/kdtree``, one folder per
   hash of the kernel sources, archs and flags, compiled on first use under a file lock
   (two processes starting at once build it once), with a message on stderr.

A library whose ``kd_version()`` is not this package's ``ABI_VERSION`` is refused by name:
a stale build would otherwise be called with the wrong arguments.
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import os
import pathlib
import sys

from .build import DEFAULT_ARCHS, LIB_NAME, build, source_hash

ABI_VERSION = 13  # KD_ABI_VERSION in kernels/include/kdtree.h
PACKAGED_LIB = pathlib.Path(__file__).resolve().parent / "_lib" / LIB_NAME

_P = ctypes.c_void_p
_I = ctypes.c_int


class KdBuildPlan(ctypes.Structure):
    """kd_build_plan (kdtree.h): the shape, then the launch choices kd_build_plan_make made."""

    _fields_ = [(name, _I) for name in (
        "B", "L", "K", "D", "visibility", "wide", "node_buffer", "staged_ld", "path_keys", "vis_smem",
        "smem_bytes")]


class KdVerifyPlan(ctypes.Structure):
    """kd_verify_plan (kdtree.h): the shape, then the choices kd_verify_plan_make made."""

    _fields_ = [(name, _I) for name in (
        "B", "D", "H", "page_size", "max_pages", "path", "device",
        "kernel", "copy", "rows_per_cta", "keys_per_tile", "num_splits", "merge", "small_launch", "combine",
        "wave", "split_base", "tail")]


# name -> (argtypes); every entry returns int but those in _RESTYPE. The one place the Python
# side states the ABI.
_ABI = {
    "kd_version": [],
    "kd_error_string": [_I],
    "kd_build_archs": [],
    "kd_build_trees": [_P] * 5 + [_I] * 4 + [_P] * 10 + [_P],
    "kd_build_plan_make": [_I] * 5 + [ctypes.POINTER(KdBuildPlan)],
    "kd_build_set_smem_limit": [_I],
    "kd_tree_accept": [_P] * 3 + [_I, _P] + [_I] * 3 + [_P] * 3 + [_P],
    "kd_tree_accept_parents": [_P] * 4 + [_I] * 3 + [_P] * 3 + [_P],
    "kd_verify_plan_make": [_I] * 8 + [ctypes.POINTER(KdVerifyPlan)],
    "kd_verify_run": [ctypes.POINTER(KdVerifyPlan), _P, _P, _I, _P, _I, _P, _P, _P, _I, ctypes.c_float,
                      _P, _P, _P, _P, _P],
    "kd_sglang_custom_mask": [_P, _P, _I, _I, _I, ctypes.c_int64, _P, _P, _P],
    "kd_sglang_round_layout": [_P] * 8 + [_I] * 3 + [_P] * 5 + [_P],
    "kd_sglang_accept_outputs": [_P] * 4 + [_I] * 2 + [_P] * 3 + [_P],
}
_RESTYPE = {"kd_error_string": ctypes.c_char_p, "kd_build_archs": ctypes.c_char_p}


def cache_dir() -> pathlib.Path:
    base = os.environ.get("KDTREE_CACHE_DIR")
    if base:
        return pathlib.Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (pathlib.Path(xdg) if xdg else pathlib.Path.home() / ".cache") / "kdtree"


def jit_path() -> pathlib.Path:
    """Where the JIT cache keeps the build of these sources (built or not)."""
    return cache_dir() / source_hash(DEFAULT_ARCHS) / LIB_NAME


def library_path() -> pathlib.Path:
    """The library lib() loads, without building it."""
    named = os.environ.get("KDTREE_LIB")
    if named:
        return pathlib.Path(named)
    if PACKAGED_LIB.exists():
        return PACKAGED_LIB
    return jit_path()


def jit_build() -> pathlib.Path:
    """Builds the JIT cache's library unless it is there; one process builds, others wait."""
    target = jit_path()
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            print(f"kdtree: compiling the CUDA kernels into {target.parent} (first use; about a minute)",
                  file=sys.stderr, flush=True)
            work = target.parent / "work"
            built = build(work, DEFAULT_ARCHS)
            os.replace(built, target)  # complete or absent: never a half-written library
    return target


def lib() -> ctypes.CDLL:
    """The loaded library with its ABI declared; raises RuntimeError with what to do. Its
    failure is remembered as its success is (``lib.cache_clear()`` forgets both): a caller
    that falls back on it (kdtree.sglang, each layer or request) does not hash the sources,
    compile or load again on every call."""
    so, error = _loaded()
    if so is None:
        raise RuntimeError(error)
    return so


@functools.lru_cache(maxsize=1)
def _loaded() -> tuple:
    """``(library, None)``, or ``(None, why)`` where it cannot be found, built or loaded."""
    path = library_path()
    try:
        if not path.exists():
            if os.environ.get("KDTREE_LIB"):
                raise RuntimeError(f"KDTREE_LIB={path}: no such file (build it with `python -m kdtree build`)")
            try:
                path = jit_build()
            except (RuntimeError, OSError) as e:
                raise RuntimeError(f"libkdtree is not built and could not be compiled here: {e}") from None
        return load(path), None
    except RuntimeError as e:
        return None, str(e)


lib.cache_clear = _loaded.cache_clear


def load(path) -> ctypes.CDLL:
    try:
        so = ctypes.CDLL(str(path))
    except OSError as e:  # corrupt, truncated or for another platform: the loader's error, not ctypes'
        raise RuntimeError(f"{path}: not a loadable libkdtree ({e}): rebuild it with "
                           "`python -m kdtree build` or reinstall kdtree") from None
    try:
        version = so.kd_version()
    except AttributeError:
        version = None
    if version != ABI_VERSION:
        raise RuntimeError(f"{path}: a stale libkdtree (C ABI {version}; this kdtree needs {ABI_VERSION}): "
                           "rebuild it with `python -m kdtree build` or reinstall kdtree")
    for name, argtypes in _ABI.items():
        f = getattr(so, name, None)
        if f is None:
            raise RuntimeError(f"{path}: C ABI {version} but no {name}: a library built from other sources; "
                               "rebuild it with `python -m kdtree build` or reinstall kdtree")
        f.argtypes = argtypes
        f.restype = _RESTYPE.get(name, _I)
    return so


def build_archs(so) -> tuple[str, ...]:
    """The archs a loaded library was compiled for (kdtree.build's names); () where unknown."""
    text = so.kd_build_archs().decode()
    return () if text == "unknown" else tuple(text.split("__"))
