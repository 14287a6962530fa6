"""Every command README.md and docs/ show is exercised: run here (CPU-safe: a dry-run, or the
same flags against the loopback SGLang server), run by .ci/run, or named as GPU-only and run
by the pipeline on the GPU. A command the docs gain without an entry below fails this test.
Also: no link in the repository's Markdown points outside the repository."""
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from sglang_server import FakeSGLang  # tests/sglang_server.py

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "config" / "README.md"]
CI = (ROOT / ".ci" / "run").read_text()
COMMAND = re.compile(r"^(snakemake|python3? |pip |apptainer |scripts/|\.venv/)")

# How each documented command is exercised. ci: .ci/run runs this text; dry: a Snakemake
# dry-run of it here; run: this test runs it here; probe: run here against the loopback
# server (same flags, its URL); gpu: GPU-only, run on the H200 by the pipeline (the note
# names how); none: cannot run on these machines (the note says what checks it instead);
# pattern: a form, not a command (the note says what exercises it).
COVERED = {
    "python3 -m venv .venv && . .venv/bin/activate && pip install -c constraints.txt '.[test]' && snakemake --cores 2 all":
        ("ci", "snakemake --cores 2 all\n"),
    ".venv/bin/python -P -m pytest -q tests": ("ci", ".venv/bin/python -P -m pytest -q tests"),
    "pip install .": ("ci", "pip install -q -c constraints.txt '.[test]'"),
    "pip wheel --no-deps .": ("ci", "pip wheel -q --no-deps -w"),
    "pip wheel --no-deps kdtree-checkout/": ("ci", "pip wheel -q --no-deps -w"),
    "pip install -c constraints.txt '.[workflow]'": ("ci", "pip install -q -c constraints.txt '.[test]'"),
    "pip install kdtree-checkout/": ("ci", "pip install -q -c constraints.txt '.[test]'"),
    "snakemake --cores 8 all": ("dry", None),
    "snakemake --cores 1 figures --config results_dir=results/reference":
        ("ci", "snakemake --cores 1 figures --config results_dir=results/reference"),
    "python -m kdtree readme": ("ci", "python -m kdtree readme --check"),
    "python -m kdtree config-doc": ("ci", "python -m kdtree config-doc --check"),
    "python -m kdtree info": ("ci", "python -m kdtree info"),
    "snakemake ... --config key=value": ("pattern", "every --config in .ci/run and the dry-runs here"),
    "python -m kdtree check container ...": ("ci", "python -m kdtree check container containers/kdtree.def"),
    "snakemake --cores 32 all --resources gpu=8": ("dry", None),
    "snakemake --cores 1 all --report results/local/report.html":
        ("ci", "--report results/smoke/report.html"),   # the same flags on the smoke preset
    "snakemake --profile workflow/profiles/local all": ("dry", None),
    "snakemake --profile workflow/profiles/local all --configfile config/reference.yaml": ("dry", None),
    "snakemake --profile workflow/profiles/apptainer all": ("none", "needs Apptainer even to plan; CI dry-runs the same rules"),
    "python3 -m kdtree probe --url http://127.0.0.1:30000 --out probe.parquet --requests 16 --concurrency 1":
        ("probe", None),
    "python -m kdtree probe": ("probe", None),
    "python3 -m kdtree probe": ("probe", None),
    "python3 -m kdtree build": ("ci", "test -s build/kernels/libkdtree.so"),   # rule build_kernels, smoke run
    "python3 -m kdtree sweep tree-build": ("ci", "snakemake --cores 2 all --configfile config/smoke.yaml"),
    "python3 -m kdtree sweep tree-accept": ("ci", "snakemake --cores 2 all --configfile config/smoke.yaml"),
    "python3 -m kdtree report": ("ci", "test -s results/smoke/report.md"),
    "python3 -m kdtree test-gpu": ("gpu", "rule test_correctness of the reference run"),
    "python3 -m kdtree sweep verify-attn": ("gpu", "rule sweep_verify_attn_shard of the reference run"),
    "python3 -m kdtree sweep round": ("gpu", "rule sweep_gpu of the reference run"),
    "scripts/ab.sh": ("gpu", "session 34's A/Bs ran it end to end on the H200 (builds, alternating sweep "
                             "rounds; TESTS empty, each side's GPU tests run beside it)"),
    "scripts/ab_compare.py": ("run", None),
    "scripts/ab.sh OUT main=ab/main@SHA new=. variant=.:-DFLAG": ("pattern", "the scripts/ab.sh entry's form"),
    "scripts/ab_compare.py OUT main": ("pattern", "test_ab_compare_takes_every_side_against_the_base"),
    "scripts/ab_compare.py OUT BASE": ("pattern", "test_ab_compare_takes_every_side_against_the_base"),
    "scripts/verify_order.py": ("gpu", "the order probe in docs/kernels/verify_attention.md (session 47), run on "
                                       "the H200"),
    "scripts/verify_clock_probe.py": ("gpu", "the clock probe in docs/kernels/verify_attention.md (session 48), "
                                             "run on the H200"),
    "scripts/split_scan.py": ("gpu", "the split scan in docs/kernels/verify_attention.md, run on the H200"),
    "scripts/tail_probe.py": ("gpu", "session 82's probe on an H100 (ab/run200.sh; docs/kernels/verify_attention.md, "
                                     "v25)"),
    "scripts/tail_probe.py OUT.parquet": ("gpu", "the entry above's form"),
    "scripts/split_scan.py --kernel mma_sync --splits": ("gpu", "the entry below's form"),
    "scripts/split_scan.py OUT.parquet --kernel mma_sync --splits": (
        "gpu", "what ab/mma_probe.py timed for verify v26 and v27 on an H100 (session 83, ab/run304.sh, ab/run307.sh); "
               "the option's first run: session 84, ab/run401.sh, on the build held to sm_120's tiles"),
    "scripts/tail_probe.py --tail-kernels mma_sync": ("gpu", "session 83's probe on an H100 (ab/run300.sh; "
                                                             "docs/kernels/verify_attention.md, session 83)"),
    "scripts/tail_schedule_sim.py": ("run", "test_the_gated_rule_is_never_slower_in_the_model "
                                            "(tests/test_tail_schedule_sim.py)"),
    "scripts/split_scan.py --batches 1": ("gpu", "session 34's batch-1 scan in docs/kernels/verify_attention.md, "
                                                 "run on the H200"),
    "scripts/profile_tree_build.py": ("gpu", "a profile build on the H200; its first form made the session-22 "
                                             "phase list in docs/kernels/tree_build.md (refusing other builds: "
                                             "tests/test_kernel_host.py)"),
    "scripts/profile_tree_build.py --drafts confident": ("gpu", "session 84's layout profile on an H100 "
                                                               "(ab/run402.sh; docs/kernels/tree_build.md, v14)"),
    "scripts/profile_tree_build.py --drafts mixed": ("gpu", "session 86's budget-64 profile on an H100 "
                                                           "(ab/run602.sh; docs/kernels/tree_build.md, session 86)"),
    "scripts/fuzz_gpu.py --seconds 300 --seed 862": ("gpu", "session 86's campaign of every op on an H100 "
                                                          "(ab/run602.sh)"),
    "scripts/tree_build_floor.py": ("gpu", "session 87's floor on an H100 (ab/run605.sh; "
                                          "docs/kernels/tree_build.md, session 87)"),
    "scripts/tree_build_floor.py OUT.parquet": ("gpu", "the entry above's form"),
    "scripts/profile_tree_build.py --shapes 1:1:64 16:1:64": ("gpu", "session 87's budget-1 profile on an H100 "
                                                                    "(ab/run605.sh)"),
    "ncu --clock-control none -k regex:build_trees --launch-skip 3 --launch-count 1 --section WarpStateStats "
    "--section SourceCounters --warp-sampling-interval 0 -o tb python3 scripts/ncu_stalls.py launch 128:64:64":
        ("gpu", "session 31's stall sampling on the H200 (docs/kernels/tree_build.md)"),
    "ncu -i tb.ncu-rep --page source --csv --print-source sass > tb.csv": ("gpu", "the same run's export"),
    "scripts/ncu_stalls.py launch 128:64:64 --drafts confident": ("gpu", "session 44's stall sampling of the "
                                                                        "confident drafter's trees on the H200"),
    "python3 scripts/ncu_stalls.py summary tb.csv --reason no_inst": ("run", None),
    "scripts/ncu_stalls.py": ("run", None),
    "scripts/ptx_same.py BASE": ("run", "test_ptx_same_tells_moved_lines_from_changed_code"),
    "scripts/ptx_same.py HEAD --extra-flags=-DKD_SOME_FLAG=0": ("pattern", "test_ptx_same_tells_moved_lines_from_changed_code"),
    "scripts/ptx_same.py BASE --machine-code": ("pattern", "test_ptx_same_machine_code_tells_a_register_count_"
                                                           "from_an_instruction"),
    "scripts/fuzz_gpu.py": ("gpu", "session 61's fuzzing campaigns on the H200 (docs/kernels/README.md's record)"),
    "scripts/fuzz_gpu.py --seconds N --out F.jsonl": ("gpu", "the same campaigns' form (ab/run127.sh, ab/run128.sh)"),
    "scripts/fuzz_gpu.py --ops verify": ("gpu", "session 83's verify campaigns on an H100 (ab/run305.sh)"),
    "scripts/tree_build_host_twin.py": ("run", "test_host_twin_script_compares_libraries (tests/test_kernel_host.py)"),
    "scripts/tree_build_host_twin.py LIB --fuzz SECONDS": ("run", "test_host_twin_fuzz_checks_against_the_heap_build "
                                                            "(tests/test_kernel_host.py)"),
    "scripts/tree_build_host_time.py": ("gpu", "session 52 ran it on the H200 (docs/results.md's caller-latency lines)"),
    "scripts/verify_kernel_times.py": ("gpu", "CUPTI kernel times of verify calls on the H200 (session 32, "
                                              "docs/kernels/verify_attention.md)"),
    "scripts/fp64_chain_rate.cu": ("gpu", "written in session 84 for docs/kernels/tree_build.md's double-add reading; "
                                          "first run in session 85 on an H100 (ab/run500.sh; tree_build.md, v15)"),
    "scripts/wgmma_rate.cu": ("gpu", "session 41's step rates on the H200 (docs/kernels/verify_attention.md); "
                                     "built by nvcc alone, no library"),
    "scripts/profile_verify.py": ("gpu", "a profile build on the H200 (session 27); refusing other builds: "
                                         "tests/test_kernel_host.py"),
    "scripts/profile_verify.py --latency": ("gpu", "a profile build of c93256c on the H200 (session 36, "
                                                   "docs/kernels/verify_attention.md)"),
    "scripts/profile_verify.py --layout runs --latency": ("gpu", "a profile build of b644684 on the H200, page sizes 1 "
                                                                 "and 64 (session 56, docs/kernels/verify_attention.md)"),
    "python3 scripts/offline_peers.py peers --python 3.12": (
        "none", "needs PyPI: run by hand in session 64 (59 MB, the 71 SGLang files of the reference set); its "
                "import resolution: test_offline_peers_resolves_an_import_and_fetches_what_is_missing"),
    "scripts/offline_peers.py": ("none", "the entry above"),
    "pip install --no-index --no-deps --target /tmp/site peers/wheels/*.whl": (
        "gpu", "what scripts/reference_run.sh runs on the H200 (the set at 76cc2d5: ab/run140.sh, its form)"),
    "scripts/reference_run.sh peers results/local/reference": (
        "run", "test_reference_run_script_plans_the_set_and_resumes (tests/test_workflow.py), a dry-run"),
    "scripts/reference_run.sh": ("run", "the entry above"),
    "apptainer build --fakeroot --build-arg commit=$(git rev-parse HEAD) containers/kdtree.sif containers/kdtree.def":
        ("none", "no Apptainer here: CI checks the definition (kdtree check container)"),
    "apptainer test containers/kdtree.sif": ("none", "%test runs the README's test command, which CI runs"),
    "apptainer exec --nv containers/kdtree.sif snakemake --cores 8 all": ("none", "the pipeline itself is dry-run here"),
}


