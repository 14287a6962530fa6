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
