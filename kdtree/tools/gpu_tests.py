"""Run the GPU test suite under pytest and keep its outcomes as Parquet rows."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

import pandas as pd

from ..harness.provenance import ROOT, new_run_id, provenance
from ..harness.results import write_parquet_atomic


def junit_rows(xml_path) -> list[dict]:
    rows = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or "")[:500]
        rows.append({"test_id": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                     "duration_s": float(case.get("time") or 0.0), "message": message})
    return rows


def run_gpu_tests(out, library=None, extra_args=()) -> int:
    env = dict(os.environ)
    if library:
        env["KDTREE_LIB"] = str(pathlib.Path(library).resolve())
    with tempfile.TemporaryDirectory() as tmp:
        xml = pathlib.Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", str(ROOT / "tests"),
               f"--junitxml={xml}", *extra_args]
        rc = subprocess.run(cmd, env=env, cwd=ROOT).returncode
        rows = junit_rows(xml) if xml.exists() else [
            {"test_id": "<session>", "outcome": "error", "duration_s": 0.0, "message": f"pytest exit {rc}"}]
    prov = provenance(new_run_id(), {}, library)
    write_parquet_atomic(pd.DataFrame([dict(r, **prov) for r in rows]), out)
    counts = pd.Series([r["outcome"] for r in rows]).value_counts().to_dict()
    print(f"test-gpu: {counts} -> {out}")
    return gate(rows, rc)


def gate(rows: list[dict], rc: int) -> int:
    """The rule's exit status. Failures are rows (they block the sweeps, which read them),
    so pytest's 1 passes; but a run in which no GPU test ran (none collected, or all
    skipped: no device, a library that did not load) fails, since the sweeps would
    otherwise time kernels nothing checked."""
    ran = [r for r in rows if r["outcome"] in ("passed", "failed", "error")]
    if not ran:
        skipped = [r for r in rows if r["outcome"] == "skipped"]
        why = f"all {len(skipped)} skipped, e.g. {skipped[0]['message']!r}" if skipped else "none collected"
        print(f"test-gpu: no GPU test ran ({why})", file=sys.stderr)
        return 1
    return 0 if rc in (0, 1) else rc