def documented() -> dict:
    cmds = {}
    for f in DOCS:
        text = f.read_text()
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            for line in block.splitlines():
                line = re.sub(r"\s+#.*$", "", line).strip()
                if line and not line.startswith("#"):
                    cmds.setdefault(line, f.relative_to(ROOT))
        for span in re.findall(r"`([^`\n]+)`", text):
            if COMMAND.match(span.strip()):
                cmds.setdefault(span.strip(), f.relative_to(ROOT))
    return cmds


def test_every_documented_command_has_a_way_it_is_exercised():
    missing = {c: str(f) for c, f in documented().items() if c not in COVERED}
    assert not missing, f"documented commands nobody runs (add them to COVERED): {missing}"


@pytest.mark.parametrize("cmd", [c for c, (how, _) in COVERED.items() if how == "ci"])
def test_ci_runs_it(cmd):
    assert COVERED[cmd][1] in CI, f"{cmd!r}: .ci/run does not run {COVERED[cmd][1]!r}"


def _snakemake_available():
    return shutil.which("snakemake") or (pathlib.Path(sys.executable).parent / "snakemake").exists()


@pytest.mark.skipif(not _snakemake_available(), reason="snakemake not installed")
@pytest.mark.parametrize("cmd", [c for c, (how, _) in COVERED.items() if how == "dry"])
def test_snakemake_commands_plan(cmd):
    env = dict(os.environ, PATH=f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}")
    argv = [sys.executable, "-m", "snakemake", *cmd.split()[1:], "-n", "--forceall", "--config", "gpu=true"]
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    assert "rule test_correctness:" in r.stdout + r.stderr and "Job stats" in r.stdout + r.stderr


