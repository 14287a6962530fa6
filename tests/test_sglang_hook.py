"""KDTREE_SGLANG=1 with nothing else changed: the startup hook (kdtree/sglang/startup_hook.py,
installed as _kdtree_sglang_hook beside kdtree-sglang.pth) switches a DDTree worker over when
the server imports it. Each case runs a fresh interpreter over a stand-in SGLang package in
the worker layouts kdtree knows."""
import os
import pathlib
import subprocess
import sys
import zipfile

from kdtree.sglang import startup_hook

ROOT = pathlib.Path(__file__).resolve().parent.parent
HOOK = ROOT / "kdtree" / "sglang" / "startup_hook.py"
CPU_BUILDER = "def build_ddtree_tree_from_topk{sig}:\n    return 'cpu path'\n"


def fake_sglang(root: pathlib.Path, layout: str, sig="(top_log_probs, top_token_ids, budget)") -> pathlib.Path:
    """A stand-in sglang package: `dflash` (utils define the builder with workspace=None, the
    worker imports it by name) or `ddtree` (the worker calls a utils function that calls it)."""
    spec = root / "sglang" / "srt" / "speculative"
    spec.mkdir(parents=True)
    for d in (root / "sglang", root / "sglang" / "srt", spec):
        (d / "__init__.py").write_text("")
    if layout == "dflash":
        (spec / "dflash_ddtree_utils.py").write_text(CPU_BUILDER.format(sig=sig))
        (spec / "dflash_ddtree_worker.py").write_text(
            "from sglang.srt.speculative.dflash_ddtree_utils import build_ddtree_tree_from_topk\n"
            "def round_(lp, ids, budget):\n    return build_ddtree_tree_from_topk(lp, ids, budget)\n")
    else:
        (spec / "ddtree_utils.py").write_text(CPU_BUILDER.format(sig=sig) +
                                              "def build_ddtree_tree(lp, ids, budget):\n"
                                              "    return build_ddtree_tree_from_topk(lp, ids, budget)\n")
        (spec / "ddtree_worker.py").write_text(
            "from sglang.srt.speculative.ddtree_utils import build_ddtree_tree\n"
            "def round_(lp, ids, budget):\n    return build_ddtree_tree(lp, ids, budget)\n")
    return root


def fake_backend(root: pathlib.Path) -> pathlib.Path:
    """SGLang's Triton attention backend module beside the stand-in worker (`fake_sglang`)."""
    att = root / "sglang" / "srt" / "layers" / "attention"
    att.mkdir(parents=True)
    for d in (root / "sglang", root / "sglang" / "srt", att.parent, att):
        if not (d / "__init__.py").exists():
            (d / "__init__.py").write_text("")
    (att / "triton_backend.py").write_text(
        "class TritonAttnBackend:\n"
        "    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None):\n"
        "        return 'triton'\n")
    return root


# Whether the backend's method is kdtree's, after the server imported it.
BACKEND = """
import sglang.srt.layers.attention.triton_backend as t
print("BACKEND", "kdtree" if getattr(t.TritonAttnBackend.forward_extend, "_kdtree_original", None) else "sglang")
"""

# The worker's round on CPU inputs: kdtree's builder gives the 7-tuple, the stand-in a string.
ROUND = """
import sys
from kdtree.harness.workloads import stage_a_inputs
import sglang.srt.speculative.{worker} as w
lp, ids = stage_a_inputs(1, 15, 50, 8, seed=9)
got = w.round_(lp[0], ids[0], 8)
print("ROUND", "kdtree" if isinstance(got, tuple) and len(got) == 7 else got)
"""
INSTALL = """
import importlib.util
spec = importlib.util.spec_from_file_location("_kdtree_sglang_hook", {hook!r})
hook = importlib.util.module_from_spec(spec)
import sys; sys.modules["_kdtree_sglang_hook"] = hook
spec.loader.exec_module(hook)
hook.install()
"""


