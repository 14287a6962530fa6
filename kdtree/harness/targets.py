"""The kernel performance targets (docs/results.md), checked against a run's own Parquet rows.

Every verdict comes from measured rows of the same run (floors and copy bandwidth are
measured in that run too). A target whose points the run did not measure says so; it is
never reported as met.
"""
from __future__ import annotations

import pathlib

import pandas as pd

from .results import flashmla_ratio, page_size_ratio, read_ok_rows

MET, NOT_MET, NOT_MEASURED = "met", "not met", "not measured"


def _points(n: int) -> str:
    return f"{n} point" if n == 1 else f"{n} points"


def _span(x: pd.Series) -> str:
    lo, hi = f"{x.min():.0f}", f"{x.max():.0f}"
    return lo if lo == hi else f"{lo}-{hi}"


def _row(target: str, scope: str, goal: str, measured: str, ok: bool | None) -> dict:
    status = NOT_MEASURED if ok is None else (MET if ok else NOT_MET)
    return dict(target=target, scope=scope, goal=goal, measured=measured, status=status)


COMPUTE_BOUND = "H*D >= 128, P >= 4k, B >= 16"


def _compute_bound(d: pd.DataFrame) -> pd.DataFrame:
    """The rows of COMPUTE_BOUND's shapes."""
    return d[(d.heads * d.D >= 128) & (d.prefix >= 4096) & (d.batch >= 16)]


def _verify_targets(v: pd.DataFrame | None) -> list[dict]:
    names = [("verify, compute-bound", COMPUTE_BOUND, "median >= 75% of roofline, none < 60%"),
             ("verify, memory-bound", "H*D < 64, B >= 16", ">= 85% of the run's copy bandwidth"),
             ("verify, batch 1", "B = 1", "time <= 2 x floor + 5 us"),
             ("verify vs SDPA with tree mask", "B >= 16", ">= 10x faster")]
    if v is None:
        return [_row(*n, "-", None) for n in names]
    k = v[v.impl == "kdtree_kernel"]
    hd = k.heads * k.D
    out = []
    c = _compute_bound(k)
    if c.empty:
        out.append(_row(*names[0], "-", None))
    else:
        med, lo = c.roofline_fraction.median(), c.roofline_fraction.min()
        out.append(_row(*names[0], f"median {med:.1%}, min {lo:.1%} ({_points(len(c))})",
                        med >= 0.75 and lo >= 0.60))
    m = k[(hd < 64) & (k.batch >= 16)]
    if m.empty:
        out.append(_row(*names[1], "-", None))
    else:
        lo, med = m.copy_fraction.min(), m.copy_fraction.median()
        out.append(_row(*names[1], f"min {lo:.1%}, median {med:.1%} ({_points(len(m))})", lo >= 0.85))
    b1 = k[k.batch == 1]
    if b1.empty:
        out.append(_row(*names[2], "-", None))
    else:
        ratio = b1.median_us / (2 * b1.floor_us + 5)
        met = int((ratio <= 1).sum())
        out.append(_row(*names[2], f"{met}/{len(b1)} points within; worst {ratio.max():.1f}x the bound",
                        bool((ratio <= 1).all())))
    s = v[v.impl == "torch_sdpa_tree_mask"]
    key = ["heads", "D", "prefix", "batch", "page_size"]
    j = k[k.batch >= 16].merge(s[s.batch >= 16], on=key, suffixes=("", "_sdpa"))
    if j.empty:
        out.append(_row(*names[3], "-", None))
    else:
        sp = j.median_us_sdpa / j.median_us
        out.append(_row(*names[3], f"min {sp.min():.1f}x, median {sp.median():.1f}x ({_points(len(j))})",
                        bool((sp >= 10).all())))
    return out


