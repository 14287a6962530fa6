"""`python -m kdtree ...`: the commands the Snakemake rules call (and people, too)."""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

from .harness import figure_names

DEFAULTS = {  # used when a command runs without --cfg-json (handy by hand)
    "tree_build": {"batches": [1, 4, 16], "budgets": [16, 64, 256], "L": 15, "vocab": 32000, "seed": 0,
                   "cpu_reps": 3, "cpu_max_seconds": 5.0, "gpu_replays": 20, "gpu_mem_cap_gb": 8.0},
    "tree_accept": {"batches": [1, 16], "slots": [17, 65], "L": 15, "seed": 0, "cpu_reps": 3,
                    "cpu_max_seconds": 5.0, "gpu_replays": 20},
    "round": {"batches": [1, 16], "budgets": [64], "heads": [8], "prefixes": [8192], "L": 15, "vocab": 8192,
              "scale": 0.130861, "seed": 0, "gpu_replays": 20, "graph_inner": 5, "gpu_mem_cap_gb": 8.0},
    "verify_attn": {"heads": [8], "slots": [16], "prefixes": [4096], "batches": [16], "page_sizes": [64],
                    "scale": 0.130861, "seed": 0, "gpu_replays": 20, "graph_inner": 5,
                    "gpu_mem_cap_gb": 8.0, "sdpa_max_elems": 2e9},
    "worker_round": {"batches": [1, 16], "budgets": [64], "prefixes": [8192], "heads": [8], "L": 15,
                     "vocab": 8192, "scale": 0.130861, "seed": 0, "cpu_reps": 3, "gpu_replays": 20,
                     "gpu_mem_cap_gb": 8.0},
    "op_latency": {"batches": [1, 16], "budget": 64, "heads": 8, "prefix": 8192, "L": 15, "scale": 0.130861,
                   "reps": 50, "gpu_mem_cap_gb": 8.0},
    "verify_sustained": {"shapes": ["16:8:64:8192"], "warmup_s": 3.0, "seconds": 3.0, "idle_s": 2.0, "sample_ms": 100,
                         "scale": 0.130861, "seed": 0, "gpu_replays": 10, "graph_inner": 3, "gpu_mem_cap_gb": 8.0},
}


# The figures `figures` and `report --figures` render (kdtree.harness.figures.render_all).
FIGURES = list(figure_names.ALL)


def _cfg(args, section: str) -> dict:
    cfg = dict(DEFAULTS[section])
    if args.cfg_json:
        try:
            given = json.loads(args.cfg_json)
        except json.JSONDecodeError as e:
            sys.exit(f"--cfg-json: expected the sweep's config section as a JSON object: {e}")
        if not isinstance(given, dict):
            sys.exit(f"--cfg-json: expected a JSON object, got {type(given).__name__}")
        cfg.update(given)
    from .harness.config import check_section
    check_section(f"sweep_{section}", {k: v for k, v in cfg.items() if k != "gpu_mem_cap_gb"})
    return cfg


def cmd_build(args):
    import subprocess
    from .build import DEFAULT_ARCHS, build
    if args.jobs is not None and args.jobs < 1:
        sys.exit(f"kdtree build: jobs: expected an integer >= 1, got {args.jobs}")
    _writable("kdtree build", args.build_dir, folder=True, name="build_dir")
    try:
        path = build(args.build_dir, tuple(args.archs or DEFAULT_ARCHS), jobs=args.jobs,
                     extra_flags=tuple(args.extra_flags.split()) if args.extra_flags else ())
    except RuntimeError as e:           # no nvcc, too old an nvcc
        sys.exit(f"kdtree build: {e}")
    except subprocess.CalledProcessError as e:
        sys.exit(f"kdtree build: the compile failed (exit {e.returncode}); nvcc's messages are above")
    print(path)


def _require_tests(path):
    import pandas as pd
    t = pd.read_parquet(path)
    bad = t[~t.outcome.isin(["passed", "skipped"])]
    if len(bad):
        sys.exit(f"refusing to time kernels that fail their tests: {len(bad)} failed in {path}, "
                 f"e.g. {bad.test_id.iloc[0]}")


def _writable(cmd: str, path, folder: bool = False, name: str = "out") -> None:
    """An output file (or folder) this run can write, made where missing, or a clear exit
    before any work."""
    from .harness.results import check_folder, check_output
    try:
        if folder:
            check_folder(path, name, make=True)
        else:
            check_output(path, make_parent=True)
    except ValueError as e:
        sys.exit(f"{cmd}: {e}")


