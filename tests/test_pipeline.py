"""The pipeline's Python: resumable sweeps, failed points as rows, atomic writes, gather,
figures and report from Parquet alone, the whole-step breakdown, config validation,
GPU claiming, and the deployment checks."""
import os
import pathlib
import stat

import pandas as pd
import pytest

from kdtree.harness import gpu as kgpu
from kdtree.harness.breakdown import breakdown_table
from kdtree.cli import main as cli
from kdtree.tools.deploy_checks import check_container, check_slurm_plan, readme_test_command
from kdtree.harness.figures import render_all
from kdtree.harness.results import write_parquet_atomic
from kdtree.harness.sweeps import tree_accept, tree_build
from kdtree.harness.sweeps.runner import run_sweep

ROOT = pathlib.Path(__file__).resolve().parent.parent


class Crash(BaseException):
    """The process dying mid-sweep (not an error a point can record)."""


def test_interrupted_sweep_resumes_where_it_stopped(tmp_path):
    out = tmp_path / "s.parquet"
    calls, crashed = [], []

    def measure(p):
        calls.append(p["x"])
        if p["x"] == 3 and not crashed:
            crashed.append(True)
            raise Crash()
        return [dict(p, value=p["x"] * 10)]

    points = [{"x": i} for i in range(5)]
    with pytest.raises(Crash):
        run_sweep("t", points, measure, out, {})
    assert not out.exists() and out.with_name("s.parquet.partial").exists()
    calls.clear()
    df = run_sweep("t", points, measure, out, {})
    assert calls == [3, 4]                      # only what was missing
    assert sorted(df.value) == [0, 10, 20, 30, 40]
    assert not out.with_name("s.parquet.partial").exists()
    for col in ("run_id", "utc_time", "git_commit", "git_dirty", "host", "cpu_model", "gpu_name",
                "driver", "cuda_runtime", "torch_version", "kernel_lib_hash", "config_hash"):
        assert col in df.columns, col


def test_failed_points_are_rows(tmp_path):
    def measure(p):
        if p["x"] == 1:
            raise ValueError("boom")
        if p["x"] == 2:
            raise kgpu.MemoryBudgetError("needs 9 GiB, over the cap")
        return [dict(p)]

    df = run_sweep("t", [{"x": i} for i in range(3)], measure, tmp_path / "o.parquet", {})
    st = dict(zip(df.x, df.status))
    assert st == {0: "ok", 1: "error", 2: "skipped"}
    assert "boom" in df[df.x == 1].reason.iloc[0]


def test_settled_sweep_measures_its_first_point_once_unrecorded(tmp_path):
    # The first graph a process times runs fast, so a settled sweep measures its first point
    # once before the recorded pass; a failure there is recorded by the pass, not raised.
    calls = []

    def measure(p):
        calls.append(p["x"])
        if p["x"] == 0 and calls.count(0) == 1:
            raise RuntimeError("first call only")
        return [dict(p, value=len(calls))]

    out = tmp_path / "s.parquet"
    df = run_sweep("t", [{"x": i} for i in range(3)], measure, out, {}, settle=True)
    assert calls == [0, 0, 1, 2]
    assert sorted(df.x) == [0, 1, 2] and set(df.status) == {"ok"}
    assert df[df.x == 0].value.iloc[0] == 2        # the recorded row is the second measurement
    calls.clear()
    run_sweep("t", [{"x": 0}], measure, tmp_path / "u.parquet", {})
    assert calls == [0]                            # unsettled: measured once


def test_resumed_settled_sweep_settles_on_its_first_missing_point(tmp_path):
    out, calls = tmp_path / "s.parquet", []

    def measure(p):
        calls.append(p["x"])
        if p["x"] == 2 and len(calls) == 4:        # settle 0, then 0 and 1 recorded, then 2 dies
            raise Crash()
        return [dict(p)]

    points = [{"x": i} for i in range(4)]
    with pytest.raises(Crash):
        run_sweep("t", points, measure, out, {}, settle=True)
    calls.clear()
    df = run_sweep("t", points, measure, out, {}, settle=True)
    assert calls == [2, 2, 3] and sorted(df.x) == [0, 1, 2, 3]


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    class Bad:
        def to_parquet(self, *a, **k):
            raise OSError("disk full")

    with pytest.raises(OSError):
        write_parquet_atomic(Bad(), tmp_path / "x.parquet")
    assert list(tmp_path.iterdir()) == []


