"""Checks CI can make without Apptainer or SLURM: the container definition and the
resources a SLURM plan asks for."""
from __future__ import annotations

import pathlib
import re

BASE_RE = re.compile(r"^From:\s*nvidia/cuda:13\.0\.\d+-devel-ubuntu24\.04\s*$", re.M)
SECTIONS = ("%arguments", "%labels", "%files", "%post", "%environment", "%runscript", "%test")


def _sections(text: str) -> dict:
    out, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"^(%\w+)", line)
        if m:
            cur = m.group(1)
            out[cur] = []
        elif cur:
            out[cur].append(line)
    return {k: "\n".join(v) for k, v in out.items()}


def pins(text: str) -> dict:
    return {m.group(1).lower().replace("_", "-"): m.group(2)
            for m in re.finditer(r"(?<![\w.\-])([A-Za-z][A-Za-z0-9_.\-]*)==([^\s;#'\"]+)", text)}


def readme_test_command(readme: str) -> str:
    """The first command of the README's 'Run the tests' block."""
    m = re.search(r"Run the tests:\s*```bash\s*\n(.+?)\n", readme)
    if not m:
        raise ValueError("README.md: no 'Run the tests:' bash block")
    return m.group(1).strip()


def check_container(def_path, constraints_path, readme_path) -> list[str]:
    """Problems found in the definition (an empty list: it passes)."""
    text = pathlib.Path(def_path).read_text()
    problems = []
    if not re.search(r"^Bootstrap:\s*docker\s*$", text, re.M):
        problems.append("header: expected 'Bootstrap: docker'")
    if not BASE_RE.search(text):
        problems.append("header: base must be nvidia/cuda:13.0.x-devel-ubuntu24.04")
    sec = _sections(text)
    problems += [f"missing section {s}" for s in SECTIONS if s not in sec]
    lock = pins(pathlib.Path(constraints_path).read_text())
    for name, ver in pins(sec.get("%post", "")).items():
        if lock.get(name) != ver:
            problems.append(f"%post pins {name}=={ver}, constraints.txt has {lock.get(name)}")
    post = sec.get("%post", "")
    if "-c /opt/kdtree/constraints.txt" not in post:
        problems.append("%post: the project must be installed with -c constraints.txt (the repo's lock)")
    if re.search(r"pip install[^\n]* -e ", post):
        problems.append("%post: install kdtree as a package, not editable (-e): the image must not need its sources")
    if "venv" not in post:
        problems.append("%post: Python packages must go into a venv (Ubuntu 24.04 refuses system pip)")
    test_cmd = readme_test_command(pathlib.Path(readme_path).read_text())
    if test_cmd not in sec.get("%test", ""):
        problems.append(f"%test must run the README's test command: {test_cmd}")
    for label in ("version", "revision"):
        if label not in sec.get("%labels", ""):
            problems.append(f"%labels: no {label}")
    if "snakemake" not in sec.get("%runscript", ""):
        problems.append("%runscript: should run the pipeline (snakemake)")
    return problems


def check_slurm_plan(text: str) -> list[str]:
    """In a dry-run's job list: GPU rules ask for gpu=1, CPU rules for none."""
    problems, rule = [], None
    gpu_rules = {"test_correctness", "sweep_verify_attn_shard", "sweep_gpu"}
    cpu_rules = {"gather_tree_build", "gather_verify_attn", "report", "build_kernels"}
    seen = set()
    for line in text.splitlines():
        m = re.match(r"^(?:local)?rule (\w+):", line.strip())
        if m:
            rule = m.group(1)
            continue
        if rule and line.strip().startswith("resources:"):
            has_gpu = re.search(r"\bgpu=1\b", line) is not None
            seen.add(rule)
            if rule in gpu_rules and not has_gpu:
                problems.append(f"{rule}: a GPU rule without gpu=1")
            if rule in cpu_rules and has_gpu:
                problems.append(f"{rule}: a CPU rule asking for a GPU")
            rule = None
    missing = (gpu_rules | {"gather_tree_build", "report"}) - seen
    problems += [f"{r}: not in the plan" for r in sorted(missing)]
    return problems
