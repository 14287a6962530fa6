"""Figures and the report read well: legends beside the data, a distinct colour per batch,
no empty panel, readable names and numbers. Rendered from the committed reference Parquet
and from a CPU-only run's."""
import pathlib

import matplotlib
import pandas as pd
import pytest

from kdtree.harness import figures
from kdtree.harness.figure_names import PER_PARQUET
from kdtree.harness.report import render

ROOT = pathlib.Path(__file__).resolve().parent.parent
REF = ROOT / "results" / "reference"
RAW_NAMES = ("cpu_walk", "gpu_kernel", "cpu_heapq", "kdtree_kernel", "torch_sdpa")


@pytest.fixture
def captured(monkeypatch):
    figs = []
    monkeypatch.setattr(figures, "_save", lambda fig, path: figs.append(fig))
    yield figs
    for f in figs:
        matplotlib.pyplot.close(f)


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def check_readable(fig):
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    axes = [ax for ax in fig.axes if ax.get_visible() and ax.axison]
    assert axes, "a figure without a panel"
    for ax in fig.axes:
        assert ax.axison or not ax.has_data(), "a panel switched off"   # no empty panel left in
        leg = ax.get_legend()
        if leg is None:
            continue
        box = leg.get_window_extent(r)
        for other in axes:
            assert not _overlaps(box, other.get_window_extent(r)), f"legend of '{ax.get_title()}' covers a panel"
        labels = [t.get_text() for t in leg.get_texts()]
        assert not [l for l in labels if l in RAW_NAMES], labels


@pytest.mark.parametrize("name", PER_PARQUET)
def test_reference_figures_are_readable(captured, name):
    getattr(figures, name)(pd.read_parquet(REF / f"{name}.parquet"), "unused.png")
    check_readable(captured[-1])


@pytest.mark.parametrize("name", PER_PARQUET)
def test_a_grid_of_one_batch_renders(captured, name):
    """A user's grid with one batch (the smoke preset's on a GPU, FlashMLA installed: the peer
    panel's dodge divided by the batches less one) still draws every figure."""
    d = pd.read_parquet(REF / f"{name}.parquet")
    one = d[d.batch == d.batch.min()] if "batch" in d else d
    getattr(figures, name)(one, "unused.png")
    check_readable(captured[-1])


@pytest.mark.parametrize("name,impl", [("verify_attn", "flashmla"), ("worker_round", "kdtree_dropin_graph_nomask")])
def test_a_run_without_the_plotted_rows_gets_a_placeholder(captured, name, impl):
    """Where only rows the figure does not plot were measured (every kdtree verify point
    failed but FlashMLA's ran; a worker round with none of its lines) the figure says so."""
    d = pd.read_parquet(REF / f"{name}.parquet")
    getattr(figures, name)(d[d.impl == impl], "unused.png")
    texts = [t.get_text() for ax in captured[-1].axes for t in ax.texts]
    assert any(t.startswith("no measured") for t in texts), texts


def test_each_batch_has_its_own_colour(captured):
    figures.tree_build(pd.read_parquet(REF / "tree_build.parquet"), "unused.png")
    leg = captured[-1].axes[0].get_legend()
    colours = {t.get_text(): tuple(h.get_color()) for t, h in zip(leg.get_texts(), leg.legend_handles)
               if t.get_text().isdigit()}
    assert sorted(colours, key=int) == ["1", "16", "64", "256"]
    rgb = [matplotlib.colors.to_rgb(c) for c in colours.values()]
    closest = min(sum((x - y) ** 2 for x, y in zip(a, b)) ** 0.5 for i, a in enumerate(rgb) for b in rgb[i + 1:])
    assert closest > 0.15, colours                 # told apart at a glance, not shades of one colour


