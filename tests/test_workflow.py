"""The Snakemake workflow's plan, read from dry-runs: what a rule depends on, what it
writes, what a run says it skips; and re-rendering the reference figures changes nothing."""
import filecmp
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(
    shutil.which("snakemake") is None and not (pathlib.Path(sys.executable).parent / "snakemake").exists(),
    reason="snakemake not installed")


def snakemake(*args, timeout=600):
    env = dict(os.environ, PATH=f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}", MPLBACKEND="Agg")
    r = subprocess.run([sys.executable, "-m", "snakemake", *map(str, args), "--directory", str(ROOT)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return r.stdout + r.stderr


def jobs(plan: str) -> list[dict]:
    """The dry-run's jobs: rule name, input and output lists."""
    out = []
    for block in re.split(r"\n(?=(?:local)?rule )", plan):
        m = re.match(r"(?:local)?rule (\w+):", block)
        if not m:
            continue
        field = lambda k: [x.strip() for x in (re.search(rf"^\s+{k}: (.*)$", block, re.M) or [None, ""])[1].split(",")
                           if x.strip()]
        out.append({"rule": m.group(1), "input": field("input"), "output": field("output")})
    return out


def test_every_sweep_depends_on_the_code_behind_its_numbers():
    plan = jobs(snakemake("-n", "--forceall", "--cores", 8, "all", "--config", "gpu=true"))
    sweeps = [j for j in plan if j["rule"].startswith("sweep_")]
    assert {j["rule"] for j in sweeps} >= {"sweep_tree_build_shard", "sweep_tree_accept",
                                           "sweep_verify_attn_shard", "sweep_gpu"}
    for j in sweeps:
        name = pathlib.Path(j["output"][0]).stem
        module = {"batch": "tree_build", "heads": "verify_attn"}.get(re.sub(r"\d+$", "", name), name)
        for code in (f"kdtree/harness/sweeps/{module}.py", "kdtree/harness/timing.py",
                     "kdtree/harness/workloads.py", "kdtree/ops.py"):
            assert code in j["input"], (j["rule"], code, j["input"])


def test_a_cpu_dry_run_says_what_it_skips():
    text = snakemake("-n", "--cores", 2, "all", "--configfile", "config/smoke.yaml", "--config", "gpu=false")
    assert "kdtree: skipped GPU rules (test_correctness, sweep_verify_attn, sweep_gpu: round" in text
    assert "kdtree: skipped probe_service: no probe.url in config" in text


def test_rerendering_the_reference_figures_changes_nothing(tmp_path):
    ref = ROOT / "results" / "reference"
    copy = tmp_path / "reference"
    shutil.copytree(ref, copy, ignore=shutil.ignore_patterns(".snakemake*", "logs", ".rendered"))
    plan = jobs(snakemake("-n", "--cores", 1, "figures", "--config", f"results_dir={copy}"))
    render = [j for j in plan if j["rule"] == "render_cached_figures"][0]
    assert sorted(pathlib.Path(o).name for o in render["output"]) == \
        sorted([".rendered"] + [p.name for p in (ref / "figures").glob("*.png")])   # declares all it writes
    snakemake("--cores", 1, "figures", "--config", f"results_dir={copy}")
    for f in sorted(ref.rglob("*")):
        if f.is_file() and ".snakemake" not in str(f) and "logs" not in f.parts and f.name != ".rendered":
            twin = copy / f.relative_to(ref)
            assert filecmp.cmp(f, twin, shallow=False), f"re-rendering changed {f.relative_to(ROOT)}"


def reference_run(tmp_path, peers_made=True):
    """scripts/reference_run.sh as a dry run: (call(*args, **env), peers, results folder)."""
    peers, site, rd = tmp_path / "peers", tmp_path / "site", tmp_path / "set"
    (site / "snakemake").mkdir(parents=True)            # the wheels counted as installed
    if peers_made:
        (peers / "wheels").mkdir(parents=True)
        (peers / "sglang").mkdir()
    env = dict(os.environ, PYTHON=sys.executable, SITE=str(site), CONFIG="gpu=true", SNAKEMAKE_ARGS="-n")

    def call(*args, **extra):
        return subprocess.run(["bash", str(ROOT / "scripts/reference_run.sh"), *map(str, args)], cwd=ROOT,
                              env=dict(env, **extra), capture_output=True, text=True, timeout=300)
    return call, peers, rd


def test_reference_run_script_plans_the_set_and_resumes(tmp_path):
    """scripts/reference_run.sh (the reference set on a node without PyPI), dry-run: the whole
    GPU plan into the folder it is given, the peers' folders checked before any work, and a
    second call on the same folder resuming without rerunning jobs for their files' times."""
    run, peers, rd = reference_run(tmp_path, peers_made=False)
    r = run(peers, rd)
    assert r.returncode == 2 and f"PEERS: {peers} has no wheels/ folder" in r.stderr
    (peers / "wheels").mkdir(parents=True)
    (peers / "sglang").mkdir()
    r = run(peers, rd, GIT_DIR=str(tmp_path / "no-git"))
    assert r.returncode == 2 and "set KDTREE_GIT_COMMIT" in r.stderr
    r = run(peers, rd)
    assert r.returncode == 0, r.stderr
    log = (rd / "logs" / "snakemake.log").read_text()
    planned = {j["rule"] for j in jobs(log)}
    assert {"test_correctness", "sweep_verify_attn_shard", "sweep_gpu", "report"} <= planned
    assert f"{rd}/test_correctness.parquet" in log and "--workers" in log and "results/reference/" not in log
    r = run(peers, rd)
    assert r.returncode == 0 and "resuming" in r.stderr
    assert "--rerun-triggers params input software-env code" in (rd / "logs" / "snakemake.log").read_text()


def test_reference_run_script_unlocks_what_a_killed_run_left(tmp_path):
    """A snakemake killed at LIMIT leaves the tree locked (seen on the H100, session 75), which
    made the next call fail at once; the script now unlocks it where no snakemake runs here."""
    run, peers, rd = reference_run(tmp_path)
    locks = ROOT / ".snakemake" / "locks"
    if locks.is_dir() and any(locks.iterdir()):
        pytest.skip("this tree holds snakemake locks already")
    locks.mkdir(parents=True, exist_ok=True)
    ours = locks / "0.output.lock"
    ours.write_text(f"{rd}/report.md\n")
    try:
        r = run(peers, rd)
        assert r.returncode == 0, r.stderr
        assert "unlocked the tree a killed run had left locked" in r.stderr
        assert not ours.exists()
    finally:
        ours.unlink(missing_ok=True)
