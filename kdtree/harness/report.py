"""A short Markdown report with the key tables, from the Parquet files alone."""
from __future__ import annotations

import pathlib

import pandas as pd

from .breakdown import breakdown_table
from .results import (VERIFY_KEYS, alternated, flashmla_ratio, peer_ratio, read_ok_rows, sustained_ratio,
                      write_text_atomic)
from .targets import check_round3_targets, check_targets


def _num(v, sig: int) -> str:
    """A table number: `sig` significant digits, but whole digits in full (29500, not 2.95e+04)."""
    if v is None or (isinstance(v, float) and v != v):
        return ""
    if isinstance(v, (bool, str)) or not isinstance(v, (int, float)) and not hasattr(v, "__float__"):
        return str(v)
    f = float(v)
    if f.is_integer() and abs(f) < 1e15:
        return str(int(f))
    s = f"{f:.{sig}g}"
    return f"{f:.0f}" if "e+" in s else s  # 999.6 rounds up to 1e+03 at 3 digits


def _md(df: pd.DataFrame, floatfmt=".3g") -> str:
    """A Markdown table with numbers formatted here (tabulate turned a whole column to float
    notation as soon as one value was large: budgets printed as 1.02e+03)."""
    if df.empty:
        return "_no rows_"
    sig = int(floatfmt.strip(".g"))
    cells = df.astype(object).apply(lambda col: col.map(lambda v: _num(v, sig)))
    numeric = [pd.api.types.is_numeric_dtype(df[c]) for c in df.columns]
    return cells.to_markdown(index=False, disable_numparse=True,
                             colalign=["right" if n else "left" for n in numeric])


