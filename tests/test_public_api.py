"""The library as a user imports it: one public API, torch ops with fake implementations,
and (in CI, KDTREE_EXPECT_INSTALLED=1) a package installed from the checkout, not the
checkout itself."""
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kdtree
from kdtree.tools.gpu_tests import gate

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_public_name_resolves():
    assert kdtree.__version__
    for name in kdtree.__all__:
        assert hasattr(kdtree, name), name
    # one naming scheme: the three ops and their references
    for op in ("tree_build", "tree_verify", "tree_accept"):
        assert callable(getattr(kdtree, op)) and callable(getattr(kdtree, op + "_ref"))


def test_sglang_drop_in_is_an_attribute_after_import_kdtree():
    """README's `kdtree.sglang.patch()` works after `import kdtree` alone (a fresh interpreter:
    another test's import of kdtree.sglang would set the attribute); other names still fail."""
    code = ("import kdtree, sys; assert 'kdtree.sglang' not in sys.modules; "
            "assert callable(kdtree.sglang.patch) and callable(kdtree.sglang.VerifyAttention)\n"
            "try:\n    kdtree.sglang_\nexcept AttributeError as e:\n    assert \"'sglang_'\" in str(e)\n"
            "else:\n    raise SystemExit('kdtree.sglang_ resolved')")
    env = {k: v for k, v in os.environ.items() if k != "KDTREE_SGLANG"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(os.environ.get("KDTREE_EXPECT_INSTALLED") != "1", reason="only where CI installed kdtree")
def test_imported_from_the_installed_package():
    here = pathlib.Path(kdtree.__file__).resolve()
    assert here.parent != ROOT / "kdtree", f"kdtree imported from the checkout: {here}"
    from kdtree import build, loader
    assert (pathlib.Path(build.KERNELS) / "include" / "kdtree.h").exists()   # sources travel along
    assert pathlib.Path(build.KERNELS).resolve() != ROOT / "kernels"
    if loader.PACKAGED_LIB.exists():   # compiled at install time (nvcc present)
        assert loader.library_path() == loader.PACKAGED_LIB or os.environ.get("KDTREE_LIB")


def test_torch_ops_are_registered_with_fake_implementations():
    """Shapes and dtypes without a GPU (what torch.compile traces with)."""
    with FakeTensorMode():
        B, L, K, D, H = 3, 15, 64, 65, 8
        lp = torch.empty(B, L, K, device="cuda")
        ids = torch.empty(B, L, K, dtype=torch.int64, device="cuda")
        budgets = torch.empty(B, dtype=torch.int32, device="cuda")
        r = torch.ops.kdtree.tree_build(lp, ids, budgets, None, None, D)
        assert [tuple(t.shape) for t in r] == [(B,)] + [(B, D)] * 6 + [(B, D, 3), (B,)]
        assert r[3].dtype == torch.int32 and r[1].dtype == torch.int64 and r[7].dtype == torch.int32
        q = torch.empty(B, D, H, 576, dtype=torch.bfloat16, device="cuda")
        cache = torch.empty(10, 64, 576, dtype=torch.bfloat16, device="cuda")
        table = torch.empty(B, 4, dtype=torch.int32, device="cuda")
        out, lse = torch.ops.kdtree.tree_verify(q, cache, table, budgets, r[7], 0.130861)
        assert out.shape == (B, D, H, 512) and out.dtype == torch.bfloat16
        assert lse.shape == (B, D, H) and lse.dtype == torch.float32
        idx, n, bonus = torch.ops.kdtree.tree_accept(r[1], r[1], 15, r[3], r[0])
        assert idx.shape == (B, 16) and idx.dtype == torch.int32 and n.shape == (B,) and bonus.dtype == torch.int64


def test_torch_ops_name_the_argument_on_cpu_tensors():
    """A CPU tensor reaches the op's own checks (an InputError naming it), not the dispatcher."""
    from kdtree import InputError

    lp = torch.randn(2, 3, 4).sort(-1, descending=True).values.log_softmax(-1)
    ids = torch.zeros(2, 3, 4, dtype=torch.int64)
    budgets = torch.full((2,), 3, dtype=torch.int32)
    with pytest.raises(InputError, match="top_logprobs: expected a CUDA tensor"):
        torch.ops.kdtree.tree_build(lp, ids, budgets, None, None, 4)
    tokens = torch.zeros(2, 5, dtype=torch.int64)
    parents = torch.full((2, 5), -1, dtype=torch.int32)
    with pytest.raises(InputError, match="tokens: expected a CUDA tensor"):
        torch.ops.kdtree.tree_accept(tokens, tokens, 4, parents, torch.ones(2, dtype=torch.int32), None, None)
    q = torch.zeros(1, 2, 8, 576, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="q: expected a CUDA tensor"):
        torch.ops.kdtree.tree_verify(q, torch.zeros(4, 64, 576, dtype=torch.bfloat16),
                                     torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                                     torch.ones(1, 2, 2, dtype=torch.bool), 0.1)


def test_verify_plan_without_a_gpu_names_the_device():
    """A plan made where torch sees no GPU says so, not torch's own assertion."""
    import kdtree
    from kdtree import InputError

    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        with pytest.raises(InputError, match=f"device: expected cuda:0 to cuda:{n - 1}, got cuda:{n}"):
            kdtree.TreeVerifyPlan(1, 5, 8, page_size=64, max_pages=4, device=f"cuda:{n}")
    else:
        with pytest.raises(InputError, match="device: expected a CUDA device, but torch .* sees none"):
            kdtree.TreeVerifyPlan(1, 5, 8, page_size=64, max_pages=4)
    with pytest.raises(InputError, match="device: expected a CUDA device, got cpu"):
        kdtree.TreeVerifyPlan(1, 5, 8, page_size=64, max_pages=4, device="cpu")


@pytest.mark.parametrize("args,name", [((-1, 15, 64, 65), "B"), ((4, 15, 64, 0), "d_max"),
                                       ((4, 15, 64, 1026), "d_max"), ((4, 15, 64, True), "d_max"),
                                       ((4, 2048, 64, 65), "L"),
                                       ((4, 15, 2.0, 65), "K")])
def test_tree_build_plan_names_the_bad_argument(args, name):
    """The tree build's plan query checks its shape before it looks for a device."""
    from kdtree import InputError, ops

    with pytest.raises(InputError, match=f"^{name}: expected"):
        ops.tree_build_plan(*args)
    with pytest.raises(InputError, match="device: expected a CUDA device, got cpu"):
        ops.tree_build_plan(4, 15, 64, 65, device="cpu")


def test_gpu_test_gate_fails_when_nothing_ran():
    row = lambda outcome: {"test_id": "t", "outcome": outcome, "duration_s": 0.0, "message": "no CUDA device"}
    assert gate([], 5) == 1                                   # none collected
    assert gate([row("skipped")] * 3, 0) == 1                 # all skipped
    assert gate([row("skipped"), row("passed")], 0) == 0
    assert gate([row("failed"), row("passed")], 1) == 0       # failures are rows: the sweeps refuse them
    assert gate([row("passed")], 2) == 2                      # pytest itself broke


def test_gpu_tests_are_dealt_round_robin():
    from kdtree.tools.gpu_tests import deal
    ids = [f"t[{i}]" for i in range(7)]
    assert deal(ids, 3) == [["t[0]", "t[3]", "t[6]"], ["t[1]", "t[4]"], ["t[2]", "t[5]"]]
    assert deal(ids[:2], 4) == [["t[0]"], ["t[1]"]]            # no empty shard
    assert deal([], 4) == []


def test_gpu_tests_in_workers_record_what_one_process_records(tmp_path):
    """`kdtree test-gpu --workers N`: the same tests, each once, with the same outcomes as one
    pytest process (on a machine without a GPU, all skipped: the gate then fails both), and
    a worker's broken pytest is a row, not a lost shard."""
    import pandas as pd
    from kdtree.tools import gpu_tests

    pick = ["-k", "dropin_errors or int_budgets or test_tree_build_small_batch"]
    rcs, runs = [], []
    for w in (1, 3):
        out = tmp_path / f"w{w}.parquet"
        rcs.append(gpu_tests.run_gpu_tests(out, extra_args=pick, workers=w))
        runs.append(pd.read_parquet(out).set_index("test_id").outcome.sort_index())
    assert len(runs[0]) == 9 and runs[0].index.is_unique
    pd.testing.assert_series_equal(runs[0], runs[1])
    assert rcs[0] == rcs[1]
    with pytest.raises(ValueError, match="workers: expected an integer >= 1, got 0"):
        gpu_tests.run_gpu_tests(tmp_path / "w0.parquet", workers=0)
    rows, rc = gpu_tests.run_shards([["tests/test_public_api.py::no_such_test"]], dict(os.environ), tmp_path)
    assert rc == 4 and rows[0]["outcome"] == "error" and rows[0]["test_id"] == "<shard 1>"


def test_config_schema_is_closed_documented_and_its_readme_current():
    import yaml

    from kdtree.tools.config_doc import generate, undocumented

    schema = yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text())
    assert undocumented(schema) == []
    assert schema.get("additionalProperties") is False
    assert (ROOT / "config/README.md").read_text() == generate(ROOT), "run `python -m kdtree config-doc`"
    # the checker catches what it should
    bad = {"properties": {"a": {"type": "object", "description": "x", "properties": {"b": {"type": "integer"}}}}}
    assert undocumented(bad) == ["a: accepts unknown keys", "a.b: no description"]


