"""Argument checks shared by the CPU references and the GPU bindings.

Every error names the argument and says what was expected, so a caller
deep inside a decode loop can tell which input is wrong without a debugger.
"""
from __future__ import annotations

import numpy as np

# -inf log-probs are clamped to this floor, identically on CPU and GPU (spec
# ddtree.md section 1). Moderate on purpose: a huge floor would swallow the
# other terms of a float64 score sum.
NEG_INF_FLOOR = -1.0e4


class InputError(ValueError):
    """A bad argument: the message names it and what was expected."""


def to_numpy(name: str, x) -> np.ndarray:
    """Accept numpy arrays and (CPU or CUDA) torch tensors."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        return x.detach().cpu().numpy()
    raise InputError(f"{name}: expected a numpy array or torch tensor, got {type(x).__name__}")


def check_dtype(name: str, x: np.ndarray, dtype) -> None:
    if x.dtype != np.dtype(dtype):
        raise InputError(f"{name}: expected dtype {np.dtype(dtype).name}, got {x.dtype.name}")


def check_ndim(name: str, x: np.ndarray, ndim: int, layout: str) -> None:
    if x.ndim != ndim:
        raise InputError(f"{name}: expected {ndim}-D {layout}, got shape {tuple(x.shape)}")


def check_log_probs(name: str, lp: np.ndarray) -> np.ndarray:
    """NaN and +inf are rejected; -inf is clamped to NEG_INF_FLOOR (returns a copy if clamped)."""
    if np.isnan(lp).any():
        idx = tuple(int(i) for i in np.argwhere(np.isnan(lp))[0])
        raise InputError(f"{name}: NaN at index {idx}; log-probs must not be NaN")
    if np.isposinf(lp).any():
        idx = tuple(int(i) for i in np.argwhere(np.isposinf(lp))[0])
        raise InputError(f"{name}: +inf at index {idx}; log-probs must be finite or -inf")
    if np.isneginf(lp).any():
        lp = np.where(np.isneginf(lp), np.float32(NEG_INF_FLOOR), lp).astype(np.float32)
    return lp


def check_int(name: str, value, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InputError(f"{name}: expected an integer, got {type(value).__name__}")
    value = int(value)
    if lo is not None and value < lo:
        raise InputError(f"{name}: expected >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise InputError(f"{name}: expected <= {hi}, got {value}")
    return value
