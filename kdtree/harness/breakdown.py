"""Whole-step breakdown: a live service's verify step against the kernel sweeps (Amdahl).

Today a DDTree step spends, per verify step, the CPU tree build and the CPU accept
walk inside the measured step time; with the GPU kernels those two become their
device times. Everything else in the step (the target forward, the drafter,
sampling, scheduling) is unchanged: the projection is labelled as such.
"""
from __future__ import annotations

import pathlib

import pandas as pd

from .results import read_ok_rows


def _nearest(df: pd.DataFrame, **want) -> pd.Series | None:
    if df.empty:
        return None
    d = df.copy()
    d["_dist"] = sum(((d[k] - v).abs() / max(v, 1)) for k, v in want.items())
    return d.sort_values("_dist").iloc[0]


def _gpu_rows(d: pd.DataFrame | None, **sel) -> pd.DataFrame:
    if d is None or d.empty:
        return pd.DataFrame()
    m = d.impl == "gpu_kernel"
    for k, v in sel.items():
        m &= d[k] == v
    return d[m]


def _accept_kernel(d: pd.DataFrame | None) -> pd.DataFrame:
    """GPU accept rows: the parents kernel (the round's) where the sweep has it."""
    if d is None or d.empty:
        return pd.DataFrame()
    impl = "gpu_kernel_parents" if (d.impl == "gpu_kernel_parents").any() else "gpu_kernel"
    return d[d.impl == impl]


def _typical_draft(d: pd.DataFrame | None) -> pd.DataFrame | None:
    """Accept rows at the sweep's highest follow rate (a draft that is mostly right)."""
    if d is None or "follow" not in d:
        return d
    return d[d.follow == d.follow.max()]


def _typical_tree(d: pd.DataFrame | None) -> pd.DataFrame | None:
    """Build rows from the confident drafter where the sweep has them (a draft that is mostly
    right, as for the accept rows); older runs have only the mixed drafts."""
    if d is None or "drafts" not in d or not (d.drafts == "confident").any():
        return d
    return d[d.drafts == "confident"]


def _pick(df: pd.DataFrame, what: str, notes: list, **want) -> pd.Series | None:
    """The row at exactly `want`, else the nearest one with a note saying which was taken."""
    row = _nearest(df, **want)
    if row is not None and any(row[k] != v for k, v in want.items()):
        got = ", ".join(f"{k} {row[k]:g}" for k in want)
        asked = ", ".join(f"{k} {v:g}" for k, v in want.items())
        notes.append(f"{what} timed at {got} (no row at {asked})")
    return row


def breakdown_table(results_dir, kernel_times_dir=None) -> pd.DataFrame | None:
    """Probe summary + this run's sweeps; GPU kernel times from `kernel_times_dir` (e.g. the
    committed H200 reference set) when this run has none (a CPU-only machine). Every
    assumption and mismatch is a line of the `notes` column (one string, '; '-joined)."""
    rd = pathlib.Path(results_dir)
    probe = read_ok_rows(rd / "probe_summary.parquet")
    tree = _typical_tree(read_ok_rows(rd / "tree_build.parquet"))
    if probe is None or tree is None or "verify_step_ms" not in probe:
        return None
    probe = probe[probe.verify_step_ms.notna()]
    if probe.empty:
        return None
    s = probe.iloc[-1]
    notes: list[str] = []
    batch, budget = int(s.get("concurrency", 1) or 1), int(s.get("tree_budget", 0) or 0)
    if budget <= 0:
        budget = 64
        notes.append("the server reported no tree budget (speculative_num_draft_tokens): 64 assumed")
    acc = _typical_draft(read_ok_rows(rd / "tree_accept.parquet"))
    gpu_tree = _gpu_rows(tree, metric="device_time")
    gpu_acc = _accept_kernel(acc)
    source = "this run"
    if gpu_tree.empty and kernel_times_dir and (pathlib.Path(kernel_times_dir) / "tree_build.parquet").exists():
        kt = pathlib.Path(kernel_times_dir)
        gpu_tree = _gpu_rows(_typical_tree(read_ok_rows(kt / "tree_build.parquet")), metric="device_time")
        gpu_acc = _accept_kernel(_typical_draft(read_ok_rows(kt / "tree_accept.parquet")))
        names = sorted(set(gpu_tree.get("gpu_name", pd.Series(dtype=str)).dropna()))
        source = f"{kt} ({', '.join(names) or 'GPU'})"
    # The accept walks a tree of budget + 1 slots (the root and the budget's nodes).
    cpu = _pick(tree[tree.impl == "cpu_heapq"], "CPU build", notes, batch=batch, budget=budget)
    gpu = _pick(gpu_tree, "GPU build", notes, batch=batch, budget=budget)
    acc_cpu = _pick(acc[acc.impl == "cpu_walk"], "CPU accept walk", notes, batch=batch, D=budget + 1) \
        if acc is not None else None
    acc_gpu = _pick(gpu_acc, "GPU accept", notes, batch=batch, D=budget + 1)
    step = float(s.verify_step_ms)
    build_cpu = cpu.median_us / 1e3 if cpu is not None else 0.0
    walk_cpu = acc_cpu.median_us / 1e3 if acc_cpu is not None else 0.0
    if cpu is None:
        notes.append("no CPU build row: the step's CPU build counted as 0")
    if acc_cpu is None:
        notes.append("no CPU accept-walk row: the step's walk counted as 0")
    rest = step - build_cpu - walk_cpu
    if rest < 0:
        notes.append(f"the CPU build + walk ({build_cpu + walk_cpu:.3g} ms, from the sweeps) exceed the probe's "
                     f"measured step ({step:.3g} ms): the two were measured on different machines or loads; "
                     "'rest of step' shown as 0, so the bar is longer than the measured step")
        rest = 0.0
    now = "measured step (probe) with CPU build + walk"
    rows = [(now, "rest of step", rest), (now, "tree build (CPU)", build_cpu),
            (now, "accept walk (CPU)", walk_cpu)]
    if gpu is not None:
        proj = f"projected: GPU kernels (Amdahl; kernel times from {source})"
        if acc_gpu is None:
            notes.append("no GPU accept row: the projection keeps the CPU walk")
        rows += [(proj, "rest of step", rest), (proj, "tree build (GPU)", gpu.median_us / 1e3),
                 (proj, "accept (GPU)", acc_gpu.median_us / 1e3 if acc_gpu is not None else walk_cpu)]
    t = pd.DataFrame(rows, columns=["scenario", "component", "ms"])
    t["batch"], t["budget"], t["verify_step_ms"] = batch, budget, step
    t["notes"] = "; ".join(notes)
    return t