def cmd_sweep(args):
    _writable("sweep", args.out)
    if args.pin_gpu and not args.cpu_only:
        from .harness.gpu import claim_gpu
        claim_gpu()
    from .harness.gpu import cuda_available
    if args.require_tests:
        _require_tests(args.require_tests)
    if args.library:
        import os
        os.environ["KDTREE_LIB"] = str(pathlib.Path(args.library).resolve())
    from .harness.sweeps import SWEEPS, load
    spec = SWEEPS[args.which]
    m = load(args.which)
    cfg = _cfg(args, spec.module)
    if spec.gpu_only:
        if not cuda_available():
            sys.exit(f"sweep {args.which}: needs a CUDA device (none found); the pipeline skips it on CPU")
        df = m.run(cfg, args.out, library=args.library)
    else:
        df = m.run(cfg, args.out, gpu=None if not args.cpu_only else False, library=args.library)
    bad = df[df.status != "ok"] if "status" in df else df.iloc[0:0]
    print(f"{args.which}: {len(df)} rows -> {args.out}"
          + (f" ({len(bad)} not ok: {sorted(set(bad.status))})" if len(bad) else ""))


def cmd_test_gpu(args):
    if args.workers < 1:
        sys.exit(f"kdtree test-gpu: workers: expected an integer >= 1, got {args.workers}")
    _writable("test-gpu", args.out)
    if args.pin_gpu:
        from .harness.gpu import claim_gpu
        claim_gpu()
    from .tools.gpu_tests import run_gpu_tests
    sys.exit(run_gpu_tests(args.out, args.library, args.pytest_args, workers=args.workers))


def _results_folder(cmd: str, folder) -> None:
    """A results folder that exists and holds Parquet, or a clear exit."""
    rd = pathlib.Path(folder)
    if not rd.is_dir():
        sys.exit(f"{cmd}: --results {folder}: no such folder")
    if not any(rd.glob("*.parquet")):
        sys.exit(f"{cmd}: --results {folder}: no Parquet files there (has the pipeline run?)")


def cmd_figures(args):
    _results_folder("figures", args.results)
    out = args.out or figure_names.default_folder(args.results)
    _writable("figures", out, folder=True)
    from .harness.figures import render_all
    skipped = render_all(args.results, out, args.kernel_times, only=args.figure)
    for s in skipped:
        print(f"figures: skipped {s}")


def cmd_report(args):
    _results_folder("report", args.results)
    _writable("report", args.out)
    if args.figures:
        _writable("report", args.figures, folder=True, name="figures")
    from .harness.figures import render_all
    from .harness.report import render
    skipped = render_all(args.results, args.figures, args.kernel_times, only=args.figure) if args.figures else []
    render(args.results, args.out, skipped + list(args.note or []), args.kernel_times)
    print(f"report -> {args.out}")


def cmd_gather(args):
    import pandas as pd
    from .harness.results import write_parquet_atomic
    _writable("gather", args.out)
    missing = [p for p in args.shards if not pathlib.Path(p).is_file()]
    if missing:
        sys.exit(f"gather: shard {missing[0]} not found ({len(missing)} of {len(args.shards)} missing; "
                 "did its sweep job fail? its log says)")
    frames = [pd.read_parquet(p) for p in args.shards]
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    write_parquet_atomic(df, args.out)
    print(f"gather: {len(frames)} shards, {len(df)} rows -> {args.out}")


def cmd_check(args):
    from .tools.deploy_checks import check_container, check_slurm_plan
    need = 3 if args.what == "container" else 1
    if len(args.paths) != need:
        sys.exit(f"check {args.what}: expected {need} path(s) "
                 f"({'DEF CONSTRAINTS README' if need == 3 else 'DRYRUN_OUTPUT'}), got {len(args.paths)}")
    for p in args.paths:
        if not pathlib.Path(p).is_file():
            sys.exit(f"check {args.what}: {p}: no such file")
    if args.what == "container":
        problems = check_container(*args.paths)
    else:
        problems = check_slurm_plan(pathlib.Path(args.paths[0]).read_text())
    for p in problems:
        print(f"check {args.what}: {p}")
    if problems:
        sys.exit(1)
    print(f"check {args.what}: ok")


def _generated(out: pathlib.Path, text: str, check: bool, what: str, command: str) -> None:
    """Write a generated file, or with --check fail if the committed one differs."""
    if check:
        if not out.exists() or out.read_text() != text:
            sys.exit(f"{what} is out of date: run `python -m kdtree {command}`")
        print(f"{what}: up to date")
        return
    from .harness.results import write_text_atomic
    write_text_atomic(text, out)
    print(f"{command} -> {out}")


def cmd_config_doc(args):
    from .tools.config_doc import generate
    _generated(pathlib.Path("config/README.md"), generate("."), args.check, "config/README.md", "config-doc")


def cmd_readme(args):
    from .harness.summary import render_readme
    _results_folder("readme", args.results)
    out = pathlib.Path("README.md")
    if not out.is_file():
        sys.exit("readme: run it in the repository root (README.md not found)")
    _generated(out, render_readme(out.read_text(), args.results), args.check, "README.md's results block",
               "readme")


def cmd_probe(args):
    from .probe.client import main as probe_main
    sys.exit(probe_main(args))


