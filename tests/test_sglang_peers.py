"""SGLang's pieces as sweep peers (kdtree/harness/sglang_peers.py): found only where they are
what the spec describes, checked before they are timed, and said why where they are not."""
import inspect
import sys
import types

import pytest
import torch

from kdtree.harness import sglang_peers
from kdtree.harness.sweeps import tree_build, verify_attn
from kdtree.reference.attention import verify_attention_ref
from kdtree.sglang import reference as sglang_ref
from kdtree.harness.workloads import stage_a_inputs
from sglang_backend import fake_extend_attention_fwd, random_visibility  # tests/sglang_backend.py

WORKER = "sglang.srt.speculative.ddtree_utils"
TRITON = sglang_peers.TRITON_MODULES[0]
CFG = {"cpu_reps": 2, "cpu_max_seconds": 5}


@pytest.fixture
def no_sglang(monkeypatch):
    """No SGLang, whatever this machine has: its imports fail as a missing package's do."""
    for name in list(sys.modules):
        if name == "sglang" or name.startswith("sglang."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "sglang", None)
    clear_lookups()
    yield
    clear_lookups()   # no fake module's function outlives its test


def clear_lookups():
    for lookup in (sglang_peers.builder, sglang_peers.triton_verify, sglang_peers.sglang_version):
        lookup.cache_clear()


def fake_module(monkeypatch, name: str, **attrs):
    mod = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(mod, k, v)
    monkeypatch.setitem(sys.modules, name, mod)
    clear_lookups()   # the sweeps look SGLang up once a process
    return mod


def point(B=3, budget=12):
    lp, ids = stage_a_inputs(B, 6, 64, budget, seed=5, drafts="mixed")
    return {"batch": B, "budget": budget, "drafts": "mixed"}, lp, ids


def test_builder_not_available_says_why(no_sglang):
    fn, why = sglang_peers.builder()
    assert fn is None and WORKER in why
    p, lp, ids = point()
    row = tree_build.sglang_row(p, CFG, lp, ids, 12)
    assert row["status"] == "not_available" and row["impl"] == "sglang" and WORKER in row["reason"]
    assert "median_us" not in row


def test_builder_found_is_checked_then_timed(no_sglang, monkeypatch):
    fake_module(monkeypatch, WORKER, build_ddtree_tree_from_topk=sglang_ref.build_ddtree_tree_from_topk)
    p, lp, ids = point()
    row = tree_build.sglang_row(p, CFG, lp, ids, 12)
    assert row.get("status", "ok") == "ok" and row["median_us"] > 0 and row["kernel"] == sglang_peers.BUILDER


def test_builder_with_another_tree_is_an_error_row(no_sglang, monkeypatch):
    def other(top_log_probs, top_token_ids, budget):
        t = sglang_ref.build_ddtree_tree_from_topk(top_log_probs, top_token_ids, budget)
        return (t[0].flip(0),) + tuple(t[1:])
    fake_module(monkeypatch, WORKER, build_ddtree_tree_from_topk=other)
    p, lp, ids = point()
    row = tree_build.sglang_row(p, CFG, lp, ids, 12)
    assert row["status"] == "error" and "differs" in row["reason"] and "median_us" not in row


def test_builder_patched_by_kdtree_is_not_timed_as_sglangs(no_sglang, monkeypatch):
    """Under KDTREE_SGLANG=1 (or after patch()) the worker module holds kdtree's drop-in: timing
    it as SGLang's builder would compare kdtree with itself, so the row says why it is absent."""
    from kdtree import sglang

    fake_module(monkeypatch, WORKER, build_ddtree_tree_from_topk=sglang.build_ddtree_tree_from_topk)
    fn, why = sglang_peers.builder()
    assert fn is None and "kdtree's drop-in, not SGLang's" in why


def test_sglang_modules_load_without_the_startup_hook(no_sglang, monkeypatch):
    """The startup hook stands aside while the peers import SGLang's modules."""
    class WorkerFinder:   # the hook's finder, by name
        def find_spec(self, name, path, target=None):
            raise AssertionError(f"the hook saw {name}")

    monkeypatch.setattr(sys, "meta_path", [WorkerFinder(), *sys.meta_path])
    fn, why = sglang_peers._find(("kdtree_test_no_such_sglang_module",), "build_ddtree_tree_from_topk", ())
    assert fn is None and "ModuleNotFoundError" in why and "the hook saw" not in why
    assert type(sys.meta_path[0]).__name__ == "WorkerFinder"   # put back


def test_builder_of_another_signature_is_not_taken(no_sglang, monkeypatch):
    fake_module(monkeypatch, WORKER, build_ddtree_tree_from_topk=lambda logprobs, ids, budget: None)
    fn, why = sglang_peers.builder()
    assert fn is None and "expected parameters" in why