def test_tree_build_sweep_caps_topk(tmp_path):
    """max_topk caps K below the budget (issue 29's K = min(budget, 256)); rows record K."""
    cfg = {"batches": [2], "budgets": [4, 16], "L": 4, "vocab": 300, "seed": 0, "cpu_reps": 1,
           "cpu_max_seconds": 1, "gpu_replays": 2, "gpu_mem_cap_gb": 1}
    capped = tree_build.run(dict(cfg, max_topk=8), tmp_path / "capped.parquet", gpu=False)
    plain = tree_build.run(dict(cfg, max_topk=None), tmp_path / "plain.parquet", gpu=False)
    for df, want in ((capped, {4: 4, 16: 8}), (plain, {4: 4, 16: 16})):
        cpu = df[df.impl == "cpu_heapq"]
        assert (cpu.status == "ok").all()
        assert dict(zip(cpu.budget, cpu.topk)) == want


@pytest.mark.gpu
def test_tree_build_sweep_times_the_dense_mask_when_asked(tmp_path):
    """dense_visibility adds the SGLang drop-in's build (the dense mask besides the bits) as
    its own device-time row; without it the sweep writes none."""
    cfg = {"batches": [2], "budgets": [16, 64], "L": 4, "vocab": 300, "seed": 0, "cpu_reps": 1,
           "cpu_max_seconds": 1, "gpu_replays": 2, "gpu_mem_cap_gb": 1}
    dense = tree_build.run(dict(cfg, dense_visibility=True), tmp_path / "dense.parquet", gpu=True)
    plain = tree_build.run(cfg, tmp_path / "plain.parquet", gpu=True)
    rows = dense[dense.impl == "gpu_kernel_dense"]
    assert sorted(rows.budget) == [16, 64] and (rows.status == "ok").all() and (rows.median_us > 0).all()
    assert (rows.metric == "device_time").all()
    assert not (plain.impl == "gpu_kernel_dense").any()


def test_cpu_sweeps_then_gather_figures_and_report(tmp_path):
    cfg_tb = {"batches": [1, 2], "budgets": [4, 16], "L": 4, "vocab": 300, "seed": 0, "cpu_reps": 1,
              "cpu_max_seconds": 1, "gpu_replays": 2, "gpu_mem_cap_gb": 1}
    for b in (1, 2):
        tree_build.run(dict(cfg_tb, batches=[b]), tmp_path / f"tb{b}.parquet", gpu=False)
    cli(["gather", "--out", str(tmp_path / "tree_build.parquet"), str(tmp_path / "tb1.parquet"),
         str(tmp_path / "tb2.parquet")])
    tb = pd.read_parquet(tmp_path / "tree_build.parquet")
    assert set(tb.batch) == {1, 2} and set(tb.impl) == {"cpu_heapq", "sglang", "gpu_kernel"}
    assert (tb[tb.impl == "gpu_kernel"].status == "skipped").all()
    assert (tb[tb.impl == "cpu_heapq"].median_us > 0).all()
    tree_accept.run({"batches": [1, 3], "slots": [5], "follow_rates": [0.85, 0.0], "L": 4, "seed": 0,
                     "cpu_reps": 1, "cpu_max_seconds": 1, "gpu_replays": 2},
                    tmp_path / "tree_accept.parquet", gpu=False)
    ta = pd.read_parquet(tmp_path / "tree_accept.parquet")
    assert sorted(ta.follow.unique()) == [0.0, 0.85] and len(ta) == 2 * 2 * 3   # 2 rates x 2 batches x 3 impls
    skipped = render_all(tmp_path)
    assert (tmp_path / "figures" / "tree_build.png").stat().st_size > 10_000
    assert (tmp_path / "figures" / "tree_accept.png").exists()
    assert any("verify_attn" in s for s in skipped)
    cli(["report", "--results", str(tmp_path), "--out", str(tmp_path / "report.md")])
    text = (tmp_path / "report.md").read_text()
    assert "## Tree build" in text and "## Tree accept" in text and "follow" in text


