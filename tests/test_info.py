"""`python -m kdtree info`: what each GPU runs, whether its kind was measured, where the library
comes from and whether patch() would find a DDTree worker; read-only."""
import pathlib
import sys
import types

import pytest

from kdtree import info
from kdtree.cli import main


@pytest.mark.parametrize("cc, code", [((9, 0), "sm_90a"), ((12, 0), "sm_120"), ((12, 1), "sm_120"),
                                      ((10, 0), "compute_90 PTX"), ((10, 3), "compute_90 PTX"), ((8, 9), None),
                                      ((7, 0), None)])
def test_device_code_follows_the_default_build(cc, code):
    got, kernel = info.device_code(*cc)
    if code is None:
        assert got is None and "need 9.0 or newer" in kernel
    else:
        assert got.startswith(code)
        assert ("wgmma" in kernel) == (cc == (9, 0))


@pytest.mark.parametrize("archs, cc, code", [
    (("sm_90a",), (9, 0), "sm_90a"), (("sm_90a",), (12, 0), None), (("sm_90a",), (9, 1), None),
    (("sm_90", "sm_90a"), (9, 0), "sm_90a"), (("sm_90",), (9, 0), "sm_90"),
    (("sm_120", "compute_90"), (9, 0), "compute_90 PTX"), (("compute_90", "compute_100"), (10, 3), "compute_100 PTX"),
    (("compute_90a",), (10, 0), None), (("sm_100f", "compute_90"), (10, 3), "sm_100f"),
    (("sm_120", "sm_100"), (12, 1), "sm_120"), (("sm_120",), (8, 9), None)])
def test_device_code_follows_the_library_archs(archs, cc, code):
    """A library built for other archs (`kdtree build --archs`, KDTREE_LIB): the newest cubin a
    device runs (an arch-specific one on its own compute capability alone), else PTX, else none."""
    got, why = info.device_code(*cc, archs)
    if code is None:
        assert got is None
        assert ("need 9.0 or newer" in why) if cc < (9, 0) else why == f"this library holds no code for it: built for {', '.join(archs)}"
    else:
        assert got.startswith(code)
        assert ("wgmma" in why) == (got == "sm_90a")


def test_gpu_lines_say_what_runs_and_what_was_measured():
    lines = info.gpu_lines([("NVIDIA H200", (9, 0), 132),
                            ("NVIDIA RTX PRO 6000 Blackwell Server Edition", (12, 0), 188),
                            ("NVIDIA A100-SXM4-80GB", (8, 0), 108)])
    assert lines[0].startswith("GPU 0: NVIDIA H200, compute capability 9.0, 132 SMs: runs sm_90a")
    assert "measured and GPU-tested" in lines[0]
    assert "runs sm_120, the mma.sync verify kernel" in lines[1] and "run the tests here" in lines[1]
    assert "not supported" in lines[2] and "runs" not in lines[2]
    assert info.gpu_lines([]) == ["GPU: none visible (torch.cuda); the ops need one, the references do not"]
    hopper_only = info.gpu_lines([("NVIDIA RTX PRO 6000 Blackwell Server Edition", (12, 0), 188)], ("sm_90a",))
    assert hopper_only == ["GPU 0: NVIDIA RTX PRO 6000 Blackwell Server Edition, compute capability 12.0, 188 SMs: "
                           "not supported (this library holds no code for it: built for sm_90a)"]


def test_library_line_names_a_missing_or_broken_library(tmp_path, monkeypatch):
    monkeypatch.setenv("KDTREE_LIB", str(tmp_path / "nothing.so"))
    assert "no such file" in info.library_line()
    junk = tmp_path / "junk.so"
    junk.write_text("not a library")
    monkeypatch.setenv("KDTREE_LIB", str(junk))
    assert info.library_line().startswith(f"library: {junk} (KDTREE_LIB) does not load")


def worker(sig="(top_log_probs, top_token_ids, budget)"):
    m = types.ModuleType("sglang.srt.speculative.ddtree_utils")
    ns = {}
    exec(f"def build_ddtree_tree_from_topk{sig}:\n    return 'cpu path'\n", ns)
    m.build_ddtree_tree_from_topk = ns["build_ddtree_tree_from_topk"]
    return m


def test_sglang_line_says_what_patch_would_do_and_does_not_do_it(monkeypatch):
    assert info.sglang_line().startswith("SGLang: not installed here")   # none on CI
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(__version__="0.5.99"))
    m = worker()
    original = m.build_ddtree_tree_from_topk
    monkeypatch.setitem(sys.modules, "sglang.srt.speculative.ddtree_utils", m)
    assert info.sglang_line() == ("SGLang 0.5.99: patch() (or KDTREE_SGLANG=1) would replace "
                                  "sglang.srt.speculative.ddtree_utils.build_ddtree_tree_from_topk")
    assert m.build_ddtree_tree_from_topk is original   # nothing replaced
    worker_copy = types.ModuleType("sglang.srt.speculative.ddtree_worker")
    worker_copy.build_ddtree_tree_from_topk = original   # `from .ddtree_utils import ...`
    monkeypatch.setitem(sys.modules, "sglang.srt.speculative.ddtree_worker", worker_copy)
    assert info.sglang_line().endswith("would replace sglang.srt.speculative.ddtree_utils.build_ddtree_tree_from_topk, "
                                       "sglang.srt.speculative.ddtree_worker.build_ddtree_tree_from_topk")
    monkeypatch.setitem(sys.modules, "sglang.srt.speculative.ddtree_utils", worker("(lp, ids, budget, temp)"))
    line = info.sglang_line()
    assert line.startswith("SGLang 0.5.99: patch() would refuse") and "expected parameters" in line