def test_two_draft_kinds_get_a_row_of_panels_each(captured, tmp_path):
    """A run with sweep_tree_build.drafts [mixed, confident]: one row of panels a kind, each
    titled with it, and the report's table keyed by it."""
    d = pd.read_parquet(REF / "tree_build.parquet")
    both = pd.concat([d.assign(drafts="mixed"), d.assign(drafts="confident", median_us=d.median_us * 2)])
    figures.tree_build(both, "unused.png")
    fig = captured[-1]
    titles = [ax.get_title() for ax in fig.axes if ax.axison]
    assert len(titles) == 4 and sum("(confident drafts)" in t for t in titles) == 2, titles
    check_readable(fig)
    both.to_parquet(tmp_path / "tree_build.parquet")
    render(tmp_path, tmp_path / "report.md")
    text = (tmp_path / "report.md").read_text()
    table = text[text.index("## Tree build"):].split("\n\n")[2]
    assert "drafts" in table.splitlines()[0] and "confident" in table and "mixed" in table


def test_a_cpu_only_build_figure_has_one_panel(captured):
    d = pd.read_parquet(REF / "tree_build.parquet")
    d = d[d.drafts == "mixed"] if "drafts" in d else d   # one kind: one row of panels
    figures.tree_build(d[d.impl == "cpu_heapq"], "unused.png")
    fig = captured[-1]
    assert len([ax for ax in fig.axes if ax.axison]) == 1
    check_readable(fig)


def test_report_numbers_never_print_in_float_notation():
    """Whole digits from 10**sig on, including values that round up to it (999.6 at 3
    digits printed as 1e+03 in the reference report)."""
    from kdtree.harness.report import _num
    assert [_num(v, 3) for v in (999.6, 999.4, 29500.4, 12.345, 0.5, 1024.0)] == \
        ["1000", "999", "29500", "12.3", "0.5", "1024"]
    assert _num(9999.7, 4) == "10000" and _num(float("nan"), 3) == ""


def test_report_prints_counts_as_integers_and_explains_follow(tmp_path):
    text = render(REF, tmp_path / "report.md")
    assert "e+0" not in text                       # no 1.02e+03 budgets, no 2.95e+04 us
    assert "|     1024 |" in text or "| 1024 |" in text.replace("  ", " ")
    assert "`follow`: how often the target token is the first child's" in text


def test_worker_round_shows_the_patched_builder(captured, tmp_path):
    """Rows of the CPU path with patch()'s builder (KDTREE_SGLANG=1 alone) get their own line
    in the figure, columns in the report and a clause in the README's summary."""
    from kdtree.harness.summary import summary

    d = pd.read_parquet(REF / "worker_round.parquet")
    cpu = d[d.impl == "sglang_cpu_path"]
    patched = cpu.assign(impl="sglang_cpu_path_patched", median_us=cpu.median_us * 0.75)
    both = pd.concat([d, patched])
    figures.worker_round(both, "unused.png")
    fig = captured[-1]
    labels = [t.get_text() for t in fig.legends[0].get_texts()] if fig.legends else []
    assert "SGLang CPU path, patch()'s GPU builder" in labels, labels
    check_readable(fig)
    for f in REF.glob("*.parquet"):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    both.to_parquet(tmp_path / "worker_round.parquet")
    text = render(tmp_path, tmp_path / "report.md")
    header = text[text.index("## SGLang DDTree worker round"):].split("\n\n")[2].splitlines()[0]
    assert "patched build (us)" in header and "patched round (us)" in header and "kdtree_dropin_graph (us)" in header
    row = both[(both.batch == 1) & (both.budget == 64) & (both.prefix == 8192) & (both.part == "round")]
    want = float(row[row.impl == "sglang_cpu_path_patched"].median_us.iloc[0]) / 1e3
    assert f"({want:.3g} ms with `patch()`'s builder alone)" in summary(tmp_path)


def test_tree_build_figure_draws_the_dense_mask_build(captured):
    """Rows of the build with the dense mask (sweep_tree_build.dense_visibility) get their own
    line, named for the SGLang drop-in; the figure stays readable. The rows here are the
    reference's device times relabelled: only the drawing is under test."""
    d = pd.read_parquet(REF / "tree_build.parquet")
    dense = d[(d.impl == "gpu_kernel") & (d.metric == "device_time")].assign(impl="gpu_kernel_dense")
    figures.tree_build(pd.concat([d, dense]), "unused.png")
    fig = captured[-1]
    check_readable(fig)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any("dense mask" in label for label in labels), labels
