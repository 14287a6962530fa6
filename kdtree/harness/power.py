"""Board power and SM clock while a timing runs, sampled by nvidia-smi in the background.

An H200 held at load runs at its board power limit, where the driver lowers the SM clock
(reason "SW power cap"): a kernel's time there follows its energy a call, not its cycles at
the full clock, so a short burst of replays can rank two kernels differently from a decode
loop that keeps the GPU busy (docs/kernels/verify_attention.md, session 40)."""
from __future__ import annotations

import math
import statistics
import subprocess

FIELDS = ("power.draw", "power.limit", "clocks.sm", "temperature.gpu", "clocks_event_reasons.active")
SW_POWER_CAP = 0x4
# SW power cap, HW slowdown, SW thermal, HW thermal, HW power brake (nvidia-smi -q's reasons).
SLOWDOWNS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


def parse_sample(line: str) -> dict | None:
    """One `--format=csv,noheader,nounits` line of FIELDS, or None where a field is not a number
    (nvidia-smi prints [N/A] for what a board does not report)."""
    parts = [x.strip() for x in line.split(",")]
    if len(parts) != len(FIELDS):
        return None
    try:
        return {"power_w": float(parts[0]), "power_limit_w": float(parts[1]), "sm_mhz": float(parts[2]),
                "temp_c": float(parts[3]), "reasons": int(parts[4], 16)}
    except ValueError:
        return None


def summarize_samples(samples: list[dict]) -> dict:
    """Medians of power, SM clock and temperature, the lowest clock, and the share of samples the driver
    held at the power cap (`power_capped`) or slowed for any reason (`slowed`)."""
    if not samples:
        nan = math.nan
        return {"power_w": nan, "power_limit_w": nan, "sm_mhz": nan, "sm_mhz_min": nan, "temp_c": nan,
                "power_capped": nan, "slowed": nan, "power_samples": 0}
    med = lambda k: statistics.median(s[k] for s in samples)  # noqa: E731
    return {"power_w": med("power_w"), "power_limit_w": med("power_limit_w"), "sm_mhz": med("sm_mhz"),
            "sm_mhz_min": min(s["sm_mhz"] for s in samples), "temp_c": med("temp_c"),
            "power_capped": sum(bool(s["reasons"] & SW_POWER_CAP) for s in samples) / len(samples),
            "slowed": sum(bool(s["reasons"] & SLOWDOWNS) for s in samples) / len(samples),
            "power_samples": len(samples)}


class PowerSampler:
    """`with PowerSampler() as s: ...`, then `s.summary()`: the current CUDA device's board
    sampled every `interval_ms` while the block runs. Where nvidia-smi cannot run or does not
    know the device, the summary has no samples (NaN columns), and the timing goes on."""

    def __init__(self, interval_ms: int = 100):
        self.interval_ms = interval_ms
        self.samples: list[dict] = []
        self._proc = None

    def __enter__(self):
        import torch

        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        gpu = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
        cmd = ["nvidia-smi", f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits",
               "-lms", str(self.interval_ms), "-i", gpu]
        try:
            self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self._proc = None
        return self

    def __exit__(self, *exc):
        if self._proc is None:
            return False
        self._proc.terminate()
        try:
            out, _ = self._proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, _ = self._proc.communicate()
        self.samples = [s for s in map(parse_sample, out.splitlines()) if s is not None]
        return False

    def summary(self) -> dict:
        return summarize_samples(self.samples)
