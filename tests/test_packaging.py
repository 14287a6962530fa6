"""The wheel a user builds once and installs on many nodes: one tag for every CPython (the
library has a C ABI and links neither Python nor torch), the kernel sources and the config
schema inside, and never a library a previous build left in build/."""
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _checkout_copy(dest: pathlib.Path) -> pathlib.Path:
    """What setup.py reads, copied, so the test neither reads nor leaves the checkout's build/."""
    dest.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    skip = shutil.ignore_patterns("__pycache__", "_lib", "*.egg-info")
    shutil.copytree(ROOT / "kdtree", dest / "kdtree", ignore=skip)
    shutil.copytree(ROOT / "kernels", dest / "kernels", ignore=skip)
    shutil.copytree(ROOT / "workflow" / "schemas", dest / "workflow" / "schemas")
    return dest


def test_wheel_is_for_every_python_and_never_ships_a_stale_library(tmp_path):
    src = _checkout_copy(tmp_path / "src")
    # What an earlier build with nvcc leaves where setuptools builds (build/lib.<platform>-<tag>).
    lib_dir = f"lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
    stale = src / "build" / lib_dir / "kdtree" / "_lib" / "libkdtree.so"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"an older build")
    out = tmp_path / "dist"
    env = dict(os.environ, KDTREE_BUILD_KERNELS="0")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    assert wheels[0].name.endswith(f"-py3-none-{platform}.whl"), wheels[0].name
    names = set(zipfile.ZipFile(wheels[0]).namelist())
    assert not any("/_lib/" in n for n in names), sorted(n for n in names if "_lib" in n)
    assert "kdtree/_kernels/include/kdtree.h" in names
    assert "kdtree/_kernels/src/tree_build.cu" in names
    assert "kdtree/_schema/config.schema.yaml" in names
    assert not any(n.endswith(".md") for n in names if n.startswith("kdtree/_kernels/"))
