"""Packaging with the CUDA kernels: their sources travel in the package (kdtree/_kernels),
and where nvcc is present the library is compiled at install time (kdtree/_lib), so an
installed kdtree never reads a checkout. Without nvcc (or with KDTREE_BUILD_KERNELS=0) the
library is compiled on first use into the per-user cache instead (kdtree/loader.py).
A wheel built where nvcc is (`pip wheel --no-deps .`) carries the library to nodes without it."""
import importlib.util
import os
import pathlib
import shutil
import sys

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).resolve().parent
PTH_LINE = ('import os; "1" in (os.environ.get("KDTREE_SGLANG"), os.environ.get("KDTREE_SGLANG_ATTENTION")) '
            'and __import__("_kdtree_sglang_hook").install()')


class BuildPy(build_py):
    def run(self):
        super().run()
        pkg = pathlib.Path(self.build_lib) / "kdtree"
        # build/ outlives a build: a library left there by the last one must not ship with
        # these sources (same C ABI, older kernels), so only this run's build puts one back.
        shutil.rmtree(pkg / "_lib", ignore_errors=True)
        shutil.rmtree(pkg / "_kernels", ignore_errors=True)
        shutil.copytree(ROOT / "kernels", pkg / "_kernels", ignore=shutil.ignore_patterns("*.md"))
        # The startup hook of KDTREE_SGLANG=1 and KDTREE_SGLANG_ATTENTION=1: a top-level module that imports nothing heavy, and the
        # .pth line that installs it at interpreter start (kdtree/sglang/startup_hook.py).
        shutil.copy2(ROOT / "kdtree" / "sglang" / "startup_hook.py", pkg.parent / "_kdtree_sglang_hook.py")
        (pkg.parent / "kdtree-sglang.pth").write_text(PTH_LINE + "\n")
        # The config schema: `kdtree sweep --cfg-json` checks against it (kdtree/harness/config.py).
        (pkg / "_schema").mkdir(exist_ok=True)
        shutil.copy2(ROOT / "workflow" / "schemas" / "config.schema.yaml", pkg / "_schema")
        if os.environ.get("KDTREE_BUILD_KERNELS", "1") == "0":
            print("kdtree: KDTREE_BUILD_KERNELS=0: the kernels compile on first use", file=sys.stderr)
            return
        # kdtree/build.py alone (the package imports torch, which a build environment lacks).
        spec = importlib.util.spec_from_file_location("_kdtree_build", ROOT / "kdtree" / "build.py")
        kbuild = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(kbuild)
        try:
            kbuild.find_nvcc()
        except RuntimeError as e:
            print(f"kdtree: {e}; the kernels compile on first use instead", file=sys.stderr)
            return
        lib = kbuild.build(pathlib.Path(self.get_finalized_command("build").build_temp) / "kernels")
        (pkg / "_lib").mkdir(exist_ok=True)
        shutil.copy2(lib, pkg / "_lib" / lib.name)


class BinaryDistribution(Distribution):
    def has_ext_modules(self):  # a platform wheel: it may hold libkdtree.so
        return True


class BdistWheel(bdist_wheel):
    """Tagged py3-none-<platform>: libkdtree links neither Python nor torch (a C ABI loaded by
    ctypes, cudart static), so one wheel serves every CPython >= 3.11 and torch >= 2.11."""

    def get_tag(self):
        return "py3", "none", super().get_tag()[2]


setup(cmdclass={"build_py": BuildPy, "bdist_wheel": BdistWheel}, distclass=BinaryDistribution)
