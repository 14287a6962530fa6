"""The kernel library without a GPU: the ninja build, and the kernel's own selection
code (tree_select.cuh, compiled for the host) against the CPU reference."""
import ctypes
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from kdtree import build as kbuild
from kdtree.checks import InputError
from kdtree.reference.tree import build_tree
from kdtree.harness.workloads import stage_a_inputs, tied_one_deviation_rows

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


@pytest.fixture(scope="session")
def lib_path():
    return kbuild.build(jobs=2)   # every default arch: a build break fails CI


@pytest.fixture(scope="session")
def lib(lib_path):
    so = ctypes.CDLL(str(lib_path))
    f = so.kd_select_nodes_host
    f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 3
    f.restype = ctypes.c_int
    g = so.kd_select_threshold_host
    g.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 6 + [ctypes.c_int]
    g.restype = ctypes.c_int
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


def threshold_select(lib, lp, budget, linear_raise=0):
    """The kernel's threshold selection on the host: (n, parents, depths, next_token,
    next_sibling, stats) with n = -1 (refused) or -2 (not certified) and no arrays then.
    linear_raise: 1 raises tau as the one-CTA-an-SM kernel does, 0 as the two-CTA one."""
    lp = np.ascontiguousarray(lp, dtype=np.float32)
    L, K = lp.shape
    out = [np.full(max(budget, 0) + 1, -9, np.int32) for _ in range(5)]
    stats = np.full(3, -1, np.int32)
    n = lib.kd_select_threshold_host(lp.ctypes.data, L, K, budget, *(a.ctypes.data for a in out),
                                     stats.ctypes.data, linear_raise)
    if n < 0:
        return n, None, None, None, None, stats
    par, _, dep, nt, ns = (a[:n + 1] for a in out)
    return n, par, dep[1:], nt, ns, stats


def assert_threshold_equals_heap(lib, lp, ids, budget, linear_raise=0):
    """Equal to the heap build (pops, depths and links) wherever it returns a selection."""
    n, par, dep, nt, ns, stats = threshold_select(lib, lp, budget, linear_raise)
    if n >= 0:
        t = build_tree(lp, ids, budget)
        assert np.array_equal(par, t.parents)
        assert np.array_equal(dep, t.depths)
        assert np.array_equal(nt, t.next_token) and np.array_equal(ns, t.next_sibling)
    return n, stats


def test_library_exports_the_c_abi(lib, lib_path):
    from kdtree import loader

    for name in ("kd_build_trees", "kd_tree_accept", "kd_tree_accept_parents", "kd_verify_plan_make",
                 "kd_verify_run", "kd_version", "kd_error_string", "kd_select_nodes_host",
                 "kd_select_threshold_host"):
        assert hasattr(lib, name)
    # No process-global kernel switch any more: a plan carries its path.
    for gone in ("kd_verify_set_path", "kd_verify_attention", "kd_verify_tile"):
        assert not hasattr(lib, gone)
    assert lib.kd_version() == loader.ABI_VERSION
    loader.load(lib_path)   # every declared entry point exists


def test_loader_refuses_a_stale_library(tmp_path):
    from kdtree import loader

    src = tmp_path / "old.c"
    src.write_text("int kd_version(void) { return 3; }\n")
    so = tmp_path / "libold.so"
    subprocess.run(["gcc", "-shared", "-fPIC", str(src), "-o", str(so)], check=True)
    with pytest.raises(RuntimeError, match=r"libold.so: a stale libkdtree \(C ABI 3; this kdtree needs"):
        loader.load(so)


def test_launch_errors_say_what_happened_and_what_to_do(lib_path, monkeypatch):
    """A CUDA error from an entry point reaches the caller as CUDA's sentence (read off the
    library, no GPU needed) and, where one helps, what to do; a bad size stays InputError."""
    from kdtree import loader, ops

    so = loader.load(lib_path)
    assert so.kd_error_string(0) == b"no error"
    assert b"no kernel image" in so.kd_error_string(209)
    assert so.kd_error_string(1001) == b"a size or pointer is outside what the kernel supports"
    assert so.kd_error_string(987654) == b"unrecognized error code"
    monkeypatch.setattr(ops, "lib", lambda: so)
    ops._check(0, "tree_build")   # launched: nothing raised
    with pytest.raises(RuntimeError, match=r"^tree_verify: CUDA error 209 at launch \(no kernel image[^)]*\): "
                                           r"this library holds no code this GPU runs \(`python -m kdtree info`"):
        ops._check(209, "tree_verify")
    with pytest.raises(RuntimeError, match=r"^tree_build: CUDA error 35 at launch \(.*driver.*\): .*driver >= 580"):
        ops._check(35, "tree_build")
    with pytest.raises(RuntimeError, match=r"^accept: CUDA error 2 at launch \(out of memory\)$"):
        ops._check(2, "accept")
    with pytest.raises(InputError, match="tree_accept: a size is outside"):
        ops._check(1001, "tree_accept")