def test_documented_probe_command_runs_against_a_server(tmp_path):
    cmd = "python3 -m kdtree probe --url http://127.0.0.1:30000 --out probe.parquet --requests 16 --concurrency 1"
    with FakeSGLang(ttft_s=0.005, step_s=0.002) as srv:
        argv = cmd.replace("http://127.0.0.1:30000", srv.url).replace("probe.parquet", str(tmp_path / "probe.parquet"))
        argv = [sys.executable, *argv.split()[1:]] + ["--max-new-tokens", "8"]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "16/16 requests ok" in r.stdout, r.stdout + r.stderr


def test_profile_verify_medians_leave_out_the_first_tile():
    """scripts/profile_verify.py's medians (the design notes' stamp tables): tiles 1.. only, the
    rest from P ready to the next tile's S issue, the request's latency where stamped."""
    spec = importlib.util.spec_from_file_location("profile_verify", ROOT / "scripts" / "profile_verify.py")
    pv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pv)
    s = [0] * pv.SLOTS
    t = 1000
    for i, (S, soft, rest) in enumerate([(5000, 4000, 3000), (100, 50, 20), (110, 60, 30), (120, 70, 40)]):
        s[3 + 4 * i], s[4 + 4 * i], s[5 + 4 * i] = t, t + S, t + S + soft
        if i < 3:
            s[6 + 4 * i] = t + 7  # warpgroup 1 requests tile i + 1 seven cycles after S(i) issues
        t += S + soft + rest
    med = pv.tile_medians(s)
    # request to S issue: tile 1 11,993 (behind tile 0's long period), tile 2 163, tile 3 193
    assert med == {"S": 110, "softmax": 60, "rest": 25, "request_to_s": 193}
    assert pv.tile_medians([0] * pv.SLOTS) == {}


