"""The workflow end to end on CPU with the probe requested from config, against the
loopback SGLang server: probe_service runs, and the whole-step breakdown is rendered."""
import os
import pathlib
import shutil
import subprocess
import sys

import pandas as pd
import pytest
import yaml

from sglang_server import FakeSGLang  # tests/sglang_server.py

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("snakemake") is None and not (pathlib.Path(sys.executable).parent / "snakemake").exists(),
                    reason="snakemake not installed")
def test_probe_rule_and_breakdown_from_config(tmp_path):
    rd = tmp_path / "results"
    with FakeSGLang(ttft_s=0.02, step_s=0.01, accept=3) as srv:
        cfg = yaml.safe_load((ROOT / "config/smoke.yaml").read_text())
        cfg["results_dir"] = str(rd)
        cfg["gpu"] = False
        cfg["probe"] = {"url": srv.url, "requests": 3, "concurrency": 1, "max_new_tokens": 16,
                        "timeout_s": 10, "max_wall_s": 60, "max_consecutive_failures": 2, "prompts": ""}
        cfgfile = tmp_path / "cfg.yaml"
        cfgfile.write_text(yaml.safe_dump(cfg))
        env = dict(os.environ, PATH=f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}")
        r = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", "all", "--configfile",
                            str(cfgfile), "--directory", str(ROOT)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = pd.read_parquet(rd / "probe.parquet")
    assert len(rows) == 3 and rows.ok.all()
    summary = pd.read_parquet(rd / "probe_summary.parquet")
    assert summary.verify_step_ms.iloc[0] > 0 and summary.tree_budget.iloc[0] == 64
    assert (rd / "figures" / "step_breakdown.png").stat().st_size > 10_000
    report = (rd / "report.md").read_text()
    assert "Whole step" in report
    # no GPU here: the projection takes the kernels' times from the committed H200 reference set
    assert "projected: GPU kernels (Amdahl; kernel times from results/reference (NVIDIA H200))" in report