def test_loader_refuses_a_library_lacking_a_declared_entry_point(tmp_path):
    from kdtree import loader

    src = tmp_path / "partial.c"
    src.write_text(f"int kd_version(void) {{ return {loader.ABI_VERSION}; }}\n")
    so = tmp_path / "libpartial.so"
    subprocess.run(["gcc", "-shared", "-fPIC", str(src), "-o", str(so)], check=True)
    with pytest.raises(RuntimeError, match=r"libpartial.so: C ABI \d+ but no kd_error_string: a library built from other"):
        loader.load(so)


def test_loader_finds_named_packaged_then_jit_builds_once(tmp_path, monkeypatch, lib_path, capsys):
    """KDTREE_LIB wins; without it and without a packaged build, the JIT cache builds on first
    use (one message, under a lock) and reuses the build after."""
    from kdtree import loader

    monkeypatch.setenv("KDTREE_LIB", str(tmp_path / "missing.so"))
    assert loader.library_path() == tmp_path / "missing.so"
    loader.lib.cache_clear()
    with pytest.raises(RuntimeError, match="KDTREE_LIB=.*missing.so: no such file"):
        loader.lib()
    monkeypatch.delenv("KDTREE_LIB")
    monkeypatch.setenv("KDTREE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "PACKAGED_LIB", tmp_path / "not_installed.so")
    calls = []

    def fake_build(work, archs):
        calls.append(work)
        work.mkdir(parents=True)
        shutil.copy(lib_path, work / "libkdtree.so")
        return work / "libkdtree.so"

    monkeypatch.setattr(loader, "build", fake_build)
    target = loader.jit_path()
    assert target.parent.parent == tmp_path / "cache" and not target.exists()
    try:
        loader.lib.cache_clear()
        so = loader.lib()
        assert so.kd_version() == loader.ABI_VERSION and target.exists()
        assert "compiling the CUDA kernels" in capsys.readouterr().err
        loader.lib.cache_clear()
        loader.lib()
        assert len(calls) == 1
    finally:
        loader.lib.cache_clear()


def test_loader_remembers_a_failure_until_cleared(tmp_path, monkeypatch, lib_path):
    """A library that cannot be found is not looked for again on every call (kdtree.sglang
    falls back on the error each layer or request); cache_clear() looks again."""
    from kdtree import loader

    monkeypatch.setenv("KDTREE_LIB", str(tmp_path / "missing.so"))
    looked = []
    real = loader.library_path
    monkeypatch.setattr(loader, "library_path", lambda: looked.append(1) or real())
    loader.lib.cache_clear()
    try:
        for _ in range(3):
            with pytest.raises(RuntimeError, match="KDTREE_LIB=.*missing.so: no such file"):
                loader.lib()
        assert len(looked) == 1
        monkeypatch.setenv("KDTREE_LIB", str(lib_path))
        loader.lib.cache_clear()
        assert loader.lib().kd_version() == loader.ABI_VERSION and len(looked) == 2
    finally:
        loader.lib.cache_clear()


def test_loader_says_a_file_that_does_not_load(tmp_path, monkeypatch):
    """A corrupt library file is the loader's RuntimeError (what the fallbacks catch), naming
    the file and what to do, never ctypes' OSError."""
    from kdtree import loader

    bad = tmp_path / "libkdtree.so"
    bad.write_bytes(b"not a shared object")
    monkeypatch.setenv("KDTREE_LIB", str(bad))
    loader.lib.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"libkdtree.so: not a loadable libkdtree .*kdtree build"):
            loader.lib()
    finally:
        loader.lib.cache_clear()


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
        assert f"obj/{src.relative_to(kbuild.KERNELS / 'src').with_suffix('.o').as_posix()}" in text
    # The Hopper folder is built for sm_90a alone, and the host code is told it exists.
    assert "build obj/sm90/verify_attention_wgmma.o: cu" in text
    assert "  gencode = -gencode=arch=compute_90a,code=sm_90a\n" in text
    assert "-DKD_HAS_SM90A" in text
    mtime = path.stat().st_mtime_ns
    kbuild.write_build_ninja(tmp_path, archs=("sm_90a", "compute_90"), nvcc="nvcc")
    assert path.stat().st_mtime_ns == mtime   # unchanged config: ninja sees nothing new