def tree_case(B, D, H, P, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = P + D
    cache = torch.randn(B * S + 3, 1, 576, generator=g).bfloat16()
    table = torch.randperm(B * S + 3, generator=g)[:B * S].view(B, S).int()
    q = torch.randn(B, D, H, 576, generator=g).bfloat16()
    return q, cache, table, torch.full((B,), S, dtype=torch.int32), random_visibility(B, D, g)


@pytest.mark.parametrize("B,D,H,P", [(2, 5, 3, 7), (3, 1, 2, 4), (2, 6, 1, 0), (1, 9, 4, 33)])
def test_triton_inputs_are_sglang_layout_of_the_same_attention(B, D, H, P):
    """Through SGLang's argument contract the inputs give kdtree's reference attention: the
    prefix through kv_indices, the tree slots as extend tokens, the tree mask in the custom
    mask's last D columns. A second cache copy is read by the next call."""
    q, cache, table, seq, vis = tree_case(B, D, H, P)
    other = torch.randn_like(cache.float()).bfloat16()
    call, out = sglang_peers.triton_call(fake_extend_attention_fwd, q, [cache, other], table, seq, vis, 0.13)
    for c in (cache, other):
        out.fill_(float("nan"))
        call()
        want, _ = verify_attention_ref(q, c.view(-1, 1, 576), table, seq, vis, 0.13)
        assert torch.allclose(out.double(), want, atol=2e-2), float((out.double() - want).abs().max())


def test_triton_inputs_refuse_another_page_size_or_ragged_lengths():
    q, cache, table, seq, vis = tree_case(2, 3, 2, 5)
    with pytest.raises(ValueError, match="cache: .*page size 1"):
        sglang_peers.triton_inputs(q, cache[:-1].view(-1, 2, 576), table, seq, vis)
    with pytest.raises(ValueError, match="seq: "):
        sglang_peers.triton_inputs(q, cache, table, torch.tensor([8, 7], dtype=torch.int32), vis)


def test_triton_function_found_only_with_its_parameters(no_sglang, monkeypatch):
    fn, why = sglang_peers.triton_verify()
    assert fn is None and TRITON in why
    fake_module(monkeypatch, TRITON, extend_attention_fwd=fake_extend_attention_fwd)
    assert sglang_peers.triton_verify() == (fake_extend_attention_fwd, None)
    fake_module(monkeypatch, TRITON, extend_attention_fwd=lambda q, k, v, o: None)
    fn, why = sglang_peers.triton_verify()
    assert fn is None and "expected parameters" in why
    assert tuple(inspect.signature(fake_extend_attention_fwd).parameters)[:13] == sglang_peers.TRITON_PARAMS


def test_verify_row_not_available_off_page_1_or_without_sglang(no_sglang):
    q, cache, table, seq, vis = tree_case(1, 2, 2, 3)
    base = {"batch": 1, "D": 2, "heads": 2, "prefix": 3, "page_size": 1}
    row = verify_attn.sglang_triton_row(base, q, [cache], table, seq, vis, 0.13, None, reps=3)
    assert row["status"] == "not_available" and "not importable" in row["reason"] and TRITON in row["reason"]
    row = verify_attn.sglang_triton_row(dict(base, page_size=2), q, [cache.view(-1, 2, 576)], table, seq, vis,
                                        0.13, None, reps=3)
    assert row["status"] == "not_available" and "page size 1" in row["reason"]


def test_report_and_summary_set_sglang_triton_beside_kdtree():
    """The report's section and README's line read the peer's rows as measured: its time over
    kdtree's per shape, rows of other impls and other shapes left out."""
    import pandas as pd

    from kdtree.harness import report

    shape = {"heads": 8, "D": 16, "prefix": 1024, "batch": 1, "page_size": 1}
    d = pd.DataFrame([dict(shape, impl="kdtree_kernel", median_us=10.0),
                      dict(shape, impl="sglang_triton", median_us=250.0, peer_version="0.5.23"),
                      dict(shape, impl="flashmla", median_us=1.0),
                      dict(shape, batch=16, impl="kdtree_kernel", median_us=20.0)])
    lines = report.sglang_triton_section(d)
    rows = lines[4].splitlines()
    assert "SGLang 0.5.23" in lines[2] and len(rows) == 3 and rows[2].split("|")[-2].strip() == "25"
    assert report.sglang_triton_section(d[d.impl != "sglang_triton"]) == []


def test_summary_line_for_sglang_triton(tmp_path):
    import pandas as pd

    from kdtree.harness import summary

    shape = {"heads": 8, "D": 16, "prefix": 1024, "batch": 1, "page_size": 1, "status": "ok", "gpu_name": "H200",
             "git_commit": "0123456789", "utc_time": "2026-12-04T00:00:00", "torch_version": "2.11",
             "floor_us": 1.0, "roofline_fraction": 0.1, "copy_fraction": 0.1, "bytes": 1, "copy_gbps": 4000.0}
    pd.DataFrame([dict(shape, impl="kdtree_kernel", median_us=10.0),
                  dict(shape, impl="sglang_triton", median_us=250.0),
                  dict(shape, prefix=8192, impl="kdtree_kernel", median_us=20.0),
                  dict(shape, prefix=8192, impl="sglang_triton", median_us=1000.0)]
                 ).to_parquet(tmp_path / "verify_attn.parquet")
    text = summary.summary(tmp_path)
    assert "Against SGLang's Triton tree verify (same inputs, 2 shapes, page size 1): kdtree 25-50x faster, " \
           "median 37.5x." in text
