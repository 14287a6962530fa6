"""The kernel library without a GPU: the ninja build, and the kernel's own selection
code (tree_select.cuh, compiled for the host) against the CPU reference."""
import ctypes
import shutil

import numpy as np
import pytest

from kdtree import build as kbuild
from kdtree.checks import InputError
from kdtree.tree import build_tree
from kdtree.workloads import stage_a_inputs

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


@pytest.fixture(scope="session")
def lib():
    path = kbuild.build(jobs=2)   # every default arch: a build break fails CI
    so = ctypes.CDLL(str(path))
    f = so.kd_select_nodes_host
    f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 3
    f.restype = ctypes.c_int
    return so


def host_select(lib, lp, budget):
    lp = np.ascontiguousarray(lp, dtype=np.float32)
    L, K = lp.shape
    cap = max(budget, 0) + 1
    par, rk, dp = (np.full(cap, -9, np.int32) for _ in range(3))
    n = lib.kd_select_nodes_host(lp.ctypes.data, L, K, budget, par.ctypes.data, rk.ctypes.data,
                                 dp.ctypes.data)
    assert n >= 0
    return par[:n + 1], dp[1:n + 1]


def test_library_exports_the_c_abi(lib):
    for name in ("kd_build_trees", "kd_tree_accept", "kd_verify_attention", "kd_verify_tile",
                 "kd_version", "kd_select_nodes_host"):
        assert hasattr(lib, name)


def test_kernel_selection_matches_reference_on_golden_cases(lib, golden):
    for i, c in enumerate(golden):
        par, dep = host_select(lib, c["top_lp"], int(c["budget"]))
        assert np.array_equal(par, c["parents"]), i
        assert np.array_equal(dep, c["depths"]), i


@pytest.mark.parametrize("seed", range(12))
def test_kernel_selection_matches_reference_tie_heavy(lib, seed):
    rng = np.random.default_rng(seed)
    V = int(rng.choice([2, 3, 7, 50, 4000]))
    budget = int(rng.choice([1, 2, 15, 16, 100, 512, 1024]))
    lp, ids = stage_a_inputs(6, 15, V, budget, seed=seed, coarse_fraction=1.0)
    for b in range(6):
        t = build_tree(lp[b].numpy(), ids[b].numpy(), budget)
        par, dep = host_select(lib, lp[b].numpy(), budget)
        assert np.array_equal(par, t.parents) and np.array_equal(dep, t.depths), (seed, b)


def test_generated_ninja_file(tmp_path):
    path = kbuild.write_build_ninja(tmp_path, archs=("sm_90a", "compute_90"), nvcc="nvcc")
    text = path.read_text()
    assert "-gencode=arch=compute_90a,code=sm_90a" in text
    assert "-gencode=arch=compute_90,code=compute_90" in text
    assert "deps = gcc" in text
    for src in kbuild.sources():
        assert f"obj/{src.stem}.o" in text
    mtime = path.stat().st_mtime_ns
    kbuild.write_build_ninja(tmp_path, archs=("sm_90a", "compute_90"), nvcc="nvcc")
    assert path.stat().st_mtime_ns == mtime   # unchanged config: ninja sees nothing new


def test_bad_arch_is_named():
    with pytest.raises(InputError, match="archs: expected entries like 'sm_90a'"):
        kbuild.gencode_flags(["hopper"])


def test_missing_nvcc_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("NVCC", "")
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("CUDA_HOME", "/nonexistent")
    with pytest.raises(RuntimeError, match="nvcc not found"):
        kbuild.find_nvcc()


def test_old_nvcc_is_refused(tmp_path, monkeypatch):
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.4, V12.4.131'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("NVCC", str(fake))
    with pytest.raises(RuntimeError, match="too old"):
        kbuild.build(tmp_path / "b")


def test_bindings_name_bad_arguments_without_a_gpu():
    import torch

    from kdtree import ops

    lp = torch.zeros(2, 15, 4)
    with pytest.raises(InputError, match="top_logprobs: expected a CUDA tensor"):
        ops.build_trees_gpu(lp, lp.long(), torch.ones(2, dtype=torch.int32))
    with pytest.raises(InputError, match="candidates: expected a CUDA tensor"):
        ops.tree_accept(torch.zeros(2, 5, dtype=torch.long), None, None, None, 15)
    with pytest.raises(InputError, match="q: expected a CUDA tensor, got device cpu"):
        ops.verify_attention(torch.zeros(1, 2, 8, 576), None, None, None, None, 0.13)


@pytest.mark.parametrize("L", [16, 17, 40])
def test_kernel_selection_long_blocks(lib, L):
    """L <= 16 orders ties by packed path keys, longer blocks by walking parent pointers."""
    for seed, V, budget in ((L, 3, 300), (L + 1, 50, 1024)):
        lp, ids = stage_a_inputs(3, L, V, budget, seed=seed, coarse_fraction=1.0)
        for b in range(3):
            t = build_tree(lp[b].numpy(), ids[b].numpy(), budget)
            par, dep = host_select(lib, lp[b].numpy(), budget)
            assert np.array_equal(par, t.parents) and np.array_equal(dep, t.depths), (seed, b)