def _accept_and_probe(tmp_path):
    """Accept rows at batch 4, D 65 (CPU walk 500 us, kernel 5 us) and a 20 ms probed step."""
    pd.DataFrame([dict(batch=4, D=65, impl="cpu_walk", median_us=500.0, status="ok"),
                  dict(batch=4, D=65, impl="gpu_kernel", median_us=5.0, status="ok")]).to_parquet(
        tmp_path / "tree_accept.parquet")
    pd.DataFrame([dict(verify_step_ms=20.0, concurrency=4, tree_budget=64)]).to_parquet(
        tmp_path / "probe_summary.parquet")


def test_breakdown_is_an_amdahl_projection(tmp_path):
    rows = []
    for impl, metric, us in (("cpu_heapq", "batch_time", 4000.0), ("gpu_kernel", "device_time", 40.0)):
        rows.append(dict(batch=4, budget=64, impl=impl, metric=metric, median_us=us, status="ok"))
    pd.DataFrame(rows).to_parquet(tmp_path / "tree_build.parquet")
    _accept_and_probe(tmp_path)
    t = breakdown_table(tmp_path)
    now = t[t.scenario.str.startswith("measured")].set_index("component").ms
    proj = t[t.scenario.str.startswith("projected")].set_index("component").ms
    assert now.sum() == pytest.approx(20.0)
    assert now["tree build (CPU)"] == pytest.approx(4.0) and now["rest of step"] == pytest.approx(15.5)
    assert proj.sum() == pytest.approx(15.5 + 0.04 + 0.005)
    assert t.notes.iloc[0] == ""                       # exact rows, a reported budget: nothing assumed
    render_all(tmp_path)
    assert (tmp_path / "figures" / "step_breakdown.png").exists()


def test_breakdown_takes_the_confident_drafters_build(tmp_path):
    """Where the sweep ran both draft kinds, the GPU build comes from the confident drafter's
    rows (a draft that is mostly right, as the accept rows' highest follow rate)."""
    rows = [dict(batch=4, budget=64, drafts=k, impl=i, metric=m, median_us=us, status="ok")
            for k, scale in (("mixed", 1.0), ("confident", 3.0))
            for i, m, us in (("cpu_heapq", "batch_time", 4000.0), ("gpu_kernel", "device_time", 40.0 * scale))]
    pd.DataFrame(rows).to_parquet(tmp_path / "tree_build.parquet")
    _accept_and_probe(tmp_path)
    t = breakdown_table(tmp_path)
    proj = t[t.scenario.str.startswith("projected")].set_index("component").ms
    assert proj.sum() == pytest.approx(15.5 + 0.12 + 0.005)


def test_breakdown_says_what_it_assumed(tmp_path):
    pd.DataFrame([dict(batch=4, budget=16, impl="cpu_heapq", metric="batch_time", median_us=4000.0, status="ok"),
                  dict(batch=4, budget=64, impl="cpu_heapq", metric="batch_time", median_us=9000.0, status="ok")]
                 ).to_parquet(tmp_path / "tree_build.parquet")
    pd.DataFrame([dict(batch=4, D=17, impl="cpu_walk", median_us=500.0, status="ok"),
                  dict(batch=4, D=257, impl="cpu_walk", median_us=900.0, status="ok")]).to_parquet(
        tmp_path / "tree_accept.parquet")
    # a step shorter than the CPU parts, and a server that reports no budget
    pd.DataFrame([dict(verify_step_ms=5.0, concurrency=4, tree_budget=None)]).to_parquet(
        tmp_path / "probe_summary.parquet")
    t = breakdown_table(tmp_path)
    notes = t.notes.iloc[0]
    assert "64 assumed" in notes
    assert "CPU accept walk timed at batch 4, D 17 (no row at batch 4, D 65)" in notes
    assert "exceed the probe's measured step (5 ms)" in notes
    assert t[t.component == "rest of step"].ms.iloc[0] == 0
    cli(["report", "--results", str(tmp_path), "--out", str(tmp_path / "report.md")])
    assert "- the server reported no tree budget" in (tmp_path / "report.md").read_text()