def render(results_dir, out_path, skipped: list[str] | None = None, kernel_times_dir=None) -> str:
    rd = pathlib.Path(results_dir)
    parts = ["# kdtree results", ""]
    prov_src = None
    for name in ("tree_build", "verify_attn", "tree_accept", "probe"):
        p = rd / f"{name}.parquet"
        if p.exists():
            prov_src = pd.read_parquet(p)
            break
    if prov_src is not None and not prov_src.empty:
        r = prov_src.iloc[0].to_dict()
        if r.get("utc_time"):
            commit = str(r.get("git_commit") or "")[:10]
            parts += [f"Measured {r['utc_time']} on `{r.get('host')}` ({r.get('gpu_name') or 'no GPU'}, "
                      f"driver {r.get('driver') or '-'}, CPU {r.get('cpu_model')}), commit `{commit}`"
                      f"{' (dirty)' if r.get('git_dirty') else ''}, torch {r.get('torch_version')}.", ""]
    if any((rd / f"{n}.parquet").exists() for n in ("tree_build", "verify_attn", "tree_accept", "round")):
        parts += ["## Kernel targets, from this run's rows", "", _md(check_targets(rd)), ""]
        parts += ["### Round 3: at or ahead of FlashMLA (issue 29)", "", _md(check_round3_targets(rd)), ""]
    d = read_ok_rows(rd / "tree_build.parquet")
    if d is not None:
        keys = ["batch", "budget"] + (["drafts"] if "drafts" in d else [])
        piv = d.pivot_table(index=keys, columns=["impl", "metric"], values="median_us")
        piv.columns = [f"{a} {b} (us)" for a, b in piv.columns]
        note = (["`drafts`: the synthetic drafter; mixed rows give shallow, wide trees, confident ones "
                 "(the top token at 0.5-0.95) deep, narrow trees.", ""] if "drafts" in d else [])
        parts += ["## Tree build (median per batch)", "", *note, _md(piv.reset_index()), ""]
    d = read_ok_rows(rd / "verify_attn.parquet")
    if d is not None:
        cols = ["heads", "D", "prefix", "batch", "page_size", "impl", "median_us", "floor_us", "roofline_fraction"]
        parts += ["## Tree-verify attention", "", _md(d[cols].sort_values(cols[:6])), ""]
        parts += flashmla_section(d)
        parts += sglang_triton_section(d)
    d = read_ok_rows(rd / "tree_accept.parquet")
    if d is not None:
        keys = ["batch", "D"] + (["follow"] if "follow" in d else [])
        piv = d.pivot_table(index=keys, columns="impl", values="median_us")
        parts += ["## Tree accept (median per batch, us)", "",
                  "`D`: tree slots (budget + 1); `follow`: how often the target token is the first child's "
                  "(0.85 is a good draft, 0 random targets and the longest walks).", "",
                  _md(piv.reset_index()), ""]
    d = read_ok_rows(rd / "round.parquet")
    if d is not None:
        piv = d.pivot_table(index=["batch", "budget", "heads", "prefix"], columns="impl", values="median_us")
        pieces = [c for c in ("build_graph", "verify_graph", "accept_graph") if c in piv]
        if len(pieces) == 3:
            piv["sum of parts"] = piv[pieces].sum(axis=1)
        parts += ["## One round in one CUDA graph (device time, us)", "",
                  "Build, verify attention and accept captured together, no host sync between them.", "",
                  _md(piv.reset_index()), ""]
    d = read_ok_rows(rd / "worker_round.parquet")
    if d is not None:
        parts += worker_round_section(d)
    d = read_ok_rows(rd / "op_latency.parquet")
    if d is not None:
        piv = d.pivot_table(index=["batch", "op"], columns="impl", values="median_us")
        parts += ["## Caller latency (one call + synchronize, median us)", "",
                  "Each op through the Python API and as a registered torch op; `empty_torch_op` is an empty "
                  "torch op in the same run.", "", _md(piv.reset_index()), ""]
    d = read_ok_rows(rd / "verify_sustained.parquet")
    if d is not None:
        parts += sustained_section(d)
    bt = breakdown_table(rd, kernel_times_dir)
    if bt is not None:
        notes = [n for n in str(bt["notes"].iloc[0]).split("; ") if n]
        parts += ["## Whole step (probe + sweeps; the projected rows are Amdahl projections)", "",
                  _md(bt.drop(columns=["notes"])), ""] + [f"- {n}" for n in notes] + ([""] if notes else [])
    if skipped:
        parts += ["## Not rendered", ""] + [f"- {s}" for s in skipped] + [""]
    text = "\n".join(parts)
    write_text_atomic(text, out_path)
    return text


def worker_round_section(d: pd.DataFrame) -> list[str]:
    """SGLang's worker round: the CPU path (per part) against the drop-in, and one layer of
    verify attention for scale (K2 has 61 layers)."""
    keys = ["batch", "budget", "prefix"]
    cpu = d[d.impl == "sglang_cpu_path"].pivot_table(index=keys, columns="part", values="median_us")
    cpu.columns = [f"cpu {c} (us)" for c in cpu.columns]
    patched = d[(d.impl == "sglang_cpu_path_patched") & d.part.isin(["build", "round"])].pivot_table(
        index=keys, columns="part", values="median_us")
    patched.columns = [f"patched {c} (us)" for c in patched.columns]
    other = d[~d.impl.str.startswith("sglang_cpu_path")].pivot_table(index=keys, columns="impl", values="median_us")
    other.columns = [f"{c} (us)" for c in other.columns]
    t = cpu.join(patched).join(other)
    if "cpu round (us)" in t and "kdtree_dropin_graph (us)" in t:
        t["round speedup"] = t["cpu round (us)"] / t["kdtree_dropin_graph (us)"]
    return ["## SGLang DDTree worker round (kdtree.sglang)", "",
            "The CPU path as the worker runs it (top-k to the host, heapq build per request, padding and upload, "
            "the [q, P + q] mask built and uploaded, argmax to the host, child-map accept); `patched`: the same "
            "path with `kdtree.sglang.patch()`'s GPU builder (what `KDTREE_SGLANG=1` alone changes); the drop-in "
            "captured in one CUDA graph (`nomask`: without the mask, for kdtree's own verify attention). "
            "`kdtree_verify_layer`: one layer of tree-verify attention on SGLang's KV metadata (page size 1), "
            "after the forward's `prepare()` (what each of the model's layers costs).", "",
            _md(t.reset_index(), floatfmt=".4g"), ""]


