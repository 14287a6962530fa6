"""Seaborn figures, a function of the Parquet files alone (no GPU, no kernels needed)."""
from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from .figure_names import BREAKDOWN, PER_PARQUET, default_folder  # noqa: E402
from .results import flashmla_ratio, ok_rows, sustained_ratio  # noqa: E402
from .sweeps.tree_accept import DEFAULT_FOLLOW_RATES  # noqa: E402
from .targets import ACCEPT_TARGET_US  # noqa: E402


def _gpu_label(df: pd.DataFrame) -> str:
    names = sorted({g for g in df.get("gpu_name", pd.Series(dtype=str)).fillna("") if g})
    return ", ".join(names) if names else "no GPU"


def _save(fig, path):
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(path)


def _batch_hue(d: pd.DataFrame) -> dict:
    """Batch as a categorical hue, one distinct colour each (a numeric hue put 1, 4 and 16
    on nearly one colour beside 256)."""
    order = [str(b) for b in sorted(d.batch.unique())]
    return dict(hue=d.batch.astype(str).rename("batch"), hue_order=order,
                palette=sns.color_palette("viridis", n_colors=max(len(order), 1)))


def _legend_outside(ax, **kw):
    """The legend beside the axes, where it cannot cover data."""
    if ax.get_legend() is not None:
        sns.move_legend(ax, "upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, **kw)


def _placeholder(path, title: str, why: str):
    fig, ax = plt.subplots(figsize=(6, 2))
    ax.axis("off")
    ax.text(0.5, 0.6, title, ha="center", fontsize=12, weight="bold")
    ax.text(0.5, 0.3, why, ha="center", fontsize=9, wrap=True)
    _save(fig, path)


def tree_build(df: pd.DataFrame, path):
    d = ok_rows(df)
    if d.empty:
        return _placeholder(path, "Tree build", "no measured rows")
    # One row of panels a draft kind (sweep_tree_build.drafts); older runs have no column.
    kinds = sorted(d.drafts.dropna().unique()) if "drafts" in d else [None]
    gpu_any = bool(((d.impl == "gpu_kernel") & (d.metric == "device_time")).any())
    panels = 2 if gpu_any else 1   # a CPU-only run has no speedup to show
    fig, axes = plt.subplots(len(kinds), panels, figsize=(7 * panels, 4.2 * len(kinds)), squeeze=False,
                             sharey="col")  # kinds compared on one scale
    for row, kind in zip(axes, kinds):
        _tree_build_row(d if kind is None else d[d.drafts == kind], row, kind, gpu_any)
    L = f"L={int(df['L'].iloc[0])}, " if "L" in df else ""
    fig.suptitle(f"DDTree build, {L}{_gpu_label(df)}")
    fig.tight_layout()
    _save(fig, path)


def _tree_build_row(d: pd.DataFrame, axes, kind, gpu_any: bool):
    cpu = d[d.impl == "cpu_heapq"][["batch", "budget", "median_us"]]
    gpu = d[(d.impl == "gpu_kernel") & (d.metric == "device_time")][["batch", "budget", "median_us"]]
    lat = d[(d.impl == "gpu_kernel") & (d.metric == "caller_latency")][["batch", "budget", "median_us"]]
    # The build with the dense mask too (sweep_tree_build.dense_visibility): what the SGLang drop-in runs.
    dense = d[(d.impl == "gpu_kernel_dense") & (d.metric == "device_time")][["batch", "budget", "median_us"]]
    of = f" ({kind} drafts)" if kind else ""
    long = pd.concat([cpu.assign(impl="CPU heapq (reference)"), gpu.assign(impl="GPU kernel, device time"),
                      dense.assign(impl="GPU kernel + dense mask (SGLang drop-in), device time"),
                      lat.assign(impl="GPU kernel, caller latency")]).rename(columns={"impl": "time"})
    sns.lineplot(long, x="budget", y="median_us", style="time", marker="o", ax=axes[0], **_batch_hue(long))
    axes[0].set(xscale="log", yscale="log", ylabel="time per batch (us)",
                title="Tree build time" + of + ("" if gpu_any else " (CPU only: no CUDA device in this run)"))
    _legend_outside(axes[0])
    if gpu_any:
        m = cpu.merge(gpu, on=["batch", "budget"], suffixes=("_cpu", "_gpu"))
        m["speedup"] = m.median_us_cpu / m.median_us_gpu
        sns.barplot(m, x="budget", y="speedup", ax=axes[1], **_batch_hue(m))
        axes[1].set(yscale="log", ylabel="CPU time / GPU device time", title="GPU speedup over CPU build" + of)
        _legend_outside(axes[1])


# What each verify `impl` is, for legends: "kdtree_kernel" is what the library dispatches on
# the measuring GPU (wgmma on Hopper, but mma.sync for one row tile in a small launch; keys
# by TMA where the page size allows; mma.sync on other GPUs); the others are same-run A/Bs
# on the same inputs.
VERIFY_IMPLS = {"kdtree_kernel": "kdtree (dispatched kernel)",
                "kdtree_mma_sync": "kdtree, mma.sync kernel (sm_120's)",
                "kdtree_wgmma_cp_async": "kdtree, wgmma with cp.async keys (not TMA)",
                "kdtree_wgmma_combine": "kdtree, splits merged by the combine kernel",
                "torch_sdpa_tree_mask": "torch SDPA + tree mask",
                "flashmla": "FlashMLA dense decode, chain mask (peer)",
                "sglang_triton": "SGLang Triton extend attention, tree mask (peer)"}


def verify_attn(df: pd.DataFrame, path):
    d = ok_rows(df)
    if d.empty:
        return _placeholder(path, "Tree-verify attention", "no measured rows")
    if not (d.impl == "kdtree_kernel").any():  # every kdtree point failed: the peers alone say nothing
        return _placeholder(path, "Tree-verify attention", "no measured kdtree rows (see the report's failed points)")
    d = d.assign(shape=lambda x: "H" + x.heads.astype(str) + " D" + x.D.astype(str))
    peer = flashmla_ratio(d)
    if peer is not None:
        peer = peer.assign(batch=peer.batch.astype(str))  # batches as categories
    fig, axes = plt.subplots(2 + (peer is not None), 1, figsize=(11, 9.5 + 4.2 * (peer is not None)))
    k = d[d.impl == "kdtree_kernel"]
    sns.scatterplot(k, x="floor_us", y="median_us", hue="shape", style="batch", s=60, ax=axes[0])
    lo, hi = k.floor_us.min() * 0.8, max(k.median_us.max(), k.floor_us.max()) * 1.2
    axes[0].plot([lo, hi], [lo, hi], "k--", lw=1, label="roofline floor")
    axes[0].set(xscale="log", yscale="log", xlabel="roofline floor (us)", ylabel="measured (us)",
                title="Kernel time against the roofline floor")
    axes[0].legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    d = d.assign(implementation=d.impl.map(VERIFY_IMPLS).fillna(d.impl))
    sns.barplot(d, x="shape", y="roofline_fraction", hue="implementation", ax=axes[1], errorbar=None)
    axes[1].set(ylabel="floor / time (1 = at the roofline)", title="Achieved fraction, all P and B")
    axes[1].tick_params(axis="x", rotation=45)
    _legend_outside(axes[1])
    if peer is not None:
        # dodge only between batches: seaborn divides it by the batches less one
        dodge = 0.3 if peer.batch.nunique() > 1 else False
        sns.pointplot(peer, x="shape", y="ratio", hue="batch", ax=axes[2], estimator="median", errorbar=("pi", 100), dodge=dodge,
                      linestyles="none", markers="o", **{k: v for k, v in _batch_hue(peer).items() if k != "hue"})
        axes[2].axhline(1.0, color="grey", ls=":", lw=1)
        axes[2].set(ylabel="FlashMLA time / kdtree time", title="Against FlashMLA on the same inputs "
                    "(above 1: kdtree faster; points: median over P, bars: its range)")
        axes[2].tick_params(axis="x", rotation=45)
        _legend_outside(axes[2])
    fig.suptitle(f"MLA tree-verify attention, bf16 ({_gpu_label(df)})")
    fig.tight_layout()
    _save(fig, path)


ACCEPT_IMPLS = {"cpu_walk": "CPU walk (reference)", "gpu_kernel": "GPU kernel, from the links",
                "gpu_kernel_parents": "GPU kernel, from the parents"}


def tree_accept(df: pd.DataFrame, path):
    d = ok_rows(df)
    if d.empty:
        return _placeholder(path, "Tree accept", "no measured rows")
    if "follow" not in d:   # sweeps before the follow-rate axis had the default rate
        d = d.assign(follow=DEFAULT_FOLLOW_RATES[0])
    rates = sorted(d.follow.unique(), reverse=True)
    fig, axes = plt.subplots(1, len(rates), figsize=(6.5 * len(rates), 4), squeeze=False,
                             sharey=True)
    d = d.assign(implementation=d.impl.map(ACCEPT_IMPLS).fillna(d.impl),
                 slots=d.D.astype(str).rename("slots D"))
    for ax, rate in zip(axes[0], rates):
        sns.lineplot(d[d.follow == rate], x="batch", y="median_us", hue="implementation", style="slots",
                     marker="o", ax=ax)
        ax.axhline(ACCEPT_TARGET_US, color="grey", ls=":", lw=1)   # the GPU kernels' target
        ax.annotate(f"target {ACCEPT_TARGET_US:g} us", (0.01, ACCEPT_TARGET_US), xycoords=("axes fraction", "data"),
                    va="bottom", fontsize=8, color="grey")
        ax.set(xscale="log", yscale="log", ylabel="time per batch (us)",
               title=f"targets follow the first child: {rate:.0%}")
        ax.get_legend().remove() if ax is not axes[0][-1] and ax.get_legend() else None
    _legend_outside(axes[0][-1])
    fig.suptitle(f"Greedy tree accept ({_gpu_label(df)}); 'follow': how often the target token is the first "
                 "child's", fontsize=10)
    fig.tight_layout()
    _save(fig, path)


def step_breakdown(table: pd.DataFrame, path):
    """Stacked bars: where a verify step's time goes, today (CPU build + walk) vs with the kernels."""
    if table.empty:
        return _placeholder(path, "Whole-step breakdown", "needs probe data and kernel sweeps")
    fig, ax = plt.subplots(figsize=(9, 3.8))
    t = table.assign(scenario=table.scenario.str.replace("; ", ";\n").str.replace(" with ", "\nwith "))
    piv = t.pivot_table(index="scenario", columns="component", values="ms", aggfunc="sum", sort=False)
    piv.plot(kind="barh", stacked=True, ax=ax, colormap="tab20c")
    totals = piv.sum(axis=1)
    base = totals.iloc[0]
    for i, total in enumerate(totals):
        note = f"{total:.3g} ms" + ("" if i == 0 else f" ({100 * (total - base) / base:+.1f}%)")
        ax.text(total, i, " " + note, va="center", fontsize=9)
    step = float(table.verify_step_ms.iloc[0])
    ax.axvline(step, color="k", ls="--", lw=1)   # the probe's measured step, whatever the bars add up to
    ax.annotate(f"measured step {step:.3g} ms", (step, 1.0), xycoords=("data", "axes fraction"),
                va="bottom", ha="center", fontsize=8)
    ax.set_xlim(0, max(totals.max(), step) * 1.3)
    notes = str(table["notes"].iloc[0]) if "notes" in table and table["notes"].iloc[0] else ""
    if notes:
        fig.text(0.01, -0.02, "Notes: " + notes, fontsize=7, va="top", wrap=True)
    ax.set(xlabel="ms per verify step", ylabel="",
           title=f"Where a verify step goes (batch {int(table.batch.iloc[0])}, budget {int(table.budget.iloc[0])})")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _save(fig, path)


def worker_round(df: pd.DataFrame, path):
    """SGLang's worker round: the CPU path's parts against the drop-in's graph, per batch."""
    d = ok_rows(df)
    if d.empty:
        return _placeholder(path, "SGLang worker round", "no measured rows")
    cpu = d[(d.impl == "sglang_cpu_path") & (d.part == "round")].assign(impl="SGLang CPU path")
    patched = d[(d.impl == "sglang_cpu_path_patched") & (d.part == "round")].assign(
        impl="SGLang CPU path, patch()'s GPU builder")
    drop = d[d.impl == "kdtree_dropin_graph"].assign(impl="kdtree.sglang drop-in (one graph)")
    attn = d[d.impl == "kdtree_verify_layer"].assign(impl="kdtree verify attention, one layer")
    long = pd.concat([cpu, patched, drop, attn])
    if long.empty:
        return _placeholder(path, "SGLang worker round", "no measured rounds of the CPU path or the drop-in")
    long["ms"] = long.median_us / 1e3
    g = sns.relplot(long, x="batch", y="ms", hue="impl", style="impl", col="budget", row="prefix", kind="line",
                    marker="o", height=2.6, aspect=1.3, facet_kws={"sharey": False})
    g.set(xscale="log", yscale="log")
    g.set_axis_labels("batch (requests)", "ms per round")
    g.figure.suptitle(f"SGLang DDTree worker round, CPU path vs drop-in ({_gpu_label(d)})", y=1.02)
    sns.move_legend(g, "upper left", bbox_to_anchor=(1.0, 1.0))
    _save(g.figure, path)


SUSTAINED_IMPLS = {"kdtree_kernel": "kdtree", "flashmla": "FlashMLA (chain mask)"}


def verify_sustained(df: pd.DataFrame, path):
    """Verify attention with the GPU kept busy against a burst, per shape: how much longer a
    call takes, kdtree's speed over FlashMLA's under each, and the SM clock the board held."""
    d = ok_rows(df)
    if d.empty:
        return _placeholder(path, "Verify attention under sustained load", "no measured rows")
    d = d.assign(shape=lambda x: "B" + x.batch.astype(str) + " H" + x.heads.astype(str) + " D" + x.D.astype(str)
                 + " P" + (x.prefix // 1024).astype(str) + "k",
                 implementation=d.impl.map(SUSTAINED_IMPLS).fillna(d.impl),
                 slowdown=d.median_us / d.burst_us)
    order = list(d.sort_values(["batch", "heads", "D", "prefix"])["shape"].unique())
    m = sustained_ratio(d)
    peer = m is not None and len(m) > 0
    fig, axes = plt.subplots(1, 2 + peer, figsize=(5.2 * (2 + peer), 4.4))
    sns.barplot(d, x="shape", y="slowdown", hue="implementation", order=order, ax=axes[0], errorbar=None)
    axes[0].axhline(1.0, color="grey", ls=":", lw=1)
    axes[0].set(xlabel="", ylabel="sustained time / burst time", title="A call with the GPU kept busy")
    if d.sm_mhz.notna().any():
        sns.barplot(d, x="shape", y="sm_mhz", hue="implementation", order=order, ax=axes[1], errorbar=None)
        axes[1].set(xlabel="", ylabel="SM clock (MHz, median)", title="SM clock held meanwhile")
    else:  # nvidia-smi could not sample this board: say so rather than leave the panel empty
        axes[1].axis("off")
        axes[1].text(0.5, 0.5, "SM clock not sampled\n(nvidia-smi unavailable)", ha="center", va="center")
    if peer:
        r = pd.concat([m[["shape"]].assign(speed=m.burst_ratio, timing="burst"),
                       m[["shape"]].assign(speed=m.ratio, timing="sustained")])
        sns.barplot(r.dropna(), x="shape", y="speed", hue="timing", order=order, ax=axes[2], errorbar=None,
                    palette=["#9ecae1", "#08519c"])
        axes[2].axhline(1.0, color="grey", ls=":", lw=1)
        axes[2].set(xlabel="", ylabel="FlashMLA time / kdtree time", title="Against FlashMLA (above 1: kdtree faster)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=45)
        for t in ax.get_xticklabels():
            t.set_horizontalalignment("right")
        _legend_outside(ax)
    fig.suptitle(f"Verify attention under sustained load ({_gpu_label(df)})")
    fig.tight_layout()
    _save(fig, path)


def render_all(results_dir, fig_dir=None, kernel_times_dir=None, only=None) -> list[str]:
    """Render every figure the Parquet files in results_dir support (or those named in
    `only`: a rule writes exactly what it declares); returns what it skipped."""
    results_dir = pathlib.Path(results_dir)
    fig_dir = pathlib.Path(fig_dir or default_folder(results_dir))
    skipped = []
    for name in PER_PARQUET:
        if only is not None and name not in only:
            continue
        p = results_dir / f"{name}.parquet"
        if p.exists():
            globals()[name](pd.read_parquet(p), fig_dir / f"{name}.png")  # each figure's function
        else:
            skipped.append(f"{name}: {p} not found")
    if only is not None and BREAKDOWN not in only:
        return skipped
    from .breakdown import breakdown_table
    bt = breakdown_table(results_dir, kernel_times_dir)
    if bt is not None:
        step_breakdown(bt, fig_dir / "step_breakdown.png")
    elif (results_dir / "probe.parquet").exists():
        # The probe ran but measured nothing usable (e.g. the service was unreachable):
        # the figure says so instead of going missing.
        probe = pd.read_parquet(results_dir / "probe.parquet")
        why = "; ".join(sorted(set(probe.get("error", pd.Series(dtype=str)).dropna().astype(str))))[:200]
        _placeholder(fig_dir / "step_breakdown.png", "Whole-step breakdown",
                     f"no verify-step time from the probe: {why or 'no speculative meta_info'}")
        skipped.append("step_breakdown: the probe measured no verify step")
    else:
        skipped.append("step_breakdown: needs probe.parquet and tree_build.parquet")
    return skipped