def test_config_schema_names_the_bad_key():
    import yaml
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate

    cfg = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    validate(cfg, str(ROOT / "workflow/schemas/config.schema.yaml"))
    cfg["sweep_tree_build"]["budgets"] = [16, 2048]
    with pytest.raises(WorkflowError, match="2048"):
        validate(cfg, str(ROOT / "workflow/schemas/config.schema.yaml"))


def test_memory_cap_refuses_clearly():
    with pytest.raises(kgpu.MemoryBudgetError, match="over the gpu_mem_cap_gb cap of 1"):
        kgpu.ensure_fits(2 << 30, cap_gb=1)


def test_claim_gpu_gives_each_job_its_own(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: a)'\necho 'GPU 1: NVIDIA H200 (UUID: b)'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    got, held = [], []
    for _ in range(2):   # two jobs: the first keeps its lock while the second claims
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        got.append(kgpu.claim_gpu(tmp_path / "locks"))
        held.append(kgpu._CLAIM)
    assert got == ["0", "1"]
    for f in held:
        f.close()


def test_concurrent_jobs_on_two_fake_gpus_never_share_one(tmp_path):
    """Three timed jobs at once on a node that shows two GPUs: two run side by side on
    different GPUs, the third waits for a free one; no two overlapping jobs share a GPU."""
    import json
    import subprocess
    import sys
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: a)'\necho 'GPU 1: NVIDIA H200 (UUID: b)'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID")}
    env["PATH"] = f"{fake.parent}:{env['PATH']}"
    job = ("import json, time, sys; from kdtree.harness.gpu import claim_gpu; "
           f"g = claim_gpu({str(tmp_path / 'locks')!r}); t0 = time.time(); time.sleep(1.5); "
           "import os; print(json.dumps([g, os.environ['CUDA_VISIBLE_DEVICES'], t0, time.time()]))")
    procs = [subprocess.Popen([sys.executable, "-c", job], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    runs = sorted(json.loads(p.communicate(timeout=60)[0]) for p in procs)
    assert all(r[0] == r[1] for r in runs)                  # CUDA_VISIBLE_DEVICES pinned to the claim
    assert sorted({r[0] for r in runs}) == ["0", "1"]       # both GPUs used
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            if a[2] < b[3] and b[2] < a[3]:                 # overlapping in time
                assert a[0] != b[0], runs
    starts = sorted(r[2] for r in runs)
    assert starts[1] - starts[0] < 1.0 and starts[2] - starts[0] >= 1.4   # two at once, the third waited


def test_container_definition_checks():
    assert check_container(ROOT / "containers/kdtree.def", ROOT / "constraints.txt", ROOT / "README.md") == []
    assert readme_test_command((ROOT / "README.md").read_text()) == ".venv/bin/python -P -m pytest -q tests"


def test_container_check_catches_drift(tmp_path):
    text = (ROOT / "containers/kdtree.def").read_text()
    bad = text.replace("13.0.1-devel-ubuntu24.04", "12.4.1-devel-ubuntu22.04").replace(
        "-c /opt/kdtree/constraints.txt '/opt", "torch==2.9.0 -e '/opt").replace("%runscript", "%notrun")
    p = tmp_path / "k.def"
    p.write_text(bad)
    problems = check_container(p, ROOT / "constraints.txt", ROOT / "README.md")
    joined = "\n".join(problems)
    assert "13.0.x-devel-ubuntu24.04" in joined and "torch==2.9.0" in joined
    assert "missing section %runscript" in joined and "-c constraints.txt" in joined
    assert "not editable" in joined


def test_slurm_plan_check():
    plan = ("rule test_correctness:\n    resources: tmpdir=/tmp, bench=1, gpu=1\n"
            "rule sweep_gpu:\n    resources: tmpdir=/tmp, bench=1, gpu=1\n"
            "rule sweep_verify_attn_shard:\n    resources: tmpdir=/tmp, bench=1, gpu=1\n"
            "rule gather_tree_build:\n    resources: tmpdir=/tmp\n"
            "rule report:\n    resources: tmpdir=/tmp\n")
    assert check_slurm_plan(plan) == []
    assert check_slurm_plan(plan.replace("gpu=1", "", 1)) == ["test_correctness: a GPU rule without gpu=1"]


def test_report_shows_the_one_graph_round(tmp_path):
    rows = [dict(batch=4, budget=64, heads=8, prefix=8192, impl=f"{n}_graph", median_us=us, status="ok")
            for n, us in (("build", 50.0), ("verify", 300.0), ("accept", 3.0), ("round", 340.0))]
    pd.DataFrame(rows).to_parquet(tmp_path / "round.parquet")
    cli(["report", "--results", str(tmp_path), "--out", str(tmp_path / "r.md")])
    text = (tmp_path / "r.md").read_text()
    assert "One round in one CUDA graph" in text and "353" in text   # the sum of the parts


def test_power_samples_parse_and_summarize():
    from kdtree.harness.power import parse_sample, summarize_samples

    lines = ["691.43, 700.00, 1740, 57, 0x0000000000000004", "702.5, 700.00, 1470, 58, 0x0000000000000004",
             "80.0, 700.00, 1980, 40, 0x0000000000000000", "[N/A], 700.00, 1980, 40, 0x0", "garbage"]
    samples = [s for s in map(parse_sample, lines) if s is not None]
    assert len(samples) == 3   # the [N/A] line and the garbage are dropped, not zeros
    got = summarize_samples(samples)
    assert got["power_w"] == 691.43 and got["sm_mhz"] == 1740 and got["sm_mhz_min"] == 1470
    assert got["power_capped"] == pytest.approx(2 / 3) and got["slowed"] == pytest.approx(2 / 3)
    assert got["power_samples"] == 3 and got["temp_c"] == 57
    thermal = summarize_samples([parse_sample("500, 700, 1600, 90, 0x40")])
    assert thermal["power_capped"] == 0 and thermal["slowed"] == 1
    empty = summarize_samples([])
    assert empty["power_samples"] == 0 and empty["power_w"] != empty["power_w"]   # NaN, not 0 W


def test_sustained_shapes_checked_by_the_schema():
    from kdtree.harness.config import check_section
    from kdtree.harness.sweeps.verify_sustained import parse_shape

    assert parse_shape("16:8:64:32768") == {"batch": 16, "heads": 8, "D": 64, "prefix": 32768}
    from kdtree.harness.sweeps.verify_sustained import points
    assert [p["kdtree_first"] for p in points(["1:8:1:1024", "16:8:64:8192", "1:8:1:4096"])] == [True, False, True]
    cfg = dict(shapes=["16:8:64"], warmup_s=1, seconds=1, idle_s=0, sample_ms=100, scale=0.1, seed=0,
               gpu_replays=5, graph_inner=3)
    with pytest.raises(ValueError, match=r"shapes\[0\].*16:8:64"):
        check_section("sweep_verify_sustained", cfg)
    check_section("sweep_verify_sustained", dict(cfg, shapes=["16:8:64:8192"]))


def test_sustained_sweep_checks_the_memory_cap_before_allocating():
    """The sustained sweep counts a point's memory as the verify sweep does (point_bytes:
    cache, q and out, the split workspace) and refuses before touching the GPU."""
    from kdtree.harness.sweeps.verify_attn import point_bytes
    from kdtree.harness.sweeps.verify_sustained import measure_point

    need = point_bytes(16, 64, 8, 32768, 64)
    with pytest.raises(kgpu.MemoryBudgetError, match=f"needs {need / 2**30:.2f} GiB, over the gpu_mem_cap_gb"):
        measure_point({"batch": 16, "heads": 8, "D": 64, "prefix": 32768}, {"gpu_mem_cap_gb": 0.5, "seed": 0})


def test_flashmla_calls_rotate_the_copies_after_one_call_outside(monkeypatch):
    """Both verify sweeps time FlashMLA through verify_attn.flashmla_calls: its metadata and
    first call once, then each timing's calls read the cache copies in turn from the first."""
    import torch
    from kdtree.harness.sweeps.verify_attn import flashmla_calls

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    seen = []

    class FakeFlashMLA:
        def get_mla_metadata(self):
            seen.append("meta")
            return ("meta", None)

        def flash_mla_with_kvcache(self, q, kc, table, seq, dv, meta, softmax_scale, causal, use_legacy):
            assert kc.shape == (2, 64, 1, 576) and dv == 512 and meta == "meta" and causal and use_legacy
            seen.append(int(kc[0, 0, 0, 0]))

    caches = [torch.full((2, 64, 576), float(i)) for i in range(3)]
    calls = flashmla_calls(FakeFlashMLA(), None, caches, None, None, 0.1)
    assert seen == ["meta", 0]                     # the call outside any graph
    first, second = calls(), calls()
    for f in (first, first, first, first, second):
        f()
    assert seen[2:] == [0, 1, 2, 0, 0]             # in turn, and a new timing starts again


def test_alternating_order_gives_every_side_the_same_places():
    """kdtree and FlashMLA are timed in alternating replays (A B, B A, ...): each side gets
    `replays` of them, and over any two rounds the same mean place, so a drift over the
    timing (the board warming) falls on both alike."""
    from kdtree.harness.timing import alternating_order

    assert alternating_order(2, 4) == [0, 1, 1, 0, 0, 1, 1, 0]
    assert alternating_order(3, 2) == [0, 1, 2, 2, 1, 0]
    for sides, replays in ((2, 10), (3, 6), (1, 5)):
        order = alternating_order(sides, replays)
        places = {i: [k for k, j in enumerate(order) if j == i] for i in range(sides)}
        assert all(len(p) == replays for p in places.values())
        assert len({sum(p) for p in places.values()}) == 1


def test_graphs_timed_in_alternating_replays_keep_each_sides_samples(monkeypatch):
    """time_graphs_alternating: one graph a function, each replayed once untimed, then the
    timed replays in alternating_order, each side's samples (per call: over `inner`) summarised
    apart."""
    import torch
    from kdtree.harness import timing

    replayed = []

    class FakeGraph:
        def __init__(self, side):
            self.side = side

        def replay(self):
            replayed.append(self.side)

    def fake_capture(fn, inner, warmup):
        assert (inner, warmup) == (4, 3)
        return FakeGraph(fn()), None

    def fake_events(call, reps):
        call()
        return [{"a": 4e-6, "b": 8e-6}[replayed[-1]]] * reps

    monkeypatch.setattr(timing, "capture_graph", fake_capture)
    monkeypatch.setattr(timing, "_event_seconds", fake_events)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    a, b = timing.time_graphs_alternating([lambda: "a", lambda: "b"], replays=3, inner=4)
    assert replayed == ["a", "b"] + ["a", "b", "b", "a", "a", "b"]
    assert (a["median_us"], a["reps"], b["median_us"], b["reps"]) == (1.0, 3, 2.0, 3)
    replayed.clear()   # time_graph: the same with one side
    one = timing.time_graph(lambda: "b", replays=5, inner=4)
    assert replayed == ["b"] * 6 and (one["median_us"], one["reps"]) == (2.0, 5)


def test_report_says_how_kdtree_and_flashmla_were_timed(tmp_path):
    """The FlashMLA section names the timing order its rows record: alternating replays where
    the rows say so (`timing`), else kdtree first (the sets measured before)."""
    rows = [dict(heads=8, D=64, prefix=8192, batch=16, page_size=64, impl=impl, median_us=m, status="ok",
                 roofline_fraction=0.8, copy_fraction=0.2, floor_us=200.0)
            for impl, m in (("kdtree_kernel", 250.0), ("flashmla", 230.0))]
    for timing, says in ((None, "kdtree is timed first at each shape"), ("alternating", "replays alternate")):
        d = pd.DataFrame(rows) if timing is None else pd.DataFrame(rows).assign(timing=timing)
        d.to_parquet(tmp_path / "verify_attn.parquet")
        cli(["report", "--results", str(tmp_path), "--out", str(tmp_path / "r.md")])
        text = (tmp_path / "r.md").read_text()
        assert "kdtree against FlashMLA" in text and says in text, timing


def test_report_shows_the_sustained_table(tmp_path):
    rows = [dict(batch=16, heads=8, D=64, prefix=32768, page_size=64, impl=impl, burst_us=b, median_us=m, power_w=691.0,
                 sm_mhz=1700.0, temp_c=57.0, power_capped=1.0, status="ok")
            for impl, b, m in (("kdtree_kernel", 858.0, 979.0), ("flashmla", 875.0, 941.0))]
    pd.DataFrame(rows).to_parquet(tmp_path / "verify_sustained.parquet")
    cli(["report", "--results", str(tmp_path), "--out", str(tmp_path / "r.md")])
    text = (tmp_path / "r.md").read_text()
    assert "Verify attention under sustained load" in text
    assert "1.14" in text and "0.961" in text   # kdtree's sustained / burst; its speed over FlashMLA's
    from kdtree.harness.summary import summary
    assert ("(1 shapes, 1 of them held at the board's power limit): kdtree at 0.96-0.96x FlashMLA's speed, "
            "against 1.02-1.02x in short bursts") in summary(tmp_path)
    unsampled = pd.DataFrame(rows).assign(power_capped=float("nan"), sm_mhz=float("nan"))
    unsampled.to_parquet(tmp_path / "verify_sustained.parquet")
    assert "(1 shapes, board power not sampled)" in summary(tmp_path)
    from kdtree.harness import figures
    figures.verify_sustained(unsampled, tmp_path / "unsampled.png")   # the clock panel says why it is empty
    assert (tmp_path / "unsampled.png").stat().st_size > 0


@pytest.mark.skipif(kgpu.cuda_available(), reason="checks the message given without a CUDA device")
def test_gpu_only_sweeps_say_so_without_a_device(tmp_path):
    for which in ("verify-attn", "round", "verify-sustained"):
        with pytest.raises(SystemExit, match=f"sweep {which}: needs a CUDA device"):
            cli(["sweep", which, "--out", str(tmp_path / "x.parquet")])


def test_unreachable_probe_still_gives_the_declared_figure(tmp_path):
    pd.DataFrame([dict(batch=1, budget=16, impl="cpu_heapq", metric="batch_time", median_us=50.0,
                       status="ok")]).to_parquet(tmp_path / "tree_build.parquet")
    pd.DataFrame([dict(request_index=-1, ok=False, error="cannot reach http://127.0.0.1:1")]).to_parquet(
        tmp_path / "probe.parquet")
    pd.DataFrame([dict(verify_step_ms=None, stop_reason="cannot reach")]).to_parquet(
        tmp_path / "probe_summary.parquet")
    skipped = render_all(tmp_path)
    assert (tmp_path / "figures" / "step_breakdown.png").exists()
    assert any("measured no verify step" in s for s in skipped)


def test_provenance_commit_told_by_the_environment(monkeypatch):
    """A lent copy with a stale .git records the commit it is told, not git's HEAD."""
    from kdtree.harness import provenance
    monkeypatch.setenv("KDTREE_GIT_COMMIT", "0123456789abcdef0123456789abcdef01234567")
    monkeypatch.setenv("KDTREE_GIT_DIRTY", "0")
    provenance._static.cache_clear()
    try:
        info = provenance._static()
        assert info["git_commit"] == "0123456789abcdef0123456789abcdef01234567"
        assert info["git_dirty"] is False
    finally:
        provenance._static.cache_clear()


def _verify_rows(tmp_path, triton_us, ours_us, **at):
    """Verify-sweep rows of SGLang's Triton kernel and kdtree's at page size 1 (and a page-64
    row that must not be taken)."""
    base = dict(dict(batch=4, D=65, heads=8, prefix=8192, status="ok"), **at)
    pd.DataFrame([dict(base, impl="sglang_triton", page_size=1, median_us=triton_us),
                  dict(base, impl="kdtree_kernel", page_size=1, median_us=ours_us),
                  dict(base, impl="kdtree_kernel", page_size=64, median_us=1.0)]).to_parquet(
        tmp_path / "verify_attn.parquet")


def test_breakdown_projects_kdtree_sglang_attention(tmp_path):
    """With the verify sweep's Triton and kdtree rows: a third bar, the rest of the step less
    61 layers of Triton verify plus 61 of kdtree's, beside the GPU build and accept; the
    context from the probe's lengths (prompt + half the completion)."""
    pd.DataFrame([dict(batch=4, budget=64, impl="cpu_heapq", metric="batch_time", median_us=4000.0, status="ok"),
                  dict(batch=4, budget=64, impl="gpu_kernel", metric="device_time", median_us=40.0, status="ok")]
                 ).to_parquet(tmp_path / "tree_build.parquet")
    _accept_and_probe(tmp_path)
    pd.DataFrame([dict(ok=True, prompt_tokens=8000, completion_tokens=384)] * 3).to_parquet(tmp_path / "probe.parquet")
    _verify_rows(tmp_path, 200.0, 10.0)
    t = breakdown_table(tmp_path)
    att = t[t.scenario.str.contains("KDTREE_SGLANG_ATTENTION")].set_index("component").ms
    assert att["rest of step, less verify attention"] == pytest.approx(15.5 - 61 * 0.2)
    assert att["verify attention (kdtree, 61 layers)"] == pytest.approx(61 * 0.01)
    assert att.sum() == pytest.approx(15.5 - 61 * 0.19 + 0.04 + 0.005)
    assert "(assumed: the server reports no attention backend), 61 layers of 8 heads a GPU (K2's 64 heads, " \
           "TP 8 assumed)" in t.notes.iloc[0]
    assert "timed at" not in t.notes.iloc[0]   # 8000 + 384 / 2 = 8192: the exact row
    from kdtree.harness.figures import step_breakdown
    step_breakdown(t, tmp_path / "step.png")
    assert (tmp_path / "step.png").stat().st_size > 10_000


def test_breakdown_draws_no_attention_bar_where_triton_outlasts_the_step(tmp_path):
    pd.DataFrame([dict(batch=4, budget=64, impl="gpu_kernel", metric="device_time", median_us=40.0, status="ok")]
                 ).to_parquet(tmp_path / "tree_build.parquet")
    _accept_and_probe(tmp_path)
    _verify_rows(tmp_path, 1000.0, 10.0)   # 61 ms of Triton layers in a 20 ms step
    t = breakdown_table(tmp_path)
    assert not t.scenario.str.contains("KDTREE_SGLANG_ATTENTION").any()
    notes = t.notes.iloc[0]
    assert "a context of 8192 tokens assumed" in notes and "does not verify with it" in notes


def test_breakdown_reads_the_servers_backend_and_parallelism(tmp_path):
    """The probe's /server_info fields: Triton at TP 4 takes the 16-head rows; another backend
    draws no attention bar."""
    pd.DataFrame([dict(batch=4, budget=64, impl="gpu_kernel", metric="device_time", median_us=40.0, status="ok")]
                 ).to_parquet(tmp_path / "tree_build.parquet")
    _accept_and_probe(tmp_path)
    _verify_rows(tmp_path, 200.0, 10.0, heads=16)
    for backends, tp, bar in (('{"attention_backend": "triton"}', 4, True), ('{"attention_backend": "fa3"}', 4, False),
                              ('{"decode_attention_backend": "triton", "prefill_attention_backend": "fa3"}', 4, True)):
        pd.DataFrame([dict(verify_step_ms=20.0, concurrency=4, tree_budget=64, attention_backends=backends,
                           tp_size=tp)]).to_parquet(tmp_path / "probe_summary.parquet")
        t = breakdown_table(tmp_path)
        assert t.scenario.str.contains("KDTREE_SGLANG_ATTENTION").any() == bar, backends
        notes = t.notes.iloc[0]
        if bar:
            assert "(reported by the server), 61 layers of 16 heads a GPU (K2's 64 heads, TP 4, reported)" in notes
            assert "timed at" not in notes
        else:
            assert "not SGLang's Triton kernel, so no KDTREE_SGLANG_ATTENTION bar" in notes