def _build_targets(t: pd.DataFrame | None) -> list[dict]:
    names = [("tree build, device time", "B <= 64, budget <= 256", "<= 10 us per batch"),
             ("tree build, device time", "B = 64, budget 1024", "<= 40 us per batch"),
             ("tree build, caller latency", "all points", "<= 2 x an empty op's launch + sync")]
    if t is None:
        return [_row(*n, "-", None) for n in names]
    dev = t[(t.impl == "gpu_kernel") & (t.metric == "device_time")]
    out = []
    a = dev[(dev.batch <= 64) & (dev.budget <= 256)]
    out.append(_row(*names[0], f"max {a.median_us.max():.1f} us ({_points(len(a))})", bool((a.median_us <= 10).all()))
               if not a.empty else _row(*names[0], "-", None))
    b = dev[(dev.batch == 64) & (dev.budget == 1024)]
    out.append(_row(*names[1], f"{b.median_us.max():.1f} us", bool((b.median_us <= 40).all()))
               if not b.empty else _row(*names[1], "-", None))
    lat = t[(t.impl == "gpu_kernel") & (t.metric == "caller_latency")]
    empty = t[(t.impl == "torch_tiny_op") & (t.metric == "caller_latency")]
    j = lat.merge(empty, on=["batch", "budget"] + (["drafts"] if "drafts" in t else []), suffixes=("", "_empty"))
    if j.empty:
        out.append(_row(*names[2], "-", None))
    else:
        r = j.median_us / j.median_us_empty
        out.append(_row(*names[2], f"worst {r.max():.1f}x, best {r.min():.1f}x ({_points(len(j))})",
                        bool((r <= 2).all())))
    return out


ACCEPT_TARGET_US = 3.0   # accept device time per batch, B <= 256, D <= 257

# The accept kernels: from the build's parents (what the round uses), and the walk over
# the left-child / right-sibling lists (SGLang's input form). Each is reported; the target
# is met when one of them meets it at every point.
ACCEPT_KERNELS = {"gpu_kernel_parents": "from parents", "gpu_kernel": "list walk"}


def _accept_targets(a: pd.DataFrame | None) -> list[dict]:
    name = ("tree accept, device time", "B <= 256, D <= 257", f"<= {ACCEPT_TARGET_US:g} us per batch")
    if a is None:
        return [_row(*name, "-", None)]
    g = a[a.impl.isin(list(ACCEPT_KERNELS)) & (a.batch <= 256) & (a.D <= 257)]
    if g.empty:
        return [_row(*name, "-", None)]
    parts, met = [], False
    for impl, label in ACCEPT_KERNELS.items():
        k = g[g.impl == impl]
        if k.empty:
            continue
        ok = k.median_us <= ACCEPT_TARGET_US
        detail = f"{label}: {int(ok.sum())}/{len(k)} points within, max {k.median_us.max():.1f} us"
        if "follow" in k and k.follow.nunique() > 1:   # the worst time at each follow rate
            worst = k.groupby("follow").median_us.max().sort_index(ascending=False)
            detail += " (" + ", ".join(f"follow {f:g}: max {t:.1f} us" for f, t in worst.items()) + ")"
        parts.append(detail)
        met |= bool(ok.all())
    return [_row(*name, "; ".join(parts), met)]


def _round_targets(r: pd.DataFrame | None) -> list[dict]:
    name = ("one round in one CUDA graph", "build -> verify -> accept", "captured, replay time reported")
    g = None if r is None else r[r.impl == "round_graph"]
    if g is None or g.empty:
        return [_row(*name, "-", None)]
    return [_row(*name, f"{_points(len(g))}, {_span(g.median_us)} us", True)]


# Round 3 (issue 29): at or ahead of FlashMLA, in the same run. Its goals, in one place.
ROUND3 = {"roofline": 0.85, "copy": 0.85, "page1": 1.05, "fm_min_prefix": 4096}
# The build's: (budget, smallest batch, largest batch, us per batch); K = min(budget, 256).
ROUND3_BUILD = [(64, 1, 64, 8.0), (256, 1, 64, 15.0), (1024, 64, 64, 100.0)]


def _shape(r) -> str:
    return f"B {r.batch}, H {r.heads}, D {r.D}, P {r.prefix // 1024}k"


