"""Whole-step breakdown: a live service's verify step against the kernel sweeps (Amdahl).

Today a DDTree step spends, per verify step, the CPU tree build and the CPU accept
walk inside the measured step time; with the GPU kernels those two become their
device times. Everything else in the step (the target forward, the drafter,
sampling, scheduling) is unchanged: the projection is labelled as such.

A second projection adds KDTREE_SGLANG_ATTENTION=1: where the service verifies with SGLang's
Triton kernel, each of the model's attention layers takes the verify sweep's Triton time,
which kdtree's replaces (page size 1, SGLang's pool). The probe reads the server's attention
backends and tensor parallelism from /server_info where it reports them: a backend other than
Triton draws no bar; one unreported is assumed Triton, and the model's shape is assumed K2's,
each said in the notes; where the Triton layers alone would outlast the measured step, the
service does not verify that way and no bar is drawn.
"""
from __future__ import annotations

import json
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


# The model the verify-attention projection assumes: Kimi K2 (DeepSeek-V3's shape: 61 MLA
# layers, 64 heads), over tensor parallelism 8 where the server does not report its own.
LAYERS, HEADS, TP = 61, 64, 8
# The context a verify step attends to where the probe recorded no lengths.
DEFAULT_CONTEXT = 8192


def _verify_rows(d: pd.DataFrame | None, impl: str) -> pd.DataFrame:
    """Verify-sweep rows of `impl` at page size 1 (SGLang's pool), timed."""
    if d is None or d.empty or "impl" not in d:
        return pd.DataFrame()
    return d[(d.impl == impl) & (d.page_size == 1) & d.median_us.notna()]


def _context(rd: pathlib.Path, notes: list) -> int:
    """The tokens a verify step attends to: the probe's median prompt plus half its median
    completion (a decode's average depth)."""
    req = read_ok_rows(rd / "probe.parquet")
    if req is None or "prompt_tokens" not in req or req.prompt_tokens.isna().all():
        notes.append(f"no prompt lengths from the probe: a context of {DEFAULT_CONTEXT} tokens assumed")
        return DEFAULT_CONTEXT
    done = req.completion_tokens.median() if "completion_tokens" in req else 0
    return int(req.prompt_tokens.median() + (0 if pd.isna(done) else done) / 2)


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
        rows += _attention_rows(rd, kernel_times_dir, s, batch, budget, rest, rows[-2:], notes)
    t = pd.DataFrame(rows, columns=["scenario", "component", "ms"])
    t["batch"], t["budget"], t["verify_step_ms"] = batch, budget, step
    t["notes"] = "; ".join(notes)
    return t


def _served_by(probe: pd.Series) -> tuple[dict, int | None]:
    """The server's attention backends and tensor parallelism, as the probe read them."""
    try:
        backends = json.loads(probe.get("attention_backends") or "{}")
    except (TypeError, ValueError):
        backends = {}
    tp = probe.get("tp_size")
    return (backends if isinstance(backends, dict) else {}), (int(tp) if pd.notna(tp) and tp else None)


def _attention_rows(rd, kernel_times_dir, probe: pd.Series, batch: int, budget: int, rest: float, kernels: list,
                    notes: list):
    """The projection with KDTREE_SGLANG_ATTENTION=1 as well: the rest of the step less
    LAYERS layers of SGLang's Triton tree verify, plus as many of kdtree's (verify sweep rows
    of this run, else of `kernel_times_dir`), beside the GPU build and accept (`kernels`)."""
    backends, tp = _served_by(probe)
    if backends and "triton" not in backends.values():
        notes.append(f"the server reports attention backends {backends}: not SGLang's Triton kernel, so no "
                     "KDTREE_SGLANG_ATTENTION bar")
        return []
    va = read_ok_rows(rd / "verify_attn.parquet")
    source = "this run"
    if _verify_rows(va, "sglang_triton").empty and kernel_times_dir:
        va = read_ok_rows(pathlib.Path(kernel_times_dir) / "verify_attn.parquet")
        source = str(kernel_times_dir)
    if va is None:
        return []   # no verify sweep here or in the fallback: nothing to project
    triton, ours = _verify_rows(va, "sglang_triton"), _verify_rows(va, "kdtree_kernel")
    if triton.empty or ours.empty:
        notes.append("no verify sweep rows of SGLang's Triton kernel and kdtree's at page size 1: "
                     "no KDTREE_SGLANG_ATTENTION projection")
        return []
    P = _context(pathlib.Path(rd), notes)
    heads = HEADS // (tp or TP)
    want = dict(batch=batch, D=budget + 1, heads=heads, prefix=P)
    t = _pick(triton, "SGLang's Triton verify", notes, **want)
    k = _pick(ours, "kdtree's verify", notes, **want)
    triton_ms, ours_ms = LAYERS * t.median_us / 1e3, LAYERS * k.median_us / 1e3
    how = "reported by the server" if backends else "assumed: the server reports no attention backend"
    over = f"TP {tp}, reported" if tp else f"TP {TP} assumed"
    notes.append(f"KDTREE_SGLANG_ATTENTION projection: SGLang's Triton verify ({how}), {LAYERS} layers of "
                 f"{heads} heads a GPU (K2's {HEADS} heads, {over}), verify times from {source}")
    if triton_ms > rest:
        notes.append(f"{LAYERS} layers of SGLang's Triton verify ({triton_ms:.3g} ms) outlast the rest of the "
                     f"measured step ({rest:.3g} ms): this service does not verify with it (another backend, or "
                     "another shape); no KDTREE_SGLANG_ATTENTION bar")
        return []
    proj = "projected: + verify attention on kdtree; KDTREE_SGLANG_ATTENTION=1"
    return [(proj, "rest of step, less verify attention", rest - triton_ms),
            (proj, f"verify attention (kdtree, {LAYERS} layers)", ours_ms)] + \
        [(proj, component, ms) for _, component, ms in kernels]
