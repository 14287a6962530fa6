"""``KDTREE_SGLANG=1`` with nothing else changed: the server's own imports switch the worker over.

The package installs this file as the top-level module ``_kdtree_sglang_hook`` beside a
``kdtree-sglang.pth`` whose one line calls ``install()`` at interpreter start where
``KDTREE_SGLANG=1`` or ``KDTREE_SGLANG_ATTENTION=1`` (SGLang's spawned workers included). It
imports nothing heavy (no torch, no kdtree): ``install()`` only puts a finder first on
``sys.meta_path``. When a watched module is imported, the finder lets the usual finders find it
and wraps its loader, so that right after the module has run it is switched over: a DDTree
worker module by ``kdtree.sglang.patch()`` (KDTREE_SGLANG=1; a worker that imports the builder
from a module patched so takes kdtree's), the Triton attention backend's module by
``kdtree.sglang.patch_attention()`` (KDTREE_SGLANG_ATTENTION=1). Nothing here may break the
server's import: a refusal or an error is one line on stderr and SGLang's own path stays.
"""
import contextlib
import importlib.abc
import os
import sys

# Where DDTree worker modules live in the SGLang forks that carry one (spec sglang.md): the DDTree
# worker's, then the DFlash + DDTree worker's. kdtree.sglang.patch takes them from here.
MODULES = ("sglang.srt.speculative.ddtree_utils", "sglang.srt.speculative.ddtree_worker",
           "sglang.srt.speculative.ddtree", "sglang.srt.speculative.dflash_ddtree_utils",
           "sglang.srt.speculative.dflash_ddtree_worker")
BUILDER = "build_ddtree_tree_from_topk"
# Where SGLang's Triton attention backend lives, and its class (kdtree.sglang.backend).
BACKEND_MODULES = ("sglang.srt.layers.attention.triton_backend",)
BACKEND_CLASS = "TritonAttnBackend"


_REFUSED = []   # builders patch() refused: a worker's copy of one is not refused again aloud


def patch_module(module) -> None:
    """Patches ``module``: the attention backend's module, or a worker module if it holds a
    builder that is not kdtree's; says why where it refuses."""
    if module.__name__ in BACKEND_MODULES:
        try:
            from kdtree.sglang.backend import patch_attention
            patch_attention(module)
        except Exception as e:  # noqa: BLE001 - the server must start whatever kdtree says
            print(f"kdtree.sglang: KDTREE_SGLANG_ATTENTION=1 but {module.__name__} not patched: "
                  f"{type(e).__name__}: {e}", file=sys.stderr)
        return
    fn = vars(module).get(BUILDER)
    if fn is None or any(fn is r for r in _REFUSED) or (getattr(fn, "__module__", None) or "").startswith("kdtree."):
        return   # no builder here (the worker calls its utils'), one refused already, or a patched copy
    try:
        from kdtree.sglang.patch import patch
        patch(module)
    except Exception as e:  # noqa: BLE001 - the server must start whatever kdtree says
        _REFUSED.append(fn)
        print(f"kdtree.sglang: KDTREE_SGLANG=1 but {module.__name__} not patched: {type(e).__name__}: {e}",
              file=sys.stderr)


class _PatchAfterRun(importlib.abc.Loader):
    """A worker module's own loader, then patch_module on the module it ran."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        patch_module(module)

    def __getattr__(self, name):   # get_source, get_filename, ... as the module's own loader
        return getattr(self.loader, name)


class WorkerFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for the watched names, the next finder's spec with its loader wrapped."""

    def __init__(self, names):
        self.names = frozenset(names)

    def find_spec(self, name, path, target=None):
        if name not in self.names:
            return None
        for finder in sys.meta_path:   # past every WorkerFinder: two would ask each other forever
            if type(finder).__name__ == "WorkerFinder" or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchAfterRun(spec.loader)
        return spec


@contextlib.contextmanager
def hook_aside():
    """Every WorkerFinder off sys.meta_path for the block, then back: SGLang's modules load as
    SGLang ships them (kdtree info asks what patch() would do; the sweeps time SGLang's builder)."""
    hooks = [f for f in sys.meta_path if type(f).__name__ == "WorkerFinder"]
    for f in hooks:
        sys.meta_path.remove(f)
    try:
        yield
    finally:
        sys.meta_path[0:0] = hooks


def active() -> bool:
    """A finder is installed: this module's, or another copy's (by name: a test may load this
    file beside the installed hook)."""
    return any(type(f).__name__ == "WorkerFinder" for f in sys.meta_path)


def watching(name: str) -> bool:
    """An installed finder watches module ``name``."""
    return any(type(f).__name__ == "WorkerFinder" and name in getattr(f, "names", ()) for f in sys.meta_path)


def install() -> None:
    """Watches the worker modules under KDTREE_SGLANG=1 (KDTREE_SGLANG_MODULE alone where set)
    and the attention backend's under KDTREE_SGLANG_ATTENTION=1; once a process."""
    try:
        if active():
            return
        named = os.environ.get("KDTREE_SGLANG_MODULE")
        watched = ((named,) if named else MODULES) if os.environ.get("KDTREE_SGLANG") == "1" else ()
        if os.environ.get("KDTREE_SGLANG_ATTENTION") == "1":
            watched += BACKEND_MODULES
        sys.meta_path.insert(0, WorkerFinder(watched))
        for name in watched:   # already imported (by a sitecustomize, say): patched now
            if sys.modules.get(name) is not None:
                patch_module(sys.modules[name])
    except Exception as e:  # noqa: BLE001 - never break interpreter start
        print(f"kdtree.sglang: the KDTREE_SGLANG startup hook failed: {type(e).__name__}: {e}", file=sys.stderr)
