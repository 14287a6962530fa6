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


def nvidia_smi_gpus() -> list[str] | None:
    """The GPU indices `nvidia-smi -L` lists, or None where it cannot run."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [str(i) for i, _ in enumerate(x for x in out.splitlines() if x.startswith("GPU "))]


def claim_gpu(lock_dir=None) -> str | None:
    """Give this process a GPU of its own (sets CUDA_VISIBLE_DEVICES); call before CUDA starts.

    Snakemake runs GPU jobs side by side; a lock file per GPU makes each job take a
    free one, and wait while all are taken, so two timed jobs never share a GPU (on a
    one-GPU machine they run one after the other). Under SLURM the allocation is
    already exclusive and is kept as it is.
    """
    import fcntl
    import os
    import pathlib
    import time

    global _CLAIM
    if os.environ.get("SLURM_JOB_ID") and os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return os.environ["CUDA_VISIBLE_DEVICES"]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        candidates = [visible]           # the user chose the GPU(s): serialise on that choice
    else:
        candidates = nvidia_smi_gpus()
        if not candidates:
            return None
    from .provenance import ROOT
    lock_dir = pathlib.Path(lock_dir or ROOT / "build" / "gpu_locks")
    lock_dir.mkdir(parents=True, exist_ok=True)
    while True:
        for c in candidates:
            f = open(lock_dir / f"gpu{c.replace(',', '_')}.lock", "w")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.close()
                continue
            _CLAIM = f                     # held until the process exits
            os.environ["CUDA_VISIBLE_DEVICES"] = c
            import socket
            import sys
            # The job log says where it ran (a multi-GPU run is checked from these lines).
            print(f"kdtree: pinned to GPU {c} of {socket.gethostname()} (lock {f.name})", file=sys.stderr, flush=True)
            return c
        time.sleep(1.0)