def run(code: str, pythonpath, env_extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDTREE_SGLANG")}
    env.update(env_extra or {})
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout, r.stderr


def test_hook_watches_the_modules_patch_knows():
    from kdtree.sglang.patch import MODULES

    assert startup_hook.MODULES == MODULES


def test_hook_switches_a_worker_that_imported_the_builder_by_name(tmp_path):
    sg = fake_sglang(tmp_path, "dflash", "(top_log_probs, top_token_ids, budget, workspace=None)")
    out, err = run(INSTALL.format(hook=str(HOOK)) + ROUND.format(worker="dflash_ddtree_worker"),
                   [sg, ROOT], {"KDTREE_SGLANG": "1"})
    assert "ROUND kdtree" in out
    assert err.count("kdtree.sglang: replaced sglang.srt.speculative.dflash_ddtree_utils.build_ddtree_tree_from_topk") == 1
    assert "not patched" not in err


def test_hook_switches_a_worker_that_calls_its_utils(tmp_path):
    sg = fake_sglang(tmp_path, "ddtree")
    out, err = run(INSTALL.format(hook=str(HOOK)) + ROUND.format(worker="ddtree_worker"), [sg, ROOT],
                   {"KDTREE_SGLANG": "1"})
    assert "ROUND kdtree" in out and "replaced sglang.srt.speculative.ddtree_utils." in err
    assert "not patched" not in err   # the worker holds no builder of its own: nothing to say


def test_hook_leaves_a_worker_it_does_not_know_on_its_cpu_path(tmp_path):
    sg = fake_sglang(tmp_path, "dflash", "(top_log_probs, top_token_ids, budget, temperature=1.0)")
    out, err = run(INSTALL.format(hook=str(HOOK)) + ROUND.format(worker="dflash_ddtree_worker"), [sg, ROOT],
                   {"KDTREE_SGLANG": "1"})
    assert "ROUND cpu path" in out
    assert "KDTREE_SGLANG=1 but sglang.srt.speculative.dflash_ddtree_utils not patched: PatchError" in err
    assert err.count("not patched") == 1   # the worker's copy of the refused builder: said once


def test_hook_with_kdtree_sglang_imported_first_patches_once(tmp_path):
    """A launcher that imports kdtree.sglang before SGLang loads the worker: the import-time
    patch defers to the hook, which patches at the worker's import, once."""
    sg = fake_sglang(tmp_path, "dflash", "(top_log_probs, top_token_ids, budget, workspace=None)")
    code = INSTALL.format(hook=str(HOOK)) + "import kdtree.sglang\n" + ROUND.format(worker="dflash_ddtree_worker")
    out, err = run(code, [sg, ROOT], {"KDTREE_SGLANG": "1"})
    assert "ROUND kdtree" in out and err.count("kdtree.sglang: replaced") == 1


def test_the_wheel_installs_the_hook_and_only_kdtree_sglang_1_starts_it(tmp_path):
    """The built wheel holds the hook and its .pth at the top level; a site directory holding
    the install runs the .pth line at start: with KDTREE_SGLANG=1 the worker is switched on
    its import, without it nothing of kdtree is imported."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        (src / name).write_bytes((ROOT / name).read_bytes())
    subprocess.run(["cp", "-r", str(ROOT / "kdtree"), str(ROOT / "kernels"), str(src)], check=True)
    (src / "workflow").mkdir()
    subprocess.run(["cp", "-r", str(ROOT / "workflow" / "schemas"), str(src / "workflow")], check=True)
    dist = tmp_path / "dist"
    env = dict(os.environ, KDTREE_BUILD_KERNELS="0")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(src)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = dist.glob("*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert "_kdtree_sglang_hook.py" in names and "kdtree-sglang.pth" in names
    site_dir = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site_dir), str(whl)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    sg = fake_sglang(tmp_path / "sg", "dflash", "(top_log_probs, top_token_ids, budget, workspace=None)")
    # The install first on the path, its .pth run as the interpreter runs site-packages' own.
    start = f"import site, sys; sys.path.insert(0, {str(site_dir)!r}); site.addsitedir({str(site_dir)!r})\n"
    out, err = run(start + ROUND.format(worker="dflash_ddtree_worker") +
                   "import kdtree; print('FROM', kdtree.__file__)\n", [sg], {"KDTREE_SGLANG": "1"})
    assert "ROUND kdtree" in out and f"FROM {site_dir}" in out and "replaced" in err
    out, err = run(start + "import sys; print('HOOK', '_kdtree_sglang_hook' in sys.modules, 'kdtree' in sys.modules)\n"
                   + ROUND.format(worker="dflash_ddtree_worker"), [sg])
    assert "HOOK False False" in out and "ROUND cpu path" in out
    fake_backend(sg)   # KDTREE_SGLANG_ATTENTION=1 alone: the backend switched, the worker not
    out, err = run(start + ROUND.format(worker="dflash_ddtree_worker") + BACKEND, [sg],
                   {"KDTREE_SGLANG_ATTENTION": "1"})
    assert "ROUND cpu path" in out and "BACKEND kdtree" in out and err.count("replaced") == 1


def test_hook_switches_the_attention_backend_only_under_its_own_variable(tmp_path):
    """KDTREE_SGLANG_ATTENTION=1: the Triton backend's forward_extend is kdtree's once its
    module has run; KDTREE_SGLANG=1 alone leaves it to SGLang; both switch both."""
    sg = fake_backend(fake_sglang(tmp_path, "ddtree"))
    code = INSTALL.format(hook=str(HOOK)) + ROUND.format(worker="ddtree_worker") + BACKEND
    out, err = run(code, [sg, ROOT], {"KDTREE_SGLANG_ATTENTION": "1"})
    assert "ROUND cpu path" in out and "BACKEND kdtree" in out
    assert "replaced sglang.srt.layers.attention.triton_backend.TritonAttnBackend.forward_extend" in err
    out, err = run(code, [sg, ROOT], {"KDTREE_SGLANG": "1"})
    assert "ROUND kdtree" in out and "BACKEND sglang" in out
    out, err = run(code, [sg, ROOT], {"KDTREE_SGLANG": "1", "KDTREE_SGLANG_ATTENTION": "1"})
    assert "ROUND kdtree" in out and "BACKEND kdtree" in out and err.count("replaced") == 2
    code = INSTALL.format(hook=str(HOOK)) + "import kdtree.sglang\n" + BACKEND   # import-time patch defers
    out, err = run(code, [sg, ROOT], {"KDTREE_SGLANG_ATTENTION": "1"})
    assert "BACKEND kdtree" in out and err.count("replaced") == 1 and "not patched" not in err


def test_hook_installed_late_patches_what_is_already_imported_and_only_the_named_module(tmp_path):
    """install() after the worker module was imported patches it then; KDTREE_SGLANG_MODULE
    narrows the watch to the module it names."""
    sg = fake_sglang(tmp_path, "ddtree")
    late = ("import sglang.srt.speculative.ddtree_utils as u\n" + INSTALL.format(hook=str(HOOK)) +
            "print('LATE', u.build_ddtree_tree_from_topk.__module__)\n")
    out, err = run(late, [sg, ROOT], {"KDTREE_SGLANG": "1"})
    assert "LATE kdtree.sglang.builder" in out
    out, err = run(INSTALL.format(hook=str(HOOK)) + ROUND.format(worker="ddtree_worker"), [sg, ROOT],
                   {"KDTREE_SGLANG": "1", "KDTREE_SGLANG_MODULE": "sglang.srt.speculative.dflash_ddtree_utils"})
    assert "ROUND cpu path" in out and "replaced" not in err   # another module named: ddtree_utils left alone
