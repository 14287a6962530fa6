"""What this machine offers kdtree (``python -m kdtree info``): the library and where it comes
from, each GPU with the code of the build it runs and whether that kind of GPU has been
measured, and whether ``kdtree.sglang.patch()`` would find a DDTree worker to switch over.
Read-only: nothing is built, launched or patched.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import pathlib
import re
import sys

from . import build, loader

# GPUs the reference set and the GPU tests ran on (results/reference, docs/kernels/README.md).
MEASURED = ("H200",)


def _arch(name: str) -> tuple[bool, tuple[int, int], str]:
    """'sm_90a' -> (a cubin, (9, 0), 'a'); kdtree.build's names (validated there)."""
    kind, num, suffix = re.fullmatch(r"(sm|compute)_(\d+)([a-z]?)", name).groups()
    return kind == "sm", (int(num[:-1]), int(num[-1])), suffix


def _runs_on(sass: bool, cc_code: tuple[int, int], suffix: str, cc: tuple[int, int]) -> bool:
    """Whether code built for cc_code runs on a device of cc: an arch-specific build ('a') on
    that compute capability alone; a cubin (or family code, 'f') on later minors of its major;
    PTX on anything from its version."""
    if suffix == "a":
        return cc == cc_code
    if sass or suffix == "f":
        return cc[0] == cc_code[0] and cc[1] >= cc_code[1]
    return cc >= cc_code


def device_code(major: int, minor: int, archs=build.DEFAULT_ARCHS) -> tuple[str | None, str]:
    """The code of a build of ``archs`` (a default build's unless named) that a device of this
    compute capability runs, and its verify kernel: the newest cubin it runs, else the newest
    PTX the driver compiles for it; (None, why) where none runs."""
    if (major, minor) < (9, 0):
        return None, f"compute capability {major}.{minor}: kdtree's kernels need 9.0 or newer"
    fits = []
    for name in archs:
        sass, cc, suffix = _arch(name)
        if _runs_on(sass, cc, suffix, (major, minor)):
            fits.append((not sass, -cc[0], -cc[1], suffix != "a", name))   # cubins, newest, arch-specific first
    if not fits:
        return None, f"this library holds no code for it: built for {', '.join(archs)}"
    name = min(fits)[-1]
    if name == "sm_90a":
        return name, "the wgmma verify kernel (mma.sync for a single row tile in a small launch)"
    code = name if name.startswith("sm_") else f"{name} PTX, compiled by the driver on first launch"
    return code, "the mma.sync verify kernel"


def library_archs() -> tuple[str, ...]:
    """The archs of the library the ops would load, where it is there and names them; else a
    default build's (what a first use would compile)."""
    path = loader.library_path()
    try:
        return (path.exists() and loader.build_archs(loader.load(path))) or build.DEFAULT_ARCHS
    except (OSError, RuntimeError):
        return build.DEFAULT_ARCHS


def library_line() -> str:
    path = loader.library_path()
    if os.environ.get("KDTREE_LIB"):
        source = "KDTREE_LIB"
    elif path == loader.PACKAGED_LIB:
        source = "built with the package"
    else:
        source = "JIT cache"
    if path.exists():
        try:
            so = loader.load(path)
        except (OSError, RuntimeError) as e:
            return f"library: {path} ({source}) does not load: {e}"
        archs = loader.build_archs(so)
        return f"library: {path} ({source}, C ABI {loader.ABI_VERSION}; {', '.join(archs) or 'archs unknown'})"
    if source == "KDTREE_LIB":
        return f"library: KDTREE_LIB={path}: no such file (build it with `python -m kdtree build`)"
    try:
        nvcc = build.find_nvcc()
        major, minor = build.nvcc_version(nvcc)
    except RuntimeError as e:
        return f"library: not built, and it cannot be built here: {e}"
    return (f"library: not built yet; compiled on first use into {path.parent} with {nvcc} "
            f"({major}.{minor}, about a minute)")


