"""Facts about the local GPU and the guard that keeps sweeps off a live service's memory."""
from __future__ import annotations


class MemoryBudgetError(RuntimeError):
    """A sweep point would not fit under the configured cap or in free GPU memory."""


def cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


def ensure_fits(nbytes: int, cap_gb: float, device=None) -> None:
    """Refuse (clear message) when a point needs more than the cap or than is free now."""
    import torch

    cap = cap_gb * (1 << 30)
    if nbytes > cap:
        raise MemoryBudgetError(f"needs {nbytes / 2**30:.2f} GiB, over the gpu_mem_cap_gb "
                                f"cap of {cap_gb} GiB")
    free, _ = torch.cuda.mem_get_info(device)
    if nbytes > free:
        raise MemoryBudgetError(f"needs {nbytes / 2**30:.2f} GiB, only {free / 2**30:.2f} GiB free "
                                "on the GPU (a co-located service?)")


def measure_ceilings(nbytes: int = 1 << 31, mm: int = 8192) -> dict:
    """Device-to-device copy bandwidth (read + write) and bf16 matmul rate, measured now."""
    import torch

    from .timing import time_events

    a = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_(0, 255)
    b = torch.empty_like(a)
    copy = time_events(lambda: b.copy_(a), reps=10)
    del a, b
    x = torch.randn(mm, mm, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(mm, mm, device="cuda", dtype=torch.bfloat16)
    mmt = time_events(lambda: x @ y, reps=10)
    del x, y
    torch.cuda.empty_cache()
    return {"copy_gbps": nbytes / (copy["median_us"] * 1e-6) / 1e9,
            "bf16_tflops": 2 * mm ** 3 / (mmt["median_us"] * 1e-6) / 1e12}


_CLAIM = None  # the open lock file of the GPU this process holds


def claim_gpu(lock_dir=None) -> str | None:
    """Pin this process to one free GPU (CUDA_VISIBLE_DEVICES) on a multi-GPU node.

    Snakemake's `gpu` resource bounds how many GPU jobs run at once; this picks
    which GPU each one gets, with a lock file per GPU. Call before CUDA is initialised.
    Does nothing when CUDA_VISIBLE_DEVICES is already set or there is at most one GPU.
    """
    import fcntl
    import os
    import pathlib
    import subprocess

    global _CLAIM
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return os.environ["CUDA_VISIBLE_DEVICES"]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    n = sum(1 for ln in out.splitlines() if ln.startswith("GPU "))
    if n <= 1:
        return None
    from .provenance import ROOT
    lock_dir = pathlib.Path(lock_dir or ROOT / "build" / "gpu_locks")
    lock_dir.mkdir(parents=True, exist_ok=True)
    while True:
        for i in range(n):
            f = open(lock_dir / f"gpu{i}.lock", "w")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.close()
                continue
            _CLAIM = f
            os.environ["CUDA_VISIBLE_DEVICES"] = str(i)
            return str(i)
        import time
        time.sleep(1.0)   # more GPU jobs than GPUs: wait for one to finish