def test_attention_line_says_what_patch_attention_would_do(monkeypatch):
    assert info.attention_line() is None   # no SGLang: sglang_line says so
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(__version__="0.5.99"))
    mod = types.ModuleType("sglang.srt.layers.attention.triton_backend")
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    assert info.attention_line().startswith("SGLang attention: patch_attention() would refuse: ")

    class TritonAttnBackend:
        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None):
            return "triton"

    TritonAttnBackend.__module__ = mod.__name__
    mod.TritonAttnBackend = TritonAttnBackend
    original = TritonAttnBackend.forward_extend
    assert info.attention_line() == (
        "SGLang attention: patch_attention() (or KDTREE_SGLANG_ATTENTION=1) would replace "
        "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.forward_extend (MLA tree verify on kdtree's "
        "kernel)")
    assert TritonAttnBackend.forward_extend is original   # nothing replaced


def test_info_command_prints_the_report(capsys):
    assert main(["info"]) in (None, 0)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("kdtree ") and out[1].startswith("library: ")
    assert any(line.startswith("GPU") for line in out) and out[-2].startswith("SGLang")
    assert out[-1].startswith("startup hook: ")


def test_hook_line_finds_the_pth_and_the_hook_on_the_path(tmp_path, monkeypatch):
    import shutil

    # sys.path replaced, never edited in place: the interpreter's own list comes back whole.
    others = [p for p in sys.path if not (pathlib.Path(p or ".") / "kdtree-sglang.pth").exists()]
    monkeypatch.setattr(sys, "path", others)
    assert info.hook_line().startswith("startup hook: not installed")
    (tmp_path / "kdtree-sglang.pth").write_text("import os\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *others])
    assert info.hook_line().startswith("startup hook: not installed")   # the .pth without its module
    shutil.copy(info.__file__.replace("info.py", "sglang/startup_hook.py"), tmp_path / "_kdtree_sglang_hook.py")
    assert info.hook_line() == (f"startup hook: {tmp_path / 'kdtree-sglang.pth'} (KDTREE_SGLANG=1 in the server's "
                                "environment switches the worker over when the server imports it, "
                                "KDTREE_SGLANG_ATTENTION=1 the Triton backend's tree verify)")


def test_info_under_kdtree_sglang_1_only_asks(tmp_path):
    """With KDTREE_SGLANG=1 and KDTREE_SGLANG_ATTENTION=1 in the environment, `kdtree info`
    imports kdtree.sglang without letting it patch: it says what patch() and
    patch_attention() would replace and replaces nothing."""
    import os
    import subprocess

    pkg = tmp_path / "sglang" / "srt" / "speculative"
    pkg.mkdir(parents=True)
    (tmp_path / "sglang" / "__init__.py").write_text("__version__ = '0.5.99'\n")
    (tmp_path / "sglang" / "srt" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "ddtree_utils.py").write_text("def build_ddtree_tree_from_topk(top_log_probs, top_token_ids, budget):\n"
                                         "    return 'cpu path'\n")
    att = tmp_path / "sglang" / "srt" / "layers" / "attention"
    att.mkdir(parents=True)
    for d in (att.parent, att):
        (d / "__init__.py").write_text("")
    (att / "triton_backend.py").write_text(
        "class TritonAttnBackend:\n"
        "    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None):\n"
        "        return 'triton'\n")
    env = dict(os.environ, KDTREE_SGLANG="1", KDTREE_SGLANG_ATTENTION="1", PYTHONPATH=os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    # As installed (the startup hook active from interpreter start) and without the hook.
    hook = pathlib.Path(info.__file__).parent / "sglang" / "startup_hook.py"
    with_hook = ("import importlib.util, sys\n"
                 f"spec = importlib.util.spec_from_file_location('_kdtree_sglang_hook', {str(hook)!r})\n"
                 "h = importlib.util.module_from_spec(spec); spec.loader.exec_module(h); h.install()\n"
                 "assert h.active()\n"
                 "from kdtree.cli import main; main(['info']); assert h.active()\n")
    for argv in (["-m", "kdtree", "info"], ["-c", with_hook]):
        r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr
        assert "SGLang 0.5.99: patch() (or KDTREE_SGLANG=1) would replace " \
               "sglang.srt.speculative.ddtree_utils.build_ddtree_tree_from_topk" in r.stdout, argv
        assert "patch_attention() (or KDTREE_SGLANG_ATTENTION=1) would replace sglang.srt.layers.attention." \
               "triton_backend.TritonAttnBackend.forward_extend" in r.stdout, argv
        assert "replaced" not in r.stderr
