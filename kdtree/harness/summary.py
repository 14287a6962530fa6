"""The results summary README.md carries, generated from a results folder's Parquet (the
committed reference set) so its numbers cannot drift from the data:
`python -m kdtree readme` rewrites the block between the markers, `--check` compares."""
from __future__ import annotations

import pathlib

from .results import alternated, flashmla_ratio, page_size_ratio, peer_ratio, read_ok_rows, sustained_ratio
from .targets import check_targets

START, END = "<!-- results:start -->", "<!-- results:end -->"


def _cell(text) -> str:
    return str(text).split(";")[0].replace("|", "/").strip()


def summary(results_dir) -> str:
    rd = pathlib.Path(results_dir)
    lines = []
    prov = read_ok_rows(rd / "verify_attn.parquet")
    if prov is not None and len(prov):
        r = prov.iloc[0]
        lines += [f"Measured on one {r.gpu_name} at commit `{str(r.git_commit)[:7]}` "
                  f"({str(r.utc_time)[:10]}, torch {r.torch_version}); targets from the run's own rows:", ""]
    t = check_targets(rd)
    lines += ["| target | goal | measured | status |", "|---|---|---|---|"]
    lines += [f"| {a} ({s}) | {g} | {_cell(m)} | {st} |"
              for a, s, g, m, st in t[["target", "scope", "goal", "measured", "status"]].itertuples(index=False)]
    lines.append("")
    w = read_ok_rows(rd / "worker_round.parquet")
    if w is not None and len(w):
        def at(B, b, P):
            sel = (w.batch == B) & (w.budget == b) & (w.prefix == P) & (w.part == "round")
            cpu, patched, drop = (w[sel & (w.impl == i)].median_us for i in (
                "sglang_cpu_path", "sglang_cpu_path_patched", "kdtree_dropin_graph"))
            if not (len(cpu) and len(drop)):
                return None
            return float(cpu.iloc[0]), float(patched.iloc[0]) if len(patched) else None, float(drop.iloc[0])
        pts = [(B, b, P, at(B, b, P)) for B, b, P in ((1, 64, 8192), (16, 64, 32768), (64, 256, 32768))]
        said = [f"batch {B}, budget {b}, P {P // 1024}k: {c / 1e3:.3g} ms"
                + (f" ({pa / 1e3:.3g} ms with `patch()`'s builder alone)" if pa is not None else "")
                + f" against {d:.0f} us" for B, b, P, v in pts if v for c, pa, d in [v]]
        if said:
            lines += ["SGLang's DDTree round on the CPU (as the worker runs it) against the `kdtree.sglang` "
                      "drop-in in one CUDA graph: " + "; ".join(said) + ".", ""]
    v = read_ok_rows(rd / "verify_attn.parquet")
    m = flashmla_ratio(v) if v is not None else None
    if m is not None:
        ratio = m.ratio
        clock = ", replays alternated: one shared clock" if alternated(v) else ""
        lines += [f"Verify attention against FlashMLA's dense decode on the same inputs ({len(m)} shapes, "
                  f"page size 64{clock}): kdtree at {ratio.min():.2f}-{ratio.max():.2f}x its speed, "
                  f"median {ratio.median():.2f}x.", ""]
    m = peer_ratio(v, "sglang_triton") if v is not None else None
    if m is not None:
        lines += [f"Against SGLang's Triton tree verify (same inputs, {len(m)} shapes, page size 1): kdtree "
                  f"{m.ratio.min():.3g}-{m.ratio.max():.3g}x faster, median {m.ratio.median():.3g}x.", ""]
    if v is not None and {1, 64} <= set(v.page_size):
        m = page_size_ratio(v)
        if len(m):  # none where every kdtree point failed
            ratio = m.ratio
            layout = m.table_layout.iloc[0] if "table_layout" in m else "scattered"
            lines += [f"Page size 1 (SGLang's pool; block tables: {layout}) against page size 64 ({len(m)} shapes): "
                      f"{ratio.min():.2f}-{ratio.max():.2f}x its time, median {ratio.median():.2f}x, "
                      f"{int((ratio <= 1.05).sum())} within 5%.", ""]
    s = read_ok_rows(rd / "verify_sustained.parquet")
    m = sustained_ratio(s) if s is not None else None
    if m is not None and len(m):
        held, burst = m.ratio.dropna(), m.burst_ratio.dropna()
        sampled = m.power_capped.notna()   # kdtree's samples
        capped = (f"{int((m.power_capped[sampled] >= 0.5).sum())} of them held at the board's power limit"
                  if sampled.any() else "board power not sampled")
        lines += [f"With the GPU kept busy ({len(held)} shapes, {capped}): "
                  f"kdtree at {held.min():.2f}-{held.max():.2f}x FlashMLA's speed, against "
                  f"{burst.min():.2f}-{burst.max():.2f}x in short bursts of the same sweep.", ""]
    return "\n".join(lines).rstrip() + "\n"


def render_readme(readme: str, results_dir) -> str:
    """README text with the block between the markers replaced by summary(results_dir)."""
    if START not in readme or END not in readme:
        raise ValueError(f"README: no {START} ... {END} block")
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{summary(results_dir)}{END}{tail}"