def test_fuzz_cases_stay_within_their_caps():
    """scripts/fuzz_gpu.py's cases (drawn here, run on the GPU): JSON as written, the verify
    cases within the float64 reference's memory caps, and a case that crashes recorded as a
    failed line with its parameters, not raised."""
    import json

    import numpy as np
    spec = importlib.util.spec_from_file_location("fuzz_gpu", ROOT / "scripts" / "fuzz_gpu.py")
    fz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fz)
    rng = np.random.default_rng(0)
    for _ in range(300):
        v = fz.verify_case(rng)
        assert json.loads(json.dumps(v)) == v
        assert v["D"] * v["H"] <= 16384 and v["D"] * v["H"] * (v["pmax"] + v["D"]) <= 200_000_000, v
        assert v["B"] == 1 or v["B"] * (v["pmax"] + v["D"]) <= 400_000, v
        b, a = fz.build_case(rng), fz.accept_case(rng)
        assert json.loads(json.dumps(b)) == b and json.loads(json.dumps(a)) == a
        assert 0 <= b["budget_max"] <= 1024 and b["budget_max"] + 1 + b["extra_slots"] <= 1025, b
    r = fz.run_one("build", {"seed": 1})  # no shape: a KeyError inside the case
    assert r["ok"] is False and r["why"].startswith("KeyError") and r["case"] == {"seed": 1}