def cmd_info(args):
    from .info import report
    print("\n".join(report()))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kdtree", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build libkdtree with ninja")
    b.add_argument("--build-dir", default="build/kernels")
    b.add_argument("--archs", nargs="*", help="e.g. sm_90a sm_120 compute_90")
    b.add_argument("--jobs", type=int)
    b.add_argument("--extra-flags", help="more nvcc flags, one string (e.g. '-Xptxas -v')")
    b.set_defaults(fn=cmd_build)
    s = sub.add_parser("sweep", help="run one kernel sweep into Parquet")
    from .harness.sweeps import SWEEPS
    s.add_argument("which", choices=list(SWEEPS))
    s.add_argument("--out", required=True)
    s.add_argument("--cfg-json", help="the sweep's config section as JSON")
    s.add_argument("--library", help="libkdtree.so to use (default: build/kernels)")
    s.add_argument("--cpu-only", action="store_true", help="skip GPU rows even if a GPU is present")
    s.add_argument("--pin-gpu", action="store_true", help="claim one free GPU on a multi-GPU node")
    s.add_argument("--require-tests", help="test_correctness Parquet that must show no failures")
    s.set_defaults(fn=cmd_sweep)
    t = sub.add_parser("test-gpu", help="run the GPU test suite, outcomes to Parquet")
    t.add_argument("--out", required=True)
    t.add_argument("--library")
    t.add_argument("--pin-gpu", action="store_true", help="claim one free GPU on a multi-GPU node")
    t.add_argument("--workers", type=int, default=1,
                   help="pytest processes sharing the GPU, the tests dealt among them (pytest args "
                        "then only choose what is collected)")
    t.add_argument("pytest_args", nargs="*")
    t.set_defaults(fn=cmd_test_gpu)
    f = sub.add_parser("figures", help="render figures from the Parquet in a results folder")
    f.add_argument("--results", required=True)
    f.add_argument("--out")
    f.add_argument("--kernel-times", help="GPU kernel times for the breakdown when this run has none")
    f.add_argument("--figure", action="append", choices=FIGURES, help="only this figure (repeatable)")
    f.set_defaults(fn=cmd_figures)
    r = sub.add_parser("report", help="Markdown report from the Parquet in a results folder")
    r.add_argument("--results", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--figures", help="also (re)render figures into this folder")
    r.add_argument("--note", action="append", help="a line for the report's 'not rendered' list")
    r.add_argument("--kernel-times", help="GPU kernel times for the breakdown when this run has none")
    r.add_argument("--figure", action="append", choices=FIGURES, help="with --figures: only this one (repeatable)")
    r.set_defaults(fn=cmd_report)
    g = sub.add_parser("gather", help="join sweep shards into one Parquet")
    g.add_argument("--out", required=True)
    g.add_argument("shards", nargs="+")
    g.set_defaults(fn=cmd_gather)
    c = sub.add_parser("check", help="CI checks: the container definition, a SLURM dry-run plan")
    c.add_argument("what", choices=["container", "slurm-plan"])
    c.add_argument("paths", nargs="+", help="container: DEF CONSTRAINTS README; slurm-plan: DRYRUN_OUTPUT")
    c.set_defaults(fn=cmd_check)
    pr = sub.add_parser("probe", help="measure a live SGLang service (read-only, bounded)")
    from .probe import add_arguments
    add_arguments(pr)
    pr.set_defaults(fn=cmd_probe)
    cd = sub.add_parser("config-doc", help="write config/README.md from the config schema")
    cd.add_argument("--check", action="store_true", help="fail if config/README.md is out of date")
    cd.set_defaults(fn=cmd_config_doc)
    rm = sub.add_parser("readme", help="write README.md's results block from a results folder")
    rm.add_argument("--results", default="results/reference")
    rm.add_argument("--check", action="store_true", help="fail if the block is out of date")
    rm.set_defaults(fn=cmd_readme)
    i = sub.add_parser("info", help="what this machine offers kdtree: the library, each GPU's code, SGLang")
    i.set_defaults(fn=cmd_info)
    return p


# What each optional dependency comes with (pyproject.toml's extras).
EXTRAS = {"pandas": "harness", "pyarrow": "harness", "seaborn": "harness", "matplotlib": "harness",
          "tqdm": "harness", "httpx": "probe", "yaml": "harness", "jsonschema": "harness",
          "snakemake": "workflow"}


def main(argv=None):
    args = parser().parse_args(argv)
    from .checks import InputError
    try:
        args.fn(args)
    except InputError as e:   # a bad argument or config value: the message names it
        sys.exit(f"kdtree {args.cmd}: {e}")
    except ModuleNotFoundError as e:
        extra = EXTRAS.get((e.name or "").split(".")[0])
        if extra is None:
            raise
        sys.exit(f"kdtree {args.cmd}: needs {e.name}, which comes with the {extra} extra: "
                 f"pip install 'kdtree[{extra}]'")


if __name__ == "__main__":
    main()
