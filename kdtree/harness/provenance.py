"""Provenance columns carried by every Parquet row (spec pipeline.md)."""
from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import json
import os
import pathlib
import platform
import socket
import subprocess
import uuid

# The project the pipeline runs in: its working directory (the checkout Snakemake runs from).
ROOT = pathlib.Path(os.environ.get("KDTREE_PROJECT_ROOT", os.getcwd())).resolve()


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


@functools.lru_cache(maxsize=1)
def _static() -> dict:
    # A copy of the tree whose .git is missing or stale (a lent GPU machine, a container)
    # is told its commit: KDTREE_GIT_COMMIT, when set, wins over what git says there, and
    # then KDTREE_GIT_DIRTY ("1") is the only dirty flag.
    # (`git rev-parse HEAD` prints "HEAD" itself where the copy has no commits: accept hex only.)
    told = os.environ.get("KDTREE_GIT_COMMIT", "")
    if told:
        commit, dirty = told, os.environ.get("KDTREE_GIT_DIRTY", "") == "1"
    else:
        head = _git("rev-parse", "HEAD")
        commit = head if len(head) == 40 and all(c in "0123456789abcdef" for c in head) else "unknown"
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    cpu = platform.processor() or ""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"git_commit": commit, "git_dirty": dirty, "host": socket.gethostname(),
            "cpu_model": cpu, "python": platform.python_version()}
    try:
        import torch
        info["torch_version"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu_name"] = torch.cuda.get_device_name(0)
            info["cuda_runtime"] = torch.version.cuda or ""
            info["driver"] = _driver_version()
        else:
            info.update(gpu_name="", cuda_runtime="", driver="")
    except ImportError:  # pragma: no cover
        info.update(torch_version="", gpu_name="", cuda_runtime="", driver="")
    return info


def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
        return out.strip().splitlines()[0] if out.strip() else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def config_hash(cfg) -> str:
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:12]


def file_hash(path) -> str:
    p = pathlib.Path(path) if path else None
    if not p or not p.exists():
        return ""
    return hashlib.sha256(p.read_bytes()).hexdigest()[:12]


def new_run_id() -> str:
    return os.environ.get("KDTREE_RUN_ID") or uuid.uuid4().hex[:12]


def provenance(run_id: str, cfg=None, library=None) -> dict:
    """Columns for one row; `library` is the kernel shared library if one was used."""
    row = dict(_static())
    row.update(run_id=run_id,
               utc_time=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               kernel_lib_hash=file_hash(library), config_hash=config_hash(cfg or {}))
    return row