def test_ab_compare_reads_an_ab_folder(tmp_path):
    import pandas as pd
    for v, us in (("old", 10.0), ("new", 9.0)):
        for rep in (1, 2):
            pd.DataFrame([dict(batch=1, budget=64, impl="gpu_kernel", metric="device_time", median_us=us,
                               status="ok")]).to_parquet(tmp_path / f"{v}_tree-build_{rep}.parquet")
            pd.DataFrame([dict(batch=1, D=65, impl="gpu_kernel", metric="device_time", median_us=us,
                               status="ok")]).to_parquet(tmp_path / f"{v}_tree-accept_{rep}.parquet")
            pd.DataFrame([dict(heads=8, D=16, prefix=8192, batch=1, page_size=64, impl="kdtree_kernel",
                               median_us=us, status="ok")]).to_parquet(tmp_path / f"{v}_verify-attn_{rep}.parquet")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "ab_compare.py"), str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "0.9" in r.stdout, r.stderr


def test_ab_compare_takes_every_side_against_the_base(tmp_path):
    import pandas as pd
    for side, us in (("main", 10.0), ("new", 9.0), ("gated", 12.5)):
        for rep, jitter in ((1, 0.0), (2, 1.0)):
            pd.DataFrame([dict(heads=8, D=16, prefix=8192, batch=1, page_size=64, impl="kdtree_kernel",
                               median_us=us + jitter, status="ok")]).to_parquet(tmp_path / f"{side}_verify-attn_{rep}.parquet")
    (tmp_path / "sides.txt").write_text("main\nnew\ngated\n")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "ab_compare.py"), str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "new/main" in r.stdout and "gated/main" in r.stdout
    assert "0.905" in r.stdout and "1.238" in r.stdout   # medians over the rounds: 9.5 / 10.5, 13 / 10.5
    assert "new/main by round (median over points): round 1: 0.900, round 2: 0.909" in r.stdout, r.stdout
    assert "gated/main by round (median over points): round 1: 1.250, round 2: 1.227" in r.stdout
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "ab_compare.py"), str(tmp_path), "new"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "main/new" in r.stdout and "1.105" in r.stdout, r.stdout + r.stderr


def refused(cmd: list) -> str:
    """A script run that must fail: its stderr, for the message it names."""
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode != 0, r.stdout
    return r.stderr