def flashmla_section(d: pd.DataFrame) -> list[str]:
    """kdtree (tree mask) against FlashMLA (chain mask) per shape, same run and inputs."""
    m = flashmla_ratio(d)
    if m is None:
        return []
    t = m[VERIFY_KEYS + ["median_us", "median_us_fm", "ratio"]].rename(columns={
        "median_us": "median_us_kdtree", "median_us_fm": "median_us_flashmla", "ratio": "kdtree speed / FlashMLA's"})
    order = ("Their graph replays alternate (A B, B A, ...), so both run at the clock the pair holds: where "
             "the board reaches its power limit (batch 16, compute-bound) that compares their cycles, while "
             "each alone settles at a clock of its own (the sustained section below)."
             if alternated(d) else "kdtree is timed first at each shape, FlashMLA after it.")
    return ["## kdtree against FlashMLA (same run, same inputs)", "",
            "FlashMLA's dense bf16 decode (`use_legacy=True`) takes a causal chain mask, kdtree a random tree "
            f"mask; both read the same paged cache (page size 64). {order} Above 1: kdtree is faster.", "",
            _md(t.sort_values(VERIFY_KEYS)), ""]


def sglang_triton_section(d: pd.DataFrame) -> list[str]:
    """kdtree against SGLang's Triton tree verify per shape (page size 1, same run and inputs)."""
    m = peer_ratio(d, "sglang_triton")
    if m is None:
        return []
    ver = d.loc[d.impl == "sglang_triton", "peer_version"].dropna() if "peer_version" in d else []
    t = m[VERIFY_KEYS + ["median_us", "median_us_peer", "ratio"]].rename(columns={
        "median_us": "median_us_kdtree", "median_us_peer": "median_us_sglang_triton",
        "ratio": "SGLang time / kdtree time"})
    return ["## kdtree against SGLang's Triton tree verify (same run, same inputs)", "",
            f"SGLang{' ' + ver.iloc[0] if len(ver) else ''}'s `extend_attention_fwd`, what its Triton backend runs "
            "to verify an MLA tree: the prefix through `kv_indices`, the tree slots as extend tokens, the tree "
            "in the custom mask; page size 1 (its token pool), eager calls; its output matched kdtree's before "
            "it was timed. Above 1: kdtree is faster.", "", _md(t.sort_values(VERIFY_KEYS)), ""]


def sustained_section(d: pd.DataFrame) -> list[str]:
    """Verify attention with the GPU kept busy, against a burst of replays, per kernel; and
    kdtree's speed over FlashMLA's under each."""
    keys = ["batch", "heads", "D", "prefix"]
    t = d[keys + ["impl", "burst_us", "median_us", "power_w", "sm_mhz", "temp_c", "power_capped"]].rename(
        columns={"median_us": "sustained_us", "power_capped": "power-capped share"})
    t.insert(t.columns.get_loc("sustained_us") + 1, "sustained / burst", t["sustained_us"] / t["burst_us"])
    parts = ["## Verify attention under sustained load", "",
             "`burst_us`: graph replays of the kernel alone after an idle pause; `sustained_us`: "
             "replays back to back once the board has settled; power (W), SM clock (MHz) and temperature are "
             "medians of nvidia-smi samples over the sustained window, the power-capped share the samples the "
             "driver held at the board's power limit.", "", _md(t.sort_values(keys + ["impl"])), ""]
    m = sustained_ratio(d)
    if m is not None and len(m):
        r = m[keys].assign(burst=m.burst_ratio, sustained=m.ratio).dropna()
        parts += ["kdtree's speed over FlashMLA's (above 1: kdtree is faster):", "", _md(r), ""]
    return parts
