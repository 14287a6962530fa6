"""Switching a running SGLang DDTree worker module over to kdtree, and back.

``patch(module)`` replaces the worker's CPU functions that kdtree speaks for (today:
``build_ddtree_tree_from_topk``) after checking that the module, each function and its
signature are what kdtree expects; it says what it replaced, and ``Patch.undo()`` (or
``unpatch()``) puts the originals back. Nothing is replaced unless everything checks out.
A worker that imported the function by name (``from ...utils import build_...``) holds its
own reference, which patching the module it came from would miss: patch() also replaces every
such copy already imported (``imported_copies``), and a worker imported later takes kdtree's
from the patched module. ``KDTREE_SGLANG=1`` in the environment patches on ``import
kdtree.sglang``; ``check_patch()`` says what ``patch()`` would do without doing it.
"""
from __future__ import annotations

import importlib
import inspect
import os
import sys

from .startup_hook import MODULES
from .startup_hook import watching as hook_watching

# Where DDTree worker modules live (MODULES): defined once beside the startup hook, which
# watches them and may import nothing of kdtree's.
# name -> (the parameters the worker's function takes, in order; those a fork adds after them,
# each with a default, which kdtree's takes and ignores: the DFlash + DDTree fork's CPU buffers).
FUNCTIONS = {"build_ddtree_tree_from_topk": (("top_log_probs", "top_token_ids", "budget"), ("workspace",))}


class PatchError(RuntimeError):
    """The module, a function or a signature is not what kdtree.sglang expects."""


class Patch:
    """An applied patch: ``module``, ``replaced`` (its names), ``copies`` (``module.name`` of
    the copies replaced elsewhere), ``undo()``; a context manager."""

    def __init__(self, module, originals: dict, copies: list):
        self.module, self._originals, self._copies = module, originals, copies
        self.replaced = tuple(originals)
        self.copies = tuple(f"{m.__name__}.{n}" for m, n in copies)

    def undo(self) -> None:
        for name, fn in self._originals.items():
            setattr(self.module, name, fn)
        for m, name in self._copies:
            setattr(m, name, self._originals[name])
        self._originals, self._copies = {}, []
        _ACTIVE.pop(self.module.__name__, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()

    def __repr__(self):
        return f"Patch({self.module.__name__}: {', '.join(self.replaced) or 'undone'})"


_ACTIVE: dict = {}


def _resolve(module):
    if module is None:
        for name in MODULES:
            try:
                return importlib.import_module(name)
            except ImportError:
                continue
        raise PatchError(f"no SGLang DDTree worker module found (tried {', '.join(MODULES)}); "
                         "pass the module (or its name) to patch()")
    if isinstance(module, str):
        try:
            return importlib.import_module(module)
        except ImportError as e:
            raise PatchError(f"module {module!r} does not import: {e}") from None
    return module


def check_patch(module=None) -> tuple:
    """What ``patch(module)`` would replace, without replacing it: ``(module, {name:
    original})``; raises PatchError where patch() would refuse (``python -m kdtree info``
    asks this)."""
    mod = _resolve(module)
    name = getattr(mod, "__name__", repr(mod))
    originals = {}
    for fn_name, params in FUNCTIONS.items():
        fn = getattr(mod, fn_name, None)
        if fn is None:
            raise PatchError(f"{name}.{fn_name}: not found; this module is not a DDTree worker kdtree knows")
        if not callable(fn):
            raise PatchError(f"{name}.{fn_name}: expected a function, got {type(fn).__name__}")
        if (getattr(fn, "__module__", None) or "").startswith("kdtree."):
            raise PatchError(f"{name}.{fn_name}: already kdtree's (patched through the module it was "
                             "imported from); nothing to replace")
        try:
            got = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            raise PatchError(f"{name}.{fn_name}: its signature cannot be read") from None
        required, optional = params
        extra = got[len(required):]
        if tuple(p.name for p in got[:len(required)]) != required or \
                any(p.name not in optional or p.default is inspect.Parameter.empty for p in extra):
            raise PatchError(f"{name}.{fn_name}{tuple(p.name for p in got)}: expected parameters {required}"
                             f" (then optionally {', '.join(f'{o}=' for o in optional)}); this worker speaks "
                             "another format, so nothing was replaced")
        originals[fn_name] = fn
    return mod, originals


def imported_copies(module, originals: dict) -> list:
    """``(module, name)`` of every other loaded module that holds one of ``originals`` under its
    name: a worker that imported the function by name, whose calls patching ``module`` alone
    would not reach. Read from each module's own namespace (no lazy attribute is triggered)."""
    copies = []
    for m in list(sys.modules.values()):
        space = getattr(m, "__dict__", None)
        if m is module or not isinstance(space, dict):
            continue
        copies += [(m, n) for n, fn in originals.items() if space.get(n) is fn]
    return copies


def patch(module=None, verbose: bool = True) -> Patch:
    """Replaces the worker module's functions with kdtree.sglang's; returns the Patch."""
    from . import build_ddtree_tree_from_topk

    mod = _resolve(module)
    name = getattr(mod, "__name__", repr(mod))
    if name in _ACTIVE:
        raise PatchError(f"{name} is already patched by kdtree (undo() it first)")
    ours = {"build_ddtree_tree_from_topk": build_ddtree_tree_from_topk}
    _, originals = check_patch(mod)
    copies = imported_copies(mod, originals)
    for fn_name in originals:
        setattr(mod, fn_name, ours[fn_name])
    for m, fn_name in copies:
        setattr(m, fn_name, ours[fn_name])
    p = Patch(mod, originals, copies)
    _ACTIVE[name] = p
    if verbose:
        print(f"kdtree.sglang: replaced {', '.join([f'{name}.{n}' for n in p.replaced] + list(p.copies))}",
              file=sys.stderr)
    return p


def unpatch(module=None) -> bool:
    """Undoes the patch of `module` (or of every patched module); whether one was undone."""
    names = list(_ACTIVE) if module is None else [module if isinstance(module, str) else module.__name__]
    undone = False
    for n in names:
        if n in _ACTIVE:
            _ACTIVE[n].undo()
            undone = True
    return undone


def patch_from_env():
    """Patches when KDTREE_SGLANG=1 (the module from KDTREE_SGLANG_MODULE, else the known
    ones); see env_patch."""
    named = os.environ.get("KDTREE_SGLANG_MODULE")
    return env_patch("KDTREE_SGLANG", named or MODULES[0], lambda: patch(named or None))


def env_patch(var: str, module: str, apply):
    """``apply()`` where ``var`` is 1, unless the startup hook watches ``module`` (it patches it
    as it is imported, startup_hook.py); 0 or unset does nothing, another value is said and
    ignored. A refusal is printed, not raised: a serving process keeps SGLang's own path
    rather than failing to start."""
    flag = os.environ.get(var, "")
    if flag in ("", "0") or hook_watching(module):
        return None
    if flag != "1":
        print(f"kdtree.sglang: {var}={flag!r} ignored (expected 1 or 0)", file=sys.stderr)
        return None
    try:
        return apply()
    except PatchError as e:
        print(f"kdtree.sglang: {var}=1 but not patched: {e}", file=sys.stderr)
        return None
