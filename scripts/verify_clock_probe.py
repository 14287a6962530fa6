"""Whether timing kdtree and FlashMLA in alternating replays hands each one the SM clock the
other left: per shape, both calls captured once (the verify sweep's inputs: runs tables,
rotating cache copies, page 64), then replayed in blocks (K x n, F x n, F x n, K x n) and
one at a time (K F, F K, ...), each replay timed by CUDA events with the SM clock read
through NVML before it is launched and after it ends (on the H200 that reading held one value
over tens of replays: the times, not the clock column, carry the result). One Parquet row a
replay.

    python3 scripts/verify_clock_probe.py OUT.parquet [--replays 20]
"""
import argparse
import ctypes

import pandas as pd
import torch

from kdtree.harness.sweeps.verify_attn import peer_calls, require_flashmla
from kdtree.harness.timing import capture_graph

# (batch, D, heads, prefix): power-capped compute-bound shapes, one memory-bound, batch 1.
SHAPES = [(16, 64, 16, 32768), (16, 64, 64, 8192), (16, 64, 8, 8192), (16, 16, 16, 32768), (16, 1, 8, 32768),
          (1, 16, 16, 8192)]
SCALE = 0.130861
NVML_CLOCK_SM = 1


class SmClock:
    """The current SM clock (MHz) of GPU 0 by NVML, which ships with the driver."""

    def __init__(self):
        self.nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if self.nvml.nvmlInit_v2() != 0:
            raise SystemExit("verify_clock_probe: nvmlInit failed")
        self.handle = ctypes.c_void_p()
        self.nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.handle))
        self.mhz = ctypes.c_uint()

    def __call__(self) -> int:
        self.nvml.nvmlDeviceGetClockInfo(self.handle, NVML_CLOCK_SM, ctypes.byref(self.mhz))
        return self.mhz.value


def sequences(n: int) -> dict:
    return {"blocks": "K" * n + "F" * n + "F" * n + "K" * n,
            "alternating": "".join("KF" if r % 2 == 0 else "FK" for r in range(n))}


def probe_shape(fm, clock, B, D, H, P, n) -> list[dict]:
    kdtree_call, fcalls, inner = peer_calls(fm, B, D, H, P, SCALE)
    graphs = {"K": capture_graph(kdtree_call(), inner=inner)[0], "F": capture_graph(fcalls(), inner=inner)[0]}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rows = []
    for mode, seq_ in sequences(n).items():
        for g in graphs.values():
            g.replay()
        torch.cuda.synchronize()
        for i, who in enumerate(seq_):
            before = clock()
            start.record()
            graphs[who].replay()
            end.record()
            end.synchronize()
            rows.append(dict(batch=B, D=D, heads=H, prefix=P, mode=mode, i=i,
                             impl="kdtree_kernel" if who == "K" else "flashmla",
                             us=start.elapsed_time(end) * 1e3 / inner, mhz_before=before, mhz_after=clock()))
    return rows


def main():
    a = argparse.ArgumentParser()
    a.add_argument("out")
    a.add_argument("--replays", type=int, default=20)
    args = a.parse_args()
    fm = require_flashmla("verify_clock_probe")
    clock, rows = SmClock(), []
    for (B, D, H, P) in SHAPES:
        shape_rows = probe_shape(fm, clock, B, D, H, P, args.replays)
        rows += shape_rows
        d = pd.DataFrame(shape_rows)
        print(B, D, H, P, d.groupby(["mode", "impl"])[["us", "mhz_before", "mhz_after"]].median().round(1).to_dict(),
              flush=True)
        torch.cuda.empty_cache()
    pd.DataFrame(rows).to_parquet(args.out, index=False)


if __name__ == "__main__":
    main()
