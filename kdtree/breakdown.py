"""Whole-step breakdown: a live service's verify step against the kernel sweeps (Amdahl).

Today a DDTree step spends, per verify step, the CPU tree build and the CPU accept
walk inside the measured step time; with the GPU kernels those two become their
device times. Everything else in the step (the target forward, the drafter,
sampling, scheduling) is unchanged: the projection is labelled as such.
"""
from __future__ import annotations

import pathlib

import pandas as pd


def _nearest(df: pd.DataFrame, **want) -> pd.Series | None:
    if df.empty:
        return None
    d = df.copy()
    d["_dist"] = sum(((d[k] - v).abs() / max(v, 1)) for k, v in want.items())
    return d.sort_values("_dist").iloc[0]


def breakdown_table(results_dir) -> pd.DataFrame | None:
    rd = pathlib.Path(results_dir)
    probe_p, tree_p, acc_p = rd / "probe_summary.parquet", rd / "tree_build.parquet", rd / "tree_accept.parquet"
    if not (probe_p.exists() and tree_p.exists()):
        return None
    probe = pd.read_parquet(probe_p)
    probe = probe[probe.verify_step_ms.notna()] if "verify_step_ms" in probe else probe.iloc[0:0]
    if probe.empty:
        return None
    s = probe.iloc[-1]
    batch, budget = int(s.get("concurrency", 1) or 1), int(s.get("tree_budget", 0) or 0)
    tree = pd.read_parquet(tree_p)
    tree = tree[tree.status == "ok"]
    if budget <= 0:  # the server did not say: use the sweep's closest budget to a common 64
        budget = 64
    rows = []
    cpu = _nearest(tree[tree.impl == "cpu_heapq"], batch=batch, budget=budget)
    gpu = _nearest(tree[(tree.impl == "gpu_kernel") & (tree.metric == "device_time")], batch=batch, budget=budget)
    acc_cpu = acc_gpu = None
    if acc_p.exists():
        acc = pd.read_parquet(acc_p)
        acc = acc[acc.status == "ok"]
        acc_cpu = _nearest(acc[acc.impl == "cpu_walk"], batch=batch, D=budget + 1)
        acc_gpu = _nearest(acc[acc.impl == "gpu_kernel"], batch=batch, D=budget + 1)
    step = float(s.verify_step_ms)
    build_cpu = cpu.median_us / 1e3 if cpu is not None else 0.0
    walk_cpu = acc_cpu.median_us / 1e3 if acc_cpu is not None else 0.0
    rest = max(step - build_cpu - walk_cpu, 0.0)
    rows += [("measured step (probe) with CPU build + walk", "rest of step", rest),
             ("measured step (probe) with CPU build + walk", "tree build (CPU)", build_cpu),
             ("measured step (probe) with CPU build + walk", "accept walk (CPU)", walk_cpu)]
    if gpu is not None:
        rows += [("projected: GPU kernels (Amdahl)", "rest of step", rest),
                 ("projected: GPU kernels (Amdahl)", "tree build (GPU)", gpu.median_us / 1e3),
                 ("projected: GPU kernels (Amdahl)", "accept (GPU)",
                  acc_gpu.median_us / 1e3 if acc_gpu is not None else walk_cpu)]
    t = pd.DataFrame(rows, columns=["scenario", "component", "ms"])
    t["batch"], t["budget"], t["verify_step_ms"] = batch, budget, step
    return t
