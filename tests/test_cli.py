"""Bad input on the command line: a clear message naming what is wrong and a non-zero exit,
never a traceback, and nothing written."""
import argparse
import pathlib
import re

import pandas as pd
import pytest

from kdtree.cli import DEFAULTS, _cfg, main


def run(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    out = capsys.readouterr()
    return e.value.code, f"{e.value.code if isinstance(e.value.code, str) else ''}{out.out}{out.err}"


def refused(argv, needle, tmp_path, capsys) -> None:
    """The command ({tmp}: tmp_path) fails with a message holding `needle`, not a traceback."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code, text = run(argv, capsys)
    assert code not in (0, None), text
    assert needle.replace("{tmp}", str(tmp_path)) in text, text
    assert "Traceback" not in text


@pytest.mark.parametrize("argv,needle", [
    (["gather", "--out", "{tmp}/g.parquet", "{tmp}/missing.parquet"], "shard {tmp}/missing.parquet not found"),
    (["sweep", "tree-build", "--out", "{tmp}/s.parquet", "--cfg-json", "not json"], "--cfg-json: expected"),
    (["sweep", "tree-build", "--out", "{tmp}/s.parquet", "--cfg-json", '{"batches": [-4]}'],
     "sweep_tree_build.batches[0]: -4 is less than the minimum of 1"),
    (["sweep", "tree-build", "--out", "{tmp}/s.parquet", "--cfg-json", '{"drafts": ["peaky"]}'],
     "sweep_tree_build.drafts[0]: 'peaky' is not one of ['mixed', 'confident']"),
    (["sweep", "tree-accept", "--out", "{tmp}/s.parquet", "--cfg-json", '{"slots": [17], "bogus": 1}'],
     "sweep_tree_accept: Additional properties are not allowed ('bogus' was unexpected)"),
    (["check", "container", "{tmp}/nope.def", "constraints.txt", "README.md"], "{tmp}/nope.def: no such file"),
    (["check", "container", "{tmp}/nope.def"], "expected 3 path(s)"),
    (["build", "--build-dir", "{tmp}/b", "--archs", "sm_bogus"], "archs: expected entries like 'sm_90a'"),
    (["report", "--results", "{tmp}/nonexistent", "--out", "{tmp}/r.md"], "no such folder"),
    (["report", "--results", "{tmp}", "--out", "{tmp}/r.md"], "no Parquet files there"),
    (["figures", "--results", "{tmp}/nonexistent"], "no such folder"),
    (["readme", "--results", "{tmp}/nonexistent", "--check"], "readme: --results {tmp}/nonexistent: no such folder"),
    (["build", "--build-dir", "{tmp}/b", "--jobs", "0"], "jobs: expected an integer >= 1, got 0"),
    (["test-gpu", "--out", "{tmp}/t.parquet", "--workers", "0"], "workers: expected an integer >= 1, got 0"),
])
def test_bad_input_is_a_message_and_a_failure(tmp_path, capsys, argv, needle):
    refused(argv, needle, tmp_path, capsys)
    assert not list(tmp_path.glob("*.parquet")) and not (tmp_path / "r.md").exists()


@pytest.mark.parametrize("argv,needle", [
    (["sweep", "tree-build", "--cpu-only", "--out", "{tmp}/afile/s.parquet"], "sweep: out: {tmp}/afile is not a folder"),
    (["sweep", "tree-build", "--cpu-only", "--out", "{tmp}"], "sweep: out: {tmp} is a folder; expected a file path"),
    (["sweep", "tree-build", "--cpu-only", "--out", "/proc/self/s.parquet"], "sweep: out: cannot write in /proc/self"),
    (["test-gpu", "--out", "{tmp}/afile/t.parquet"], "test-gpu: out: {tmp}/afile is not a folder"),
    (["gather", "--out", "{tmp}/afile/g.parquet", "{tmp}/s0.parquet"], "gather: out: {tmp}/afile is not a folder"),
    (["report", "--results", "{tmp}", "--out", "{tmp}/afile/r.md"], "report: out: {tmp}/afile is not a folder"),
    (["report", "--results", "{tmp}", "--out", "{tmp}/r.md", "--figures", "{tmp}/afile/f"],
     "report: figures: cannot make folder {tmp}/afile/f"),
    (["figures", "--results", "{tmp}", "--out", "{tmp}/afile/f"], "figures: out: cannot make folder {tmp}/afile/f"),
    (["build", "--build-dir", "{tmp}/afile/b"], "kdtree build: build_dir: cannot make folder {tmp}/afile/b"),
])
def test_an_unwritable_output_is_refused_before_any_work(tmp_path, capsys, monkeypatch, argv, needle):
    """A sweep or a GPU test run can take an hour: its output path is checked first."""
    import kdtree.build
    import kdtree.harness.figures
    import kdtree.harness.sweeps
    import kdtree.tools.gpu_tests

    def started(*a, **k):
        raise AssertionError("the work started before the output path was checked")
    for mod, name in ((kdtree.harness.sweeps, "load"), (kdtree.tools.gpu_tests, "run_gpu_tests"),
                      (kdtree.harness.figures, "render_all"), (kdtree.build, "build")):
        monkeypatch.setattr(mod, name, started)
    (tmp_path / "afile").write_text("x")
    pd.DataFrame({"x": [0]}).to_parquet(tmp_path / "s0.parquet")
    refused(argv, needle, tmp_path, capsys)
    assert not (tmp_path / "r.md").exists()


def test_every_sweep_default_passes_its_schema_section():
    for section in DEFAULTS:
        _cfg(argparse.Namespace(cfg_json=None), section)   # raises InputError if the table drifted


def test_a_negative_batch_writes_no_error_rows(tmp_path, capsys):
    out = tmp_path / "s.parquet"
    code, _ = run(["sweep", "tree-build", "--cpu-only", "--out", out, "--cfg-json", '{"batches": [-1]}'], capsys)
    assert code != 0 and not out.exists()


def test_tree_build_sweep_takes_each_draft_kind(tmp_path):
    out = tmp_path / "s.parquet"
    main(["sweep", "tree-build", "--cpu-only", "--out", str(out), "--cfg-json",
          '{"batches": [2], "budgets": [16], "drafts": ["mixed", "confident"], "cpu_reps": 1}'])
    d = pd.read_parquet(out)
    cpu = d[d.impl == "cpu_heapq"]
    assert sorted(cpu.drafts) == ["confident", "mixed"] and (cpu.status == "ok").all()
    main(["sweep", "tree-build", "--cpu-only", "--out", str(out), "--cfg-json", '{"batches": [2], "budgets": [16]}'])
    assert set(pd.read_parquet(out).drafts) == {"mixed"}   # the default


def test_gather_joins_present_shards(tmp_path, capsys):
    for i in range(2):
        pd.DataFrame({"x": [i]}).to_parquet(tmp_path / f"s{i}.parquet")
    main(["gather", "--out", str(tmp_path / "g.parquet"), str(tmp_path / "s0.parquet"), str(tmp_path / "s1.parquet")])
    assert sorted(pd.read_parquet(tmp_path / "g.parquet").x) == [0, 1]



def test_each_missing_module_names_the_extra_that_brings_it():
    """The message for a missing optional module names an extra that really lists it."""
    import tomllib
    from kdtree.cli import EXTRAS
    extras = tomllib.loads((pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    dist = {"yaml": "pyyaml"}
    for module, extra in EXTRAS.items():
        names = [re.split(r"[<>=\[ ]", r)[0].lower() for r in extras[extra]]
        assert dist.get(module, module) in names, (module, extra, names)