def gpu_lines(devices, archs=build.DEFAULT_ARCHS) -> list[str]:
    """devices: (name, (major, minor), SMs) a GPU, as torch reports them; archs: the library's."""
    if not devices:
        return ["GPU: none visible (torch.cuda); the ops need one, the references do not"]
    lines = []
    for i, (name, (major, minor), sms) in enumerate(devices):
        code, kernel = device_code(major, minor, archs)
        head = f"GPU {i}: {name}, compute capability {major}.{minor}, {sms} SMs"
        if code is None:
            lines.append(f"{head}: not supported ({kernel})")
            continue
        measured = any(m in name for m in MEASURED)
        tested = ("measured and GPU-tested on this kind (results/reference)" if measured else
                  "not run on this kind of GPU by kdtree: run the tests here before switching the kernels on")
        lines.append(f"{head}: runs {code}, {kernel}; {tested}")
    return lines


def torch_devices() -> list:
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append((p.name, (p.major, p.minor), p.multi_processor_count))
    return out


# The variables under which importing kdtree.sglang patches SGLang.
PATCH_FLAGS = ("KDTREE_SGLANG", "KDTREE_SGLANG_ATTENTION")


@contextlib.contextmanager
def _only_asking():
    """While info asks what a patch would do: the variables under which importing
    kdtree.sglang patches out of the environment and the startup hook's finders off, then
    both back."""
    saved = {f: os.environ.pop(f) for f in PATCH_FLAGS if f in os.environ}
    try:
        from .sglang.startup_hook import hook_aside   # kdtree.sglang's import: the flags are out
        with hook_aside():
            yield
    finally:
        os.environ.update(saved)


def sglang_line() -> str:
    try:
        sglang = importlib.import_module("sglang")
    except ImportError:
        return "SGLang: not installed here (kdtree.sglang.patch() switches a DDTree worker over where it is)"
    version = getattr(sglang, "__version__", "version unknown")
    with _only_asking():
        from .sglang.patch import PatchError, check_patch, imported_copies
        try:
            mod, originals = check_patch()
        except PatchError as e:
            return f"SGLang {version}: patch() would refuse: {e}"
    names = ", ".join([f"{mod.__name__}.{n}" for n in originals] +
                      [f"{m.__name__}.{n}" for m, n in imported_copies(mod, originals)])
    return f"SGLang {version}: patch() (or KDTREE_SGLANG=1) would replace {names}"


def attention_line() -> str | None:
    """What patch_attention() (KDTREE_SGLANG_ATTENTION=1) would replace, where SGLang is installed."""
    try:
        importlib.import_module("sglang")
    except ImportError:
        return None   # sglang_line says so
    with _only_asking():
        from .sglang.backend import check_attention_patch
        from .sglang.patch import PatchError
        try:
            cls, _ = check_attention_patch()
        except PatchError as e:
            return f"SGLang attention: patch_attention() would refuse: {e}"
    return (f"SGLang attention: patch_attention() (or KDTREE_SGLANG_ATTENTION=1) would replace "
            f"{cls.__module__}.{cls.__name__}.forward_extend (MLA tree verify on kdtree's kernel)")


def hook_line() -> str:
    """Whether KDTREE_SGLANG=1 alone switches a server over: the startup hook and its .pth,
    which an install from a wheel or `pip install .` puts in site-packages."""
    pth = next((pathlib.Path(d) / "kdtree-sglang.pth" for d in sys.path
                if d and (pathlib.Path(d) / "kdtree-sglang.pth").is_file()
                and (pathlib.Path(d) / "_kdtree_sglang_hook.py").is_file()), None)   # installed together
    if pth is None:
        return ("startup hook: not installed (an editable install): under KDTREE_SGLANG=1 the server must "
                "`import kdtree.sglang` itself, or call kdtree.sglang.patch()")
    return (f"startup hook: {pth} (KDTREE_SGLANG=1 in the server's environment switches the worker over "
            "when the server imports it, KDTREE_SGLANG_ATTENTION=1 the Triton backend's tree verify)")


def report(devices=None) -> list[str]:
    import torch

    from . import __version__

    py = ".".join(map(str, sys.version_info[:3]))
    return [f"kdtree {__version__}, Python {py}, torch {torch.__version__}", library_line(),
            *gpu_lines(torch_devices() if devices is None else devices, library_archs()), sglang_line(),
            *filter(None, [attention_line()]), hook_line()]