def test_a_launch_runs_on_its_tensors_device_and_restores_the_callers(monkeypatch):
    """ops._launch (every launch goes through it): the library launches on the current device,
    so the tensors' device is made current for the call, and the caller's device comes back,
    also when the launch fails; no device call where the two agree."""
    from kdtree import ops

    current, switches, seen = [0], [], []

    def set_device(i):
        switches.append(i)
        current[0] = i

    class Lib:
        def kd_fake(self, *args):
            seen.append((current[0], args))
            return 0

        def kd_fails(self, *args):
            seen.append((current[0], args))
            return 2

        def kd_error_string(self, rc):
            return b"out of memory"

    monkeypatch.setattr(ops, "_get_device", lambda: current[0])
    monkeypatch.setattr(ops, "_set_device", set_device)
    monkeypatch.setattr(ops, "_stream", lambda dev: 1000 + dev.index)
    monkeypatch.setattr(ops, "lib", Lib)
    ops._launch("x", torch.device("cuda", 1), "kd_fake", 7, 8)
    assert seen == [(1, (7, 8, 1001))] and switches == [1, 0] and current[0] == 0
    switches.clear(), seen.clear()
    ops._launch("x", torch.device("cuda", 0), "kd_fake")
    assert seen == [(0, (1000,))] and switches == []
    with pytest.raises(RuntimeError, match=r"^y: CUDA error 2 at launch \(out of memory\)$"):
        ops._launch("y", torch.device("cuda", 3), "kd_fails")
    assert seen[-1][0] == 3 and current[0] == 0


