# Targets follow the machine and the config: what cannot run here is said, not failed.
import json
import os
import shlex
import sys

from kdtree.harness.figure_names import BREAKDOWN, PER_PARQUET


def _use_gpu():
    """gpu: true plans the GPU rules whatever this machine has (a SLURM submit host, a
    dry-run in CI); auto looks for a device; false never plans them."""
    if config["gpu"] is False:
        return False, "gpu: false in config"
    if config["gpu"] is True:
        return True, ""
    try:
        import torch
        ok = torch.cuda.is_available()
    except ImportError:
        ok = False
    return ok, "" if ok else "no CUDA device visible to torch (gpu: auto)"


def _have_nvcc():
    try:
        from kdtree.build import find_nvcc
        find_nvcc()
        return True
    except RuntimeError:
        return False


RD = config["results_dir"].rstrip("/")
# Unsharded GPU sweeps (all run by sweep_gpu): their Parquet is RD/<name>.parquet.
GPU_SWEEPS = ["round", "worker_round", "op_latency", "verify_sustained"]
LIB = f"{config['build']['build_dir'].rstrip('/')}/libkdtree.so"
GPU, NO_GPU_WHY = _use_gpu()
NVCC = _have_nvcc()
PROBE = bool(config["probe"]["url"])
SKIPPED = []
if not GPU:
    SKIPPED.append(f"GPU rules (test_correctness, sweep_verify_attn, sweep_gpu: {', '.join(GPU_SWEEPS)}; "
                   f"GPU rows of the CPU sweeps): {NO_GPU_WHY}")
if not NVCC:
    SKIPPED.append("build_kernels: nvcc not found (CUDA 13 on PATH or CUDA_HOME)")
if not PROBE:
    SKIPPED.append("probe_service: no probe.url in config")


def sweep_json(section, **override):
    cfg = dict(config[section], **override)
    cfg["gpu_mem_cap_gb"] = config["gpu_mem_cap_gb"]
    return shlex.quote(json.dumps(cfg, sort_keys=True))


def job_resources(gpu: bool, cpu_timed: bool) -> dict:
    """gpu=1 for GPU jobs (SLURM: --gpus=1; each claims its own GPU by a lock file);
    bench=1 for jobs that time something on the CPU (a CPU baseline), so two CPU baselines
    never run at once (limit 1 unless a profile lifts it); GPU-only timings run side by side,
    one per GPU. SLURM partition and account from config."""
    r = {}
    if gpu:
        r["gpu"] = 1
    if cpu_timed:
        r["bench"] = 1
    if config.get("slurm", {}).get("partition"):
        r["slurm_partition"] = config["slurm"]["partition"]
    if config.get("slurm", {}).get("account"):
        r["slurm_account"] = config["slurm"]["account"]
    return r


def _visible_gpus() -> int:
    """GPUs this host shows (CUDA_VISIBLE_DEVICES, else nvidia-smi -L); 0 if none."""
    from kdtree.harness.gpu import nvidia_smi_gpus

    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None:
        return len([v for v in vis.split(",") if v.strip()])
    return len(nvidia_smi_gpus() or [])


workflow.global_resources.setdefault("bench", 1)
# As many GPU jobs at once as this host has GPUs (none known: no limit, e.g. a SLURM submit host).
_GPUS = _visible_gpus()
if _GPUS > 0:
    workflow.global_resources.setdefault("gpu", _GPUS)


wildcard_constraints:
    batch=r"\d+",
    heads=r"\d+",


# Code a sweep's numbers depend on beyond what every sweep shares (sweep_code).
SWEEP_EXTRA_CODE = {
    "worker_round": ["kdtree/sglang/__init__.py", "kdtree/sglang/reference.py"],
    "verify_sustained": ["kdtree/harness/power.py", "kdtree/harness/sweeps/verify_attn.py"],
}


def sweep_code(name):
    """What a sweep's numbers depend on besides the kernels: its module and the library."""
    return [f"kdtree/harness/sweeps/{name}.py", "kdtree/harness/sweeps/runner.py", "kdtree/harness/timing.py",
            "kdtree/harness/workloads.py", "kdtree/ops.py", "kdtree/reference/tree.py"] + SWEEP_EXTRA_CODE.get(name, [])


def parquet_targets():
    t = [f"{RD}/tree_build.parquet", f"{RD}/tree_accept.parquet"]
    if GPU:
        t += [f"{RD}/test_correctness.parquet", f"{RD}/verify_attn.parquet"]
        t += [f"{RD}/{n}.parquet" for n in GPU_SWEEPS]
    if PROBE:
        t += [f"{RD}/probe.parquet"]
    return t


def cached_figure_names():
    """Figures `snakemake figures` re-renders: those the Parquet already in RD supports."""
    names = [n for n in PER_PARQUET if os.path.exists(f"{RD}/{n}.parquet")]
    if os.path.exists(f"{RD}/probe.parquet"):
        names.append(BREAKDOWN)
    return names


def figure_flags(names):
    return " ".join(f"--figure {n}" for n in names)


def figure_names():
    names = ["tree_build", "tree_accept"]
    if GPU:
        names += ["verify_attn", "worker_round", "verify_sustained"]
    if PROBE:
        names.append(BREAKDOWN)
    return names


def all_targets():
    t = parquet_targets() + [f"{RD}/report.md"]
    if NVCC:
        t.append(LIB)
    return t


def kernel_times_flag():
    kt = config.get("kernel_times_fallback", "")
    return f"--kernel-times {shlex.quote(kt)}" if kt else ""


def skipped_notes():
    return " ".join(f"--note {shlex.quote(s)}" for s in SKIPPED)


# Said when the workflow is read, so a dry-run (-n) says it too; jobs re-reading it stay quiet.
if workflow.is_main_process:
    for _s in SKIPPED:
        print(f"kdtree: skipped {_s}", file=sys.stderr)


def gpu_inputs():
    return {"lib": LIB, "tests": f"{RD}/test_correctness.parquet"} if GPU else {}


def gpu_flags(wildcards, input):
    return f"--library {input.lib} --require-tests {input.tests}" if GPU else "--cpu-only"
