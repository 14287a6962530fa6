"""What a GPU node without PyPI needs to run the pipeline with its peers (the lent H200 that
measures the reference set): wheels for the harness and Snakemake, FlashMLA's wheel, and
SGLang's Triton tree verify as the files its import loads, since SGLang will not install
there. Run it where PyPI answers, with torch importable:

    python3 scripts/offline_peers.py OUT [--python 3.12] [--node-has DIST ...]

It writes OUT/wheels/ (wheels for the node's Python, manylinux x86_64), OUT/sglang/ (the
modules `import sglang.kernels.ops.attention.extend_attention` loads, copied unmodified from
the sglang wheel) and OUT/manifest.json (every file's sha256, the sglang wheel's, and what
the import needed). On the node:

    pip install --no-index --no-deps --target SITE OUT/wheels/*.whl
    PYTHONPATH=SITE:OUT/sglang snakemake --profile workflow/profiles/local all --configfile config/reference.yaml

The SGLang import is resolved here: a module it names that is not installed is fetched
(--no-deps, into a scratch folder) and the import tried again; every distribution outside
the standard library that the import then loads, less the node's own torch / triton /
numpy, gets its wheel and its dependencies' wheels.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

SGLANG = "sglang==0.5.23"
KERNEL_MODULE = "sglang.kernels.ops.attention.extend_attention"
HARNESS = ["jsonschema", "tqdm", "pyyaml"]
SNAKEMAKE = ["snakemake==9.27.1"]
FLASHMLA = "sgl-flash-mla==1.0.0"
NODE_HAS = {"torch", "triton", "numpy", "nvidia-ml-py"}  # the node's own builds, never shadowed
# Import names whose distribution is named otherwise, for a module that is missing here.
DIST_OF = {"zmq": "pyzmq", "yaml": "pyyaml", "PIL": "pillow", "IPython": "ipython"}

# Run in a child process: the import, then what it loaded (files under `root`, and the
# distributions of every module outside the standard library), as JSON on stdout.
PROBE = r"""
import importlib, importlib.metadata, json, sys, sysconfig
root, name = sys.argv[1], sys.argv[2]
std = sysconfig.get_paths()["stdlib"]
try:
    importlib.import_module(name)
except ModuleNotFoundError as e:
    print(json.dumps({"missing": e.name})); sys.exit(0)
dists = importlib.metadata.packages_distributions()
files, needs = set(), set()
for mod in list(sys.modules.values()):
    f = getattr(mod, "__file__", None) or ""
    if f.startswith(root):
        files.add(f[len(root):].lstrip("/"))
    elif f and not f.startswith(std):
        needs.update(dists.get(mod.__name__.split(".")[0], []))
print(json.dumps({"files": sorted(files), "needs": sorted(needs)}))
"""


def probe(module: str, root: pathlib.Path, path: list[pathlib.Path], python: str = sys.executable) -> dict:
    """Import `module` in a child process with `root` and `path` first on sys.path: {"missing":
    name} where a module is not found, else {"files": paths under root, "needs": the other
    non-standard distributions it loaded}."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in [root, *path]))
    r = subprocess.run([python, "-c", PROBE, str(root), module], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"importing {module} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def resolve(module: str, root: pathlib.Path, scratch: pathlib.Path, fetch, tries: int = 40) -> dict:
    """probe() until the import succeeds, fetching each missing module's distribution into
    `scratch` with fetch(dist, scratch)."""
    for _ in range(tries):
        got = probe(module, root, [scratch])
        if "missing" not in got:
            return got
        top = got["missing"].split(".")[0]
        fetch(DIST_OF.get(top, top), scratch)
    raise RuntimeError(f"{module}: still missing modules after {tries} fetches")


def norm(dist: str) -> str:
    """A distribution's name as compared here (wheel files write - as _)."""
    return dist.lower().replace("_", "-")


def skip(dist: str) -> bool:
    """Whether the node's own install provides `dist` (never shadowed by a carried wheel)."""
    d = norm(dist)
    return d in NODE_HAS or d.startswith("nvidia-")


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True)


def sha256(p: pathlib.Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=pathlib.Path, help="folder to write (must not exist)")
    ap.add_argument("--python", default="3.12", help="the node's Python version")
    ap.add_argument("--node-has", nargs="*", default=[], metavar="DIST",
                    help="distributions the node already has (their wheels are left out)")
    a = ap.parse_args()
    NODE_HAS.update(map(norm, a.node_has))
    if a.out.exists():
        ap.error(f"out: {a.out} exists; name a new folder")
    target = ["--only-binary=:all:", "--python-version", a.python, "--implementation", "cp",
              "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64",
              "--platform", "manylinux_2_28_x86_64"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        wheels, stage = tmp / "wheels", tmp / "stage"
        wheels.mkdir()
        # SGLang: the wheel unpacked, then the files its kernel's import loads.
        pip("download", "--no-deps", "-d", str(tmp / "sgl"), SGLANG)
        sgl_wheel = next((tmp / "sgl").glob("sglang-*.whl"))
        zipfile.ZipFile(sgl_wheel).extractall(tmp / "sglw")
        fetch = lambda dist, where: pip("install", "--no-deps", "--target", str(where), dist)
        got = resolve(KERNEL_MODULE, tmp / "sglw", tmp / "deps", fetch)
        for rel in got["files"]:
            dst = stage / "sglang" / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(tmp / "sglw" / rel, dst)
        needs = sorted(d for d in got["needs"] if not skip(d) and norm(d) != "sglang")
        # Snakemake 9 asks for connection_pool, which PyPI has as a source archive only.
        pip("download", "--no-deps", "--no-binary=:all:", "-d", str(tmp / "src"), "connection_pool>=0.0.3")
        pip("wheel", "--no-deps", "-w", str(wheels), *map(str, (tmp / "src").iterdir()))
        pip("download", "-d", str(wheels), "--find-links", str(wheels), *target, *HARNESS, *SNAKEMAKE, *needs)
        pip("download", "--no-deps", "-d", str(wheels), *target, FLASHMLA)
        for w in list(wheels.glob("*.whl")):
            if skip(w.name.split("-")[0]):
                w.unlink()
        shutil.copytree(wheels, stage / "wheels")
        files = {str(p.relative_to(stage)): sha256(p) for p in sorted(stage.rglob("*")) if p.is_file()}
        (stage / "manifest.json").write_text(json.dumps(
            {"sglang_wheel": {sgl_wheel.name: sha256(sgl_wheel)}, "kernel_module": KERNEL_MODULE,
             "sglang_needs": needs, "python": a.python, "files": files}, indent=1) + "\n")
        shutil.move(str(stage), str(a.out))  # whole or not at all
    n_sgl = sum(1 for k in files if k.startswith("sglang/"))
    print(f"{a.out}: {len(files) - n_sgl} wheels, {n_sgl} SGLang files ({sgl_wheel.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
