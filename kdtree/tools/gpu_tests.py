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


def collect_ids(env, extra_args=()) -> list[str]:
    """The GPU tests' node ids as pytest collects them (empty where collection fails: the
    single run then records the error as a row)."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu",
           str(ROOT / "tests"), *extra_args]
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        return []
    return [line.strip() for line in r.stdout.splitlines() if "::" in line and not line.startswith(" ")]


def deal(ids: list[str], workers: int) -> list[list[str]]:
    """Round-robin, so one test's parametrized cases (the slow CPU references) spread over
    every worker."""
    return [ids[i::workers] for i in range(min(workers, len(ids)))]


def run_shards(shards, env, tmp) -> tuple[list[dict], int]:
    """Each shard one pytest process on the same GPU, its own junit file and basetemp; the
    outcomes merged, each shard's output printed whole as it ends."""
    procs = []
    env = dict(env)
    # torch's CPU references thread over every core in each process: split the cores instead.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // len(shards))))
    for i, ids in enumerate(shards):
        xml, log = tmp / f"junit{i}.xml", open(tmp / f"shard{i}.log", "w")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
               f"--basetemp={tmp / f'base{i}'}", *ids]
        procs.append((i, xml, log, subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)))
    rows, rcs = [], []
    for i, xml, log, proc in procs:
        rc = proc.wait()
        log.close()
        print(f"--- test-gpu shard {i + 1}/{len(procs)}: {len(shards[i])} tests, pytest exit {rc}")
        print((tmp / f"shard{i}.log").read_text()[-20000:], end="", flush=True)
        rcs.append(rc)
        got = junit_rows(xml) if xml.exists() else []
        if len(got) < len(shards[i]):   # pytest broke before recording them all: a row says so
            got.append({"test_id": f"<shard {i + 1}>", "outcome": "error", "duration_s": 0.0,
                        "message": f"pytest exit {rc}: {len(shards[i]) - len(got)} of {len(shards[i])} tests not recorded"})
        rows += got
    worst = [rc for rc in rcs if rc not in (0, 1)]
    return rows, worst[0] if worst else max(rcs)


def run_gpu_tests(out, library=None, extra_args=(), workers=1) -> int:
    """workers > 1 deals the collected tests over that many pytest processes sharing the GPU
    (the tests' CPU references are most of their time); extra_args then only choose what is
    collected."""
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers: expected an integer >= 1, got {workers!r}")
    env = dict(os.environ)
    if library:
        env["KDTREE_LIB"] = str(pathlib.Path(library).resolve())
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        shards = deal(collect_ids(env, extra_args), workers) if workers > 1 else []
        if len(shards) > 1:
            rows, rc = run_shards(shards, env, tmp)
        else:
            xml = tmp / "junit.xml"
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