def test_ncu_stalls_summarises_a_source_page(tmp_path):
    header = ('"Address","Source","# Samples","Instructions Executed","stall_barrier","stall_no_inst",'
              '"stall_no_inst (Not Issued)","stall_wait"')
    rows = ['"0x7f0000000000","LDC R1, c[0x0][0x28]","40","2048","0","30","30","10"',
            '"0x7f0000000010","S2R R5, SR_CTAID.X","2","2048","0","0","0","2"',
            '"0x7f0000000200","BSYNC B0","58","2048","8","50","50","0"']
    csv_path = tmp_path / "tb.csv"
    csv_path.write_text('"Kernel Name","build_trees_kernel"\n' + "\n".join([header, *rows]) + "\n")
    cmd = [sys.executable, str(ROOT / "scripts" / "ncu_stalls.py"), "summary", str(csv_path), "--top", "2"]
    r = subprocess.run(cmd + ["--reason", "no_inst"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "100 samples" in r.stdout and "no_inst" in r.stdout and "80.0%" in r.stdout
    assert "top 2 instructions by no_inst: 80 of 80 samples" in r.stdout
    assert "+0x00200" in r.stdout and "BSYNC B0" in r.stdout and "S2R" not in r.stdout.split("top 2")[1]
    assert "--reason: expected one of" in refused(cmd + ["--reason", "nonsense"])
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    assert "expected `ncu --page source --csv` output" in refused(cmd[:3] + [str(other)])


def test_ncu_stalls_sums_a_cuda_sass_page_by_source_line(tmp_path):
    """Each instruction counts once, under the first line that lists it (inlined code is listed
    again under its call site); a span sums a file's stretch of lines."""
    header = ('"Line No","Source","Address","Source","Warp Stall Sampling (All Samples)","# Samples",'
              '"stall_barrier","stall_no_inst","stall_no_inst (Not Issued)","stall_wait"')
    a = ['"10","for (...)","-","-","40","40","0","30","30","10"',
         '"","","0x7f0000000000","LDC R1","40","40","0","30","30","10"',
         '"12","__syncthreads();","-","-","60","60","60","0","0","0"',
         '"","","0x7f0000000010","BAR.SYNC 0x0","60","60","60","0","0","0"']
    b = ['"3","inline helper","-","-","100","100","0","0","0","100"',
         '"","","0x7f0000000000","LDC R1","40","40","0","30","30","10"',
         '"","","0x7f0000000020","LDS R2","100","100","0","0","0","100"']
    text = ['"File Path","/src/a.cu"', '"Function Name","k"', header, *a,
            '"File Path","/src/b.cuh"', '"Function Name","k"', header, *b]
    csv_path = tmp_path / "tb_cs.csv"
    csv_path.write_text("\n".join(text) + "\n")
    cmd = [sys.executable, str(ROOT / "scripts" / "ncu_stalls.py"), "sources", str(csv_path)]
    r = subprocess.run(cmd + ["--span", "a.cu:11-12"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "3 instructions, 200 samples" in r.stdout
    by_file = r.stdout.split("by source file:")[1].split("top")[0]
    assert re.search(r"a\.cu\s+100\s+50\.0%\s+barrier 60%, no_inst 30%, wait 10%", by_file), r.stdout
    assert re.search(r"b\.cuh\s+100\s+50\.0%\s+wait 100%", by_file), r.stdout
    assert re.search(r"a\.cu:11-12\s+60\s+30\.0%\s+barrier 100%", by_file), r.stdout
    lines = r.stdout.split("source lines:")[1]
    assert lines.index("b.cuh:3") < lines.index("a.cu:12") < lines.index("a.cu:10")
    assert "--span: expected file:A-B" in refused(cmd + ["--span", "a.cu:12-11"])
    other = tmp_path / "sass_only.csv"
    other.write_text('"Address","Source","# Samples"\n"0x0","LDC R1","4"\n')
    assert "--print-source cuda,sass" in refused(cmd[:3] + [str(other)])
    assert "csv: cannot read" in refused(cmd[:3] + [str(tmp_path / "missing.csv")])


def test_no_link_leaves_the_repository():
    bad = []
    for f in ROOT.rglob("*.md"):
        rel = f.relative_to(ROOT)
        if rel.parts[0] in (".venv", "build", "ab", ".pytest_cache", "results") or ".egg-info" in str(rel):
            continue
        text = f.read_text(errors="replace")
        if "../shared" in text:
            bad.append(f"{rel}: mentions ../shared")
        for target in re.findall(r"\]\(([^)#\s]+)", text):
            if re.match(r"[a-z]+://", target):
                bad.append(f"{rel}: external link {target}")
                continue
            dest = (f.parent / target).resolve()
            if ROOT not in dest.parents and dest != ROOT:
                bad.append(f"{rel}: {target} points outside the repository")
            elif not dest.exists():
                bad.append(f"{rel}: {target} does not exist")
    assert not bad, bad


def test_ncu_stalls_launch_names_a_bad_drafter():
    """Checked before anything touches the GPU, so it runs here."""
    stderr = refused([sys.executable, str(ROOT / "scripts" / "ncu_stalls.py"), "launch", "1:64:64", "--drafts", "sure"])
    assert "--drafts: expected one of ('mixed', 'confident'), got 'sure'" in stderr


def test_ab_sh_refuses_a_side_without_the_config_schema(tmp_path):
    """A side tree that lacks the schema the sweeps check their config against (a partial
    `git archive`) is refused before the builds, naming the side, not after them on the GPU."""
    side = tmp_path / "side"
    (side / "kdtree").mkdir(parents=True)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "ab.sh"), str(tmp_path / "out"), f"main={side}", "new=."],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and "has no workflow/schemas/config.schema.yaml (side main" in r.stderr
    assert not (tmp_path / "out" / "build").exists()


def test_ab_sh_default_grids_pass_the_sweeps_schema():
    """scripts/ab.sh's default --cfg-json of each sweep is what `kdtree sweep` accepts (a bad
    key or value would only show on the GPU machine, after the builds and tests)."""
    import json

    from kdtree.cli import DEFAULTS
    from kdtree.harness.config import check_section

    text = (ROOT / "scripts" / "ab.sh").read_text()
    grids = {}
    for var, section in (("CFG_TREE_BUILD", "tree_build"), ("CFG_TREE_ACCEPT", "tree_accept"),
                         ("CFG_VERIFY_ATTN", "verify_attn")):
        m = re.search(var + r"=\$\{" + var + r":-'(\{.*?\})'\}", text)
        assert m, f"scripts/ab.sh: no default for {var}"
        grids[var] = json.loads(m.group(1))
        cfg = {**DEFAULTS[section], **grids[var]}
        check_section(f"sweep_{section}", {k: v for k, v in cfg.items() if k != "gpu_mem_cap_gb"})
    # The tree build's default is issue 29's definition: both drafters, K = min(budget, 256).
    tb = grids["CFG_TREE_BUILD"]
    assert tb["drafts"] == ["mixed", "confident"] and tb["max_topk"] == 256


def _nvcc_found() -> bool:
    """The build's own lookup (kdtree.build.find_nvcc), which scripts/ptx_same.py uses."""
    from kdtree import build
    try:
        build.find_nvcc()
    except RuntimeError:
        return False
    return True


@pytest.mark.skipif(not _nvcc_found(), reason="needs nvcc (CI has it)")
def test_ptx_same_tells_moved_lines_from_changed_code(tmp_path):
    """scripts/ptx_same.py: lines added above the code (which move the anonymous-namespace
    names' tag) leave the PTX the same; a changed constant does not; a bad base or source is
    an error naming the argument."""
    def run(*args):
        return subprocess.run([sys.executable, str(ROOT / "scripts" / "ptx_same.py"), *args],
                              capture_output=True, text=True, timeout=600, cwd=ROOT)
    src = "tree_accept_parents.cu"
    base = tmp_path / "base"
    shutil.copytree(ROOT / "kernels", base / "kernels")
    text = (base / "kernels" / "src" / src).read_text()
    (base / "kernels" / "src" / src).write_text("// two lines more\n// above the code\n" + text)
    r = run(str(base), "--sources", src)
    assert r.returncode == 0 and "same PTX" in r.stdout, r.stdout + r.stderr
    assert r.stdout.count(": same") == 3   # compute_90a, compute_120, compute_90
    (base / "kernels" / "src" / src).write_text(text.replace("AP_THREADS = 256", "AP_THREADS = 128"))
    r = run(str(base), "--sources", src, "--archs", "sm_90a")
    assert r.returncode == 1 and "differs" in r.stdout, r.stdout + r.stderr
    r = run(str(tmp_path / "nothing-here"), "--sources", src)
    assert r.returncode == 2 and "BASE must be a commit or a folder" in r.stderr
    r = run(str(base), "--sources", "no_such.cu")
    assert r.returncode == 2 and "--sources" in r.stderr


TINY_PTX = """.version 8.0
.target sm_90
.address_size 64
.visible .entry tiny(.param .u64 out)
{
  .reg .b32 %r<REGS>;
  .reg .b64 %rd<3>;
  ld.param.u64 %rd1, [out];
  cvta.to.global.u64 %rd2, %rd1;
  mov.u32 %r1, %tid.x;
  VALUE
  st.global.u32 [%rd2], %r2;
  ret;
}
"""


@pytest.mark.skipif(not _nvcc_found(), reason="needs nvcc (CI has it)")
def test_ptx_same_machine_code_tells_a_register_count_from_an_instruction(tmp_path):
    """scripts/ptx_same.py --machine-code: two PTX texts that differ only in a register
    count declared assemble to the same cubin; a changed constant does not, and the
    function whose code differs is named."""
    spec = importlib.util.spec_from_file_location("ptx_same", ROOT / "scripts" / "ptx_same.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def cubin(regs, value, side):
        ptx = TINY_PTX.replace("REGS", str(regs)).replace("VALUE", f"add.u32 %r2, %r1, {value};")
        return mod.cubin_of(ptx, "compute_90", tmp_path, side)

    base = cubin(3, 1, "base")
    assert base[:4] == b"\x7fELF"
    assert cubin(9, 1, "this") == base
    changed = cubin(3, 2, "this")
    assert changed != base and list(mod.text_sections(base)) == ["tiny"]
    assert mod.code_differences(changed, base).startswith("tiny (")


def test_offline_peers_resolves_an_import_and_fetches_what_is_missing(tmp_path):
    """scripts/offline_peers.py's import resolution on a package made here: the files under
    the package's root that the import loads, and each missing module fetched once."""
    spec = importlib.util.spec_from_file_location("offline_peers", ROOT / "scripts" / "offline_peers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    root, scratch = tmp_path / "root", tmp_path / "scratch"
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("from . import a\n")
    (root / "pkg" / "a.py").write_text("import kd_fake_dep\nfrom .sub import b\n")
    (root / "pkg" / "sub" / "__init__.py").write_text("")
    (root / "pkg" / "sub" / "b.py").write_text("X = 1\n")
    (root / "pkg" / "unused.py").write_text("raise SystemExit('never imported')\n")
    fetched = []

    def fetch(dist, where):
        fetched.append(dist)
        where.mkdir(exist_ok=True)
        (where / "kd_fake_dep.py").write_text("Y = 2\n")

    got = mod.resolve("pkg.sub.b", root, scratch, fetch)
    assert fetched == ["kd_fake_dep"]
    assert got["files"] == ["pkg/__init__.py", "pkg/a.py", "pkg/sub/__init__.py", "pkg/sub/b.py"]
    with pytest.raises(RuntimeError, match="still missing"):
        mod.resolve("pkg", root, tmp_path / "empty", lambda dist, where: None, tries=2)
    assert mod.skip("Nvidia_cublas") and mod.skip("torch") and not mod.skip("pydantic")