def test_hopper_wgmma_loops_are_not_serialised_nor_spilled(tmp_path):
    """ptxas serialises every wgmma of a kernel when it cannot prove a loop's accumulators
    untouched while in flight (C7510-C7520: an mbarrier wait or a wait_group after a branch
    between wgmma groups; docs/kernels/verify_attention.md, session 27): the kernel stays
    correct but slows down (there 1.17-1.47x the time against 1.00-1.13x unserialised), and
    only ptxas's verbose output says so."""
    nvcc = kbuild.find_nvcc()
    flags = kbuild.compile_flags(("sm_90a",))
    sources = sorted((kbuild.KERNELS / "src" / "sm90").glob("*.cu"))
    assert sources
    for src in sources:
        out = subprocess.run([nvcc, *flags, *kbuild.gencode_flags(("sm_90a",)), "-Xptxas", "-v", "-cubin",
                              str(src), "-o", str(tmp_path / "k.cubin")], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        serialised = [line for line in out.stderr.splitlines() if "instructions are serialized" in line]
        assert not serialised, (src.name, serialised)
        # Nor spills: each wgmma kernel holds its accumulators in registers to the last one.
        spills = [m.group(0) for m in re.finditer(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out.stderr)
                  if m.group(1) != "0" or m.group(2) != "0"]
        assert not spills, (src.name, spills)


def test_build_without_hopper_leaves_its_folder_out(tmp_path):
    text = kbuild.write_build_ninja(tmp_path, archs=("sm_120",), nvcc="nvcc").read_text()
    assert "sm90/" not in text and "KD_HAS_SM90A" not in text
    assert "obj/verify_attention.o" in text


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
        ops.tree_build(lp, lp.long(), torch.ones(2, dtype=torch.int32))
    z5 = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(InputError, match="tokens: expected a CUDA tensor"):
        ops.tree_accept(z5, z5, 15, next_token=z5, next_sibling=z5)
    z = torch.zeros(2, 5, dtype=torch.long, device="meta")
    with pytest.raises(InputError, match="tree_accept: expected the tree as parents= and node_counts=, or"):
        ops.tree_accept(z, z, 15, parents=z)
    with pytest.raises(InputError, match="max_depth: expected an integer >= 0"):
        ops.tree_accept(z, z, -1, parents=z, node_counts=z)
    with pytest.raises(InputError, match="q: expected a CUDA tensor, got device cpu"):
        ops.tree_verify(torch.zeros(1, 2, 8, 576, dtype=torch.bfloat16), torch.zeros(4, 64, 576),
                        torch.zeros(1, 1, dtype=torch.int32), None, None, 0.13)
    with pytest.raises(InputError, match="kernel: expected one of"):
        ops.TreeVerifyPlan(1, 2, 8, 64, 4, kernel="fastest")
    for bad in (0, 129, True):  # a bool is not a split count
        with pytest.raises(InputError, match="num_splits: expected an integer in"):
            ops.TreeVerifyPlan(1, 2, 8, 64, 4, num_splits=bad)
    with pytest.raises(InputError, match="max_depth: expected an integer >= 0"):
        ops.tree_accept(z, z, True, parents=z, node_counts=z)
    with pytest.raises(InputError, match="page_size: expected an integer >= 1"):
        ops.TreeVerifyPlan(1, 2, 8, 0, 4)
    with pytest.raises(InputError, match="per_request_splits: expected True or False"):
        ops.TreeVerifyPlan(1, 2, 8, 64, 4, per_request_splits=1)
    with pytest.raises(InputError, match="per_request_splits: takes the library's counts, so num_splits"):
        ops.TreeVerifyPlan(1, 2, 8, 64, 4, num_splits=4, per_request_splits=True)


def test_verify_attention_refuses_unaligned_vectors_before_any_cuda_call(lib_path):
    """q, the cache, out and the partials are copied in 16-byte vectors: a pointer off a
    16-byte boundary is KD_ERR_ARGUMENT, checked before the device is touched (so no GPU
    here: fake pointers never reach a kernel). Called through the bindings' declared ABI
    (loaded as kdtree.loader loads it)."""
    from kdtree import loader

    so = loader.load(lib_path)
    plan = loader.KdVerifyPlan(B=2, D=3, H=8, page_size=64, max_pages=4, path=0, device=0, kernel=0, copy=0,
                               rows_per_cta=32, keys_per_tile=32, num_splits=2, merge=2, small_launch=1)
    ok = 1 << 20  # 16-byte aligned fake addresses
    names = ("q", "kv_cache", "out", "partial_out")
    for bad in names:
        ptrs = {n: ok + (8 if n == bad else 0) for n in names}
        rc = so.kd_verify_run(ctypes.byref(plan), ptrs["q"], ptrs["kv_cache"], 10, ok, 4, None, ok, ok, 0, 0.13,
                              ptrs["out"], ok, ptrs["partial_out"], ok, None)
        assert rc == 1001, bad  # KD_ERR_ARGUMENT
    # a table narrower than the plan's pages, a split plan without its workspace
    assert so.kd_verify_run(ctypes.byref(plan), ok, ok, 10, ok, 3, None, ok, ok, 0, 0.13, ok, ok, ok, ok, None) == 1001
    assert so.kd_verify_run(ctypes.byref(plan), ok, ok, 10, ok, 4, None, ok, ok, 0, 0.13, ok, ok, None, None,
                            None) == 1001
    for combine in (-1, 3):  # a combine launch the library does not know
        plan.combine = combine
        assert so.kd_verify_run(ctypes.byref(plan), ok, ok, 10, ok, 4, None, ok, ok, 0, 0.13, ok, ok, ok, ok,
                                None) == 1001, combine
    plan.combine = 1
    # per-request counts no plan has: a base past the count, or splits merged in clusters
    for base, merge in ((3, 2), (1, 1)):
        plan.split_base, plan.merge, plan.wave = base, merge, 132
        assert so.kd_verify_run(ctypes.byref(plan), ok, ok, 10, ok, 4, None, ok, ok, 0, 0.13, ok, ok, ok, ok,
                                None) == 1001, (base, merge)
    # a tail no plan has: beside a base, merged in clusters, or not 0 / 1
    for tail, base, merge in ((1, 1, 2), (1, 0, 1), (2, 0, 2), (-1, 0, 2)):
        plan.tail, plan.split_base, plan.merge = tail, base, merge
        assert so.kd_verify_run(ctypes.byref(plan), ok, ok, 10, ok, 4, None, ok, ok, 0, 0.13, ok, ok, ok, ok,
                                None) == 1001, (tail, base, merge)


@pytest.mark.parametrize("L", [16, 17, 40])
def test_kernel_selection_long_blocks(lib, L):
    """L <= 16 orders ties by packed path keys, longer blocks by walking parent pointers."""
    for seed, V, budget in ((L, 3, 300), (L + 1, 50, 1024)):
        lp, ids = stage_a_inputs(3, L, V, budget, seed=seed, coarse_fraction=1.0)
        for b in range(3):
            t = build_tree(lp[b].numpy(), ids[b].numpy(), budget)
            par, dep = host_select(lib, lp[b].numpy(), budget)
            assert np.array_equal(par, t.parents) and np.array_equal(dep, t.depths), (seed, b)


# ---- the kernel's threshold selection (tree_threshold.cuh), run on the host ----------
@pytest.fixture(params=[0, 1], ids=["radix_raise", "linear_raise"])
def linear_raise(request):
    """Each selection test runs as both kernels raise tau: by the radix pick (two CTAs an SM)
    and by linear bins first (one CTA an SM)."""
    return request.param


def test_threshold_selection_on_golden_cases(lib, linear_raise, golden):
    for i, c in enumerate(golden):
        n, par, dep, *_ = threshold_select(lib, c["top_lp"], int(c["budget"]), linear_raise)
        assert n >= 0, i   # all certified
        assert np.array_equal(par, c["parents"]) and np.array_equal(dep, c["depths"]), i


@pytest.mark.parametrize("seed", range(16))
def test_threshold_selection_tie_heavy(lib, linear_raise, seed):
    rng = np.random.default_rng(100 + seed)
    V = int(rng.choice([2, 3, 7, 50, 4000]))
    budget = int(rng.choice([1, 2, 15, 16, 100, 512, 1024]))
    lp, ids = stage_a_inputs(6, 15, V, budget, seed=100 + seed, coarse_fraction=1.0)
    for b in range(6):
        n, _ = assert_threshold_equals_heap(lib, lp[b].numpy(), ids[b].numpy(), budget, linear_raise)
        assert n >= 0, (seed, b)


@pytest.mark.parametrize("budget", [16, 17, 40, 64, 65, 256, 1024])
def test_threshold_selection_on_sweep_inputs(lib, linear_raise, budget):
    """The sweep's inputs: all certified, a few tau raises at most, the sorted set within
    the node buffer (4x the budget where the start bound takes one round of squared pivots,
    budgets 17-64; else 2x). Budgets 16/17 and 64/65 sit on both sides of that rule."""
    raises = []
    for cf in (0.3, 1.0):
        lp, ids = stage_a_inputs(12, 15, 8192, budget, seed=7 * budget + int(cf * 10), coarse_fraction=cf)
        for b in range(12):
            n, stats = assert_threshold_equals_heap(lib, lp[b].numpy(), ids[b].numpy(), budget, linear_raise)
            assert n == budget
            raises.append(int(stats[0]))
            assert budget <= stats[1] <= max(4 * budget, 64)
    assert max(raises) <= 6


@pytest.mark.parametrize("budget,K", [(1024, 256), (256, 64)])
def test_threshold_selection_with_top_k_below_the_budget(lib, linear_raise, budget, K):
    """A drafter's top-k below the budget: the first tau then comes from the one-deviation
    nodes (deviation_bound), which keeps tau raises to a median of one (the chain's nodes
    alone left a median of two to three); every tree is still the heap's."""
    lp, ids = stage_a_inputs(16, 15, 8192, K, seed=11 * budget + K)
    raises = []
    for b in range(16):
        n, stats = assert_threshold_equals_heap(lib, lp[b].numpy(), ids[b].numpy(), budget, linear_raise)
        if n >= 0:
            assert n == budget
            raises.append(int(stats[0]))
    assert len(raises) >= 15 and np.median(raises) <= 1, raises


@pytest.mark.parametrize("budget", [16, 40, 64, 128, 256])
@pytest.mark.parametrize("second", ["none", "near", "tied"])
def test_threshold_selection_one_deviation_layout(lib, linear_raise, budget, second):
    """Deep trees laid out at once where no node lies two deviations off the first-child
    chain (the one-CTA kernel's program, linear_raise 1), and the layout declining where
    some do: rank 1 a hair below rank 0 (near) or equal to it (tied) at a few depths makes
    nodes of two deviations the best. The heap's trees either way."""
    lp, ids = stage_a_inputs(8, 15, 8192, budget, seed=budget + len(second), drafts="confident")
    rng = np.random.default_rng(budget)
    laid = 0
    for b in range(8):
        row = lp[b].numpy().copy()
        if second != "none":
            for d in rng.choice(15, 3, replace=False):
                row[d, 1] = row[d, 0] if second == "tied" else np.nextafter(row[d, 0], np.float32(-np.inf))
                row[d, 2:] = np.minimum(row[d, 2:], row[d, 1])
        n, stats = assert_threshold_equals_heap(lib, row, ids[b].numpy(), budget, linear_raise)
        assert n == budget, b
        laid += int(stats[2])
    if not linear_raise:
        assert laid == 0   # the two-CTA kernel's program levels every tree
    elif second == "none":
        assert laid >= 6, laid   # laid out at once (a request past the buffer may still decline)
    else:
        assert laid <= 4, laid   # nodes two deviations off the chain: most decline


@pytest.mark.parametrize("budget", [16, 64, 128, 256])
@pytest.mark.parametrize("step", [1 / 4, 1 / 64])
def test_threshold_selection_one_deviation_layout_with_ties(lib, budget, step):
    """Laid-out trees whose nodes tie in score: their order is the path keys' order, which
    the layout's one-word keys must keep (chain nodes first, then deeper deviations)."""
    lp, ids = stage_a_inputs(8, 15, 8192, budget, seed=budget + int(1 / step), drafts="confident")
    lp = tied_one_deviation_rows(lp, step)
    laid = 0
    for b in range(8):
        n, stats = assert_threshold_equals_heap(lib, lp[b].numpy(), ids[b].numpy(), budget, 1)
        assert n == budget, b
        laid += int(stats[2])
    assert laid >= 6, laid


@pytest.mark.parametrize("budget,K", [(64, 64), (256, 256), (1024, 256)])
def test_threshold_selection_on_deep_trees(lib, linear_raise, budget, K):
    """A confident drafter's trees run 15 levels deep, one to four nodes on the deep levels
    (the mixed drafts' end by depth 6): every tree is still the heap's."""
    lp, ids = stage_a_inputs(16, 15, 8192, K, seed=5 * budget, drafts="confident")
    depths, raises = [], []
    for b in range(16):
        n, stats = assert_threshold_equals_heap(lib, lp[b].numpy(), ids[b].numpy(), budget, linear_raise)
        assert n == budget, b
        depths.append(int(threshold_select(lib, lp[b].numpy(), budget, linear_raise)[2].max()))  # the heap's, as compared
        raises.append(int(stats[0]))
    assert np.median(depths) >= 12, depths
    if K <= 64:
        # deep_chain sends them to the one-deviation bound: no raise (the chain bound raised
        # tau for about half of them)
        assert max(raises) == 0, raises


@pytest.mark.parametrize("L,K,budget", [(1, 600, 1024), (2, 600, 1024), (3, 2, 6), (4, 300, 1024), (7, 5, 35),
                                        (16, 2, 32), (16, 64, 1000), (16, 65, 1024), (12, 100, 1024),
                                        (15, 255, 256)])
def test_threshold_selection_top_k_below_the_budget_edges(lib, linear_raise, L, K, budget):
    """K below the budget at the edges: one depth (no start bound: L K < budget), the
    one-deviation bound from L 2 to 16, two ranks, budgets equal to the reachable nodes, K
    one below the budget; fine and coarse rows. Trees are the heap's."""
    for cf in (0.0, 1.0):
        lp, ids = stage_a_inputs(3, L, 8192, K, seed=L * 1000 + K + int(cf), coarse_fraction=cf)
        reachable = sum(K ** d for d in range(1, L + 1))
        for b in range(3):
            n, _ = assert_threshold_equals_heap(lib, lp[b].numpy(), ids[b].numpy(), budget, linear_raise)
            assert n == min(budget, reachable), (cf, b, n)


@pytest.mark.parametrize("budget,K,V,seed", [(1024, 256, 8192, 1), (256, 64, 8192, 21), (512, 128, 4000, 19)])
def test_threshold_selection_takes_ties_at_the_budget_th_score(lib, linear_raise, budget, K, V, seed):
    """Coarse rows whose ties at the budget-th score fill the node buffer by themselves (two
    requests of each batch here; the selection refused them before and the warp loop built
    them): S(> t*) and then the tied nodes in path order (select_ties). Trees are the heap's."""
    lp, ids = stage_a_inputs(8, 15, V, K, seed=1000 + seed, coarse_fraction=1.0)
    for b in range(8):
        n, _ = assert_threshold_equals_heap(lib, lp[b].numpy(), ids[b].numpy(), budget, linear_raise)
        assert n == budget, b


def test_threshold_selection_raises_from_the_whole_overflowing_level(lib, linear_raise):
    """A raise counts every child of the overflowing level's parents (level_bound), not only
    those that fit the buffer: on the sweep's batch-64 inputs at budget 1024, K 256, no
    request takes more than two raises (from the truncated level alone: up to five, one
    distinct coarse score a raise)."""
    lp, ids = stage_a_inputs(64, 15, 8192, 256, seed=64 * 7919 + 1024)
    raises = []
    for b in range(64):
        n, stats = assert_threshold_equals_heap(lib, lp[b].numpy(), ids[b].numpy(), 1024, linear_raise)
        assert n == 1024, b
        raises.append(int(stats[0]))
    assert max(raises) <= 2, raises


def test_threshold_selection_raises_tau_and_stays_exact(lib, linear_raise):
    """Budget 256 (a node buffer of 512, the chain bound's two rounds): tau raises happen on
    these sweep-like inputs, and the trees stay the heap's. (Up to budget 128 the buffer of
    4x the budget leaves these inputs no raise.)"""
    raised = 0
    for cf in (0.3, 1.0):
        lp, ids = stage_a_inputs(64, 15, 8192, 256, seed=192 + int(cf * 10), coarse_fraction=cf)
        for b in range(64):
            n, stats = assert_threshold_equals_heap(lib, lp[b].numpy(), ids[b].numpy(), 256, linear_raise)
            assert n == 256
            raised += int(stats[0]) > 0
    assert raised >= 2


def test_threshold_selection_linear_raise_is_its_own_pick(lib):
    """The two raises pick their own tau (so the candidate sets differ for some request that
    raises) and give the same trees: the one-CTA-an-SM kernel's linear bins reach a tau within
    the slack as the radix does."""
    differ = 0
    for cf in (0.3, 1.0):
        lp, _ = stage_a_inputs(64, 15, 8192, 256, seed=192 + int(cf * 10), coarse_fraction=cf)
        for b in range(64):
            radix = threshold_select(lib, lp[b].numpy(), 256, 0)
            linear = threshold_select(lib, lp[b].numpy(), 256, 1)
            assert radix[0] == linear[0] == 256
            assert all(np.array_equal(x, y) for x, y in zip(radix[1:5], linear[1:5])), b
            differ += int(radix[5][1] != linear[5][1])
    assert differ >= 1


@pytest.mark.parametrize("L,V,budget", [(1, 5, 3), (2, 2, 50), (3, 1, 10), (15, 1, 1024), (15, 2, 1024),
                                        (4, 3, 1024), (15, 16, 15), (16, 3, 300)])
def test_threshold_selection_small_trees_and_budget_edges(lib, linear_raise, L, V, budget):
    """Budget 1, budgets past the reachable nodes (the whole tree, in heap order), L 16."""
    lp, ids = stage_a_inputs(4, L, V, budget, seed=L * 10 + V, coarse_fraction=1.0)
    for b in range(4):
        for bud in (1, budget):
            n, _ = assert_threshold_equals_heap(lib, lp[b].numpy(), ids[b].numpy(), bud, linear_raise)
            want = min(bud, sum(min(V, bud) ** d for d in range(1, L + 1)))
            assert n == want


def test_threshold_selection_clamped_rows_and_zero_budget(lib, linear_raise):
    lp, ids = stage_a_inputs(2, 15, 500, 64, seed=5)
    lp[:, :, 40:] = float("-inf")      # clamped to -1e4: equal values, still sorted
    for b in range(2):
        n, _ = assert_threshold_equals_heap(lib, lp[b].numpy(), ids[b].numpy(), 64, linear_raise)
        assert n == 64
    assert threshold_select(lib, lp[0].numpy(), 0, linear_raise)[0] == 0


def test_threshold_selection_refuses_what_it_cannot_certify(lib, linear_raise):
    assert threshold_select(lib, np.array([[-1.0, -0.5, -2.0]], np.float32), 3, linear_raise)[0] == -2   # unsorted
    assert threshold_select(lib, np.array([[0.5, -1.0]], np.float32), 2, linear_raise)[0] == -2          # > 0
    assert threshold_select(lib, np.full((17, 4), -1.0, np.float32), 8, linear_raise)[0] == -2           # L > 16


@pytest.mark.parametrize("script,shape,flag", [("profile_tree_build.py", "1:16:16", "KD_BUILD_PROFILE"),
                                               ("profile_verify.py", "1:16:8:1024", "KD_VERIFY_PROFILE")])
def test_profile_script_refuses_a_library_without_profile_stamps(lib_path, script, shape, flag):
    """The profile scripts need their profile build; given the plain library they say so by
    name instead of failing inside ctypes."""
    path = pathlib.Path(__file__).resolve().parent.parent / "scripts" / script
    r = subprocess.run([sys.executable, str(path), "--shapes", shape], capture_output=True, text=True,
                       env=dict(os.environ, KDTREE_LIB=str(lib_path)), timeout=120)
    assert r.returncode != 0 and f"not a profile build (-D{flag})" in r.stderr, r.stdout + r.stderr


def test_floor_script_refuses_bad_arguments_before_any_gpu_time(tmp_path):
    """scripts/tree_build_floor.py names what it refuses and exits before timing anything: a
    budget below 2 (budgets 0 and 1 are its own forms), and an output path that is a folder
    (where a GPU is visible) or a machine without one."""
    path = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "tree_build_floor.py"
    run = lambda *a: subprocess.run([sys.executable, str(path), *a], capture_output=True, text=True, timeout=120)
    r = run(str(tmp_path / "f.parquet"), "--budgets", "1", "64")
    assert r.returncode == 2 and "--budgets: each must be >= 2" in r.stderr, r.stdout + r.stderr
    r = run(str(tmp_path))
    assert r.returncode != 0, r.stdout + r.stderr
    assert "needs a CUDA device" in r.stderr or "is a folder; expected a file path" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_host_twin_script_compares_libraries(lib_path):
    """scripts/tree_build_host_twin.py, which the design notes' host readings come from: a
    library against itself differs nowhere, and every point's candidate set holds the budget."""
    root = pathlib.Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, str(root / "scripts" / "tree_build_host_twin.py"), str(lib_path), str(lib_path),
                        "--drafts", "mixed", "confident", "--batches", "16", "--budgets", "64", "256"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2 * 2 * 2, lines   # drafters x budgets x libraries
    pat = re.compile(r"lib (\d) (\w+) +B +16 budget +(\d+): (\d+) raising, (\d+) raises \(max (\d+)\), (\d+) refused, "
                     r"(\d+) laid out at once, candidates max (\d+); against lib 0: (\d+) differ, (same trees|TREES DIFFER)")
    rows = [pat.fullmatch(x) for x in lines]
    assert all(rows), lines
    for base, other in zip(rows[0::2], rows[1::2]):
        assert (base[1], other[1]) == ("0", "1")
        assert base.groups()[1:9] == other.groups()[1:9]   # the same counts, point by point
        assert other[10] == "0" and other[11] == "same trees"
        budget, raising, raises, refused, cand = int(base[3]), int(base[4]), int(base[5]), int(base[7]), int(base[9])
        assert refused == 0 and raises >= raising and cand >= budget
        assert base[8] == "0"   # the two-CTA kernel's program (no --linear-raise) never lays out at once


def test_host_twin_fuzz_checks_against_the_heap_build(lib_path):
    """scripts/tree_build_host_twin.py --fuzz: random requests, both programs, every
    selection equal to the heap build's, and the summary says how many ran."""
    root = pathlib.Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, str(root / "scripts" / "tree_build_host_twin.py"), str(lib_path),
                        "--fuzz", "4", "--seed", "5"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.fullmatch(r"(\d+) requests, (\d+) selections: 0 differ from the heap build, (\d+) refused \(warp loop\), "
                     r"(\d+) laid out at once", r.stdout.strip())
    assert m, r.stdout
    requests, selections = int(m[1]), int(m[2])
    assert requests >= 20 and selections == 2 * requests


def test_host_twin_fuzz_check_fails_on_a_wrong_selection(lib_path):
    """The fuzz's comparison is not vacuous: one changed rank, parent or link, or a node
    short, and the selection no longer equals the heap build's."""
    root = pathlib.Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("tree_build_host_twin", root / "scripts" / "tree_build_host_twin.py")
    twin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(twin)
    f = twin.load(lib_path)
    case = dict(L=6, K=40, vocab=4000, budget=30, drafts="mixed", coarse=0.3, rows="drafter", seed=11)
    lp, ids = twin.fuzz_inputs(case)
    run, heap = twin.select(f, lp, case["budget"]), build_tree(lp, ids, case["budget"])
    assert run[0] == 30 and twin.same_as_heap(run, heap)
    for field in range(5):   # parents, ranks, depths, next_token, next_sibling
        outs = [o.copy() for o in run[1]]
        outs[field][run[0]] += 1
        assert not twin.same_as_heap((run[0], outs, run[2]), heap), field
    assert not twin.same_as_heap((run[0] - 1, run[1], run[2]), heap)


def test_info_loads_the_library_it_names(lib_path, monkeypatch):
    """`python -m kdtree info` on a built library: it loads, with this package's C ABI, and says
    the archs it was built for, which decide what each GPU runs."""
    from kdtree import build, info, loader

    monkeypatch.setenv("KDTREE_LIB", str(lib_path))
    assert loader.build_archs(loader.load(lib_path)) == build.DEFAULT_ARCHS
    assert info.library_line() == (f"library: {lib_path} (KDTREE_LIB, C ABI {loader.ABI_VERSION}; "
                                   "sm_90a, sm_120, compute_90)")
    assert info.library_archs() == build.DEFAULT_ARCHS


def test_a_library_names_the_archs_it_was_built_for(tmp_path, monkeypatch):
    """A build of other archs says so (info then judges each GPU by them); one compiled by
    other means than kdtree.build says it does not know."""
    from kdtree import build, info, loader

    src = build.KERNELS / "src" / "abi.cu"
    nvcc = build.find_nvcc()
    for archs, want in ((("sm_120",), ("sm_120",)), (None, ())):
        so = tmp_path / f"lib{len(want)}.so"
        flags = build.compile_flags(archs) if archs else ["-I" + str(build.KERNELS / "include"), "-Xcompiler", "-fPIC"]
        subprocess.run([nvcc, "-shared", *flags, "-arch=sm_90a", str(src), "-o", str(so)], check=True)
        lib = ctypes.CDLL(str(so))
        lib.kd_build_archs.restype = ctypes.c_char_p
        assert loader.build_archs(lib) == want
    monkeypatch.setenv("KDTREE_LIB", str(tmp_path / "lib1.so"))
    monkeypatch.setattr(loader, "load", _abi_only)   # abi.cu alone: not the whole C ABI
    assert info.library_archs() == ("sm_120",)


def _abi_only(path):
    so = ctypes.CDLL(str(path))
    so.kd_build_archs.restype = ctypes.c_char_p
    return so