def _round3_verify(v: pd.DataFrame | None) -> list[dict]:
    names = [("verify vs FlashMLA", f"page 64, P >= {ROUND3['fm_min_prefix'] // 1024}k, every shape both ran",
              "kdtree's time <= FlashMLA's"),
             ("verify, compute-bound", COMPUTE_BOUND, f"median >= {ROUND3['roofline']:.0%} of roofline"),
             ("verify, memory-bound", "H*D < 64, B 16, P 8k", f">= {ROUND3['copy']:.0%} of the run's copy bandwidth"),
             ("verify, page size 1", "every shape at both page sizes",
              f"within {ROUND3['page1'] - 1:.0%} of page size 64's time")]
    if v is None:
        return [_row(*n, "-", None) for n in names]
    out = []
    m = flashmla_ratio(v)
    m = None if m is None else m[(m.page_size == 64) & (m.prefix >= ROUND3["fm_min_prefix"])]
    if m is None or m.empty:
        out.append(_row(*names[0], "-", None))
    else:
        worst = m.loc[m.ratio.idxmin()]
        out.append(_row(*names[0], f"{int((m.ratio >= 1).sum())}/{_points(len(m))} at or ahead; slowest "
                        f"{worst.ratio:.2f}x its speed ({_shape(worst)})", bool((m.ratio >= 1).all())))
    k = v[v.impl == "kdtree_kernel"]
    c = _compute_bound(k)
    if c.empty:
        out.append(_row(*names[1], "-", None))
    else:
        fm = _compute_bound(v[v.impl == "flashmla"])
        peer = f"; FlashMLA {fm.roofline_fraction.median():.1%}" if len(fm) else ""
        med = c.roofline_fraction.median()
        out.append(_row(*names[1], f"median {med:.1%} ({_points(len(c))}{peer})", med >= ROUND3["roofline"]))
    mb = k[(k.heads * k.D < 64) & (k.batch == 16) & (k.prefix == 8192)]
    if mb.empty:
        out.append(_row(*names[2], "-", None))
    else:
        lo = mb.copy_fraction.min()
        out.append(_row(*names[2], f"min {lo:.1%}, median {mb.copy_fraction.median():.1%} ({_points(len(mb))})",
                        lo >= ROUND3["copy"]))
    j = page_size_ratio(v)
    if j.empty:
        out.append(_row(*names[3], "-", None))
    else:
        worst = j.loc[j.ratio.idxmax()]
        out.append(_row(*names[3], f"{int((j.ratio <= ROUND3['page1']).sum())}/{_points(len(j))} within; worst "
                        f"{worst.ratio:.3f}x ({_shape(worst)})", bool((j.ratio <= ROUND3["page1"]).all())))
    return out


def _round3_build(t: pd.DataFrame | None) -> list[dict]:
    dev = None if t is None else t[(t.impl == "gpu_kernel") & (t.metric == "device_time")]
    out = []
    for budget, lo, hi, goal in ROUND3_BUILD:
        batches = f"B = {hi}" if lo == hi else f"B <= {hi}"
        name = ("tree build, device time", f"{batches}, budget {budget}", f"<= {goal:g} us per batch")
        a = None if dev is None else dev[(dev.budget == budget) & dev.batch.between(lo, hi)]
        out.append(_row(*name, "-", None) if a is None or a.empty else
                   _row(*name, f"max {a.median_us.max():.1f} us ({_points(len(a))})", bool((a.median_us <= goal).all())))
    return out


def check_round3_targets(results_dir) -> pd.DataFrame:
    """Issue 29's targets (verify at or ahead of FlashMLA in the same run; the build at budget
    64 and 256), from the run's own rows as check_targets."""
    rd = pathlib.Path(results_dir)
    return pd.DataFrame(_round3_verify(read_ok_rows(rd / "verify_attn.parquet"))
                        + _round3_build(read_ok_rows(rd / "tree_build.parquet")))


def check_targets(results_dir) -> pd.DataFrame:
    rd = pathlib.Path(results_dir)
    rows = (_verify_targets(read_ok_rows(rd / "verify_attn.parquet"))
            + _build_targets(read_ok_rows(rd / "tree_build.parquet"))
            + _accept_targets(read_ok_rows(rd / "tree_accept.parquet"))
            + _round_targets(read_ok_rows(rd / "round.parquet")))
    return pd.DataFrame(rows)