def test_verify_scale_takes_any_positive_real_and_names_what_it_refuses():
    import numpy as np
    from kdtree import ops
    from kdtree.checks import InputError

    for v, want in ((0.130861, 0.130861), (np.float32(0.125), 0.125), (np.float64(0.5), 0.5), (1, 1.0)):
        got = ops._check_scale(v)
        assert type(got) is float and got == want
    for bad, says in ((0, r"got 0\.0$"), (-0.1, "got -0.1"), (float("nan"), "got nan"), (float("inf"), "got inf"),
                      (True, "got bool"), ("0.13", "got str"), (None, "got NoneType"),
                      (torch.tensor(0.13), r"got Tensor \(a tensor: pass float\(t\) once")):
        with pytest.raises(InputError, match=f"^scale: expected a positive float.*{says}"):
            ops._check_scale(bad)


def test_tree_verify_keeps_a_bounded_number_of_plans(monkeypatch):
    """A server's shapes drift (the block table widens with the context): tree_verify's plan
    cache never holds more than PLAN_CACHE_MAX plans, and a shape it holds is not planned again."""
    from kdtree import ops

    monkeypatch.setattr(ops, "_PLANS", {})
    monkeypatch.setattr(ops, "PLAN_CACHE_MAX", 8)
    made = []

    def make(key):
        made.append(key)
        return ("plan", key)

    for width in range(20):
        assert ops._cached_plan((4, 65, 8, 1, width), lambda: make(width)) == ("plan", width)
        assert len(ops._PLANS) <= 8
    assert ops._cached_plan((4, 65, 8, 1, 19), lambda: make("again")) == ("plan", 19)
    assert made == list(range(20))
