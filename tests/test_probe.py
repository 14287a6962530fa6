"""The probe against a real HTTP server on loopback speaking SGLang's wire format."""
import asyncio
import math
import socket

import pandas as pd
import pytest

from kdtree.probe.client import ProbeConfig, ProbeError, SSELines, load_prompts, probe_to_parquet, run_probe
from sglang_server import FakeSGLang  # tests/sglang_server.py


def probe(url, **kw):
    kw.setdefault("requests", 4)
    kw.setdefault("max_new_tokens", 31)
    kw.setdefault("timeout_s", 3.0)
    return asyncio.run(run_probe(ProbeConfig(url=url, **kw)))


def test_figures_match_what_the_server_produces():
    ttft, step, accept, M = 0.08, 0.03, 3, 31
    with FakeSGLang(ttft_s=ttft, step_s=step, accept=accept) as srv:
        df, s, msg = probe(srv.url, requests=4, max_new_tokens=M)
    assert df.ok.all() and len(df) == 4, df.error.tolist()
    steps = math.ceil((M - 1) / accept)                 # 10 verify steps after the first token
    assert (df.completion_tokens == M).all() and (df.spec_verify_ct == steps).all()
    assert s["accept_length"] == pytest.approx(M / steps)      # token-weighted, bonus included
    assert df.ttft_s.median() == pytest.approx(ttft, abs=0.015)
    want_decode = (M - 1) / (steps * step)               # tokens after the first / decode time
    assert df.decode_tok_s.median() == pytest.approx(want_decode, rel=0.05)
    assert s["itl_s_median"] == pytest.approx(step / accept, rel=0.1)
    assert s["tpot_s_median"] == pytest.approx(steps * step / (M - 1), rel=0.05)
    assert s["verify_step_ms"] == pytest.approx(1e3 * (M / steps) / want_decode, rel=0.05)
    assert s["model"] == "fake/K2-mini" and s["server_version"] == "0.5.test"
    assert s["tree_budget"] == 64
    assert s["server_avg_spec_accept_length_after"] == pytest.approx(M / steps)
    assert abs(s["accept_length_vs_server_rel"]) < 1e-9


def test_concurrency_is_bounded_and_throughput_counts_tokens():
    with FakeSGLang(ttft_s=0.02, step_s=0.01, accept=4) as srv:
        df, s, _ = probe(srv.url, requests=6, concurrency=3, max_new_tokens=17)
        assert srv.requests == 6
    assert df.ok.all() and s["output_tokens"] == 6 * 17
    assert s["output_throughput_tok_s"] == pytest.approx(s["output_tokens"] / s["wall_s"])


@pytest.mark.parametrize("fault", ["split_lines", "no_done", "keepalive"])
def test_wire_format_quirks_parse(fault):
    with FakeSGLang(ttft_s=0.01, step_s=0.005, fault=fault) as srv:
        df, s, _ = probe(srv.url, requests=2, max_new_tokens=10)
    assert df.ok.all(), df.error.tolist()
    assert (df.completion_tokens == 10).all()


@pytest.mark.parametrize("fault,needle", [("drop", "connection dropped"), ("http500", "HTTP 500"),
                                          ("malformed", "JSONDecodeError"), ("stream_error", "out of memory"),
                                          ("slow_first_byte", "Timeout")])
def test_faults_become_rows_and_abort_after_consecutive_failures(fault, needle):
    with FakeSGLang(ttft_s=0.01, step_s=0.005, fault=fault) as srv:
        df, s, msg = probe(srv.url, requests=10, max_new_tokens=12, timeout_s=1.0,
                           max_consecutive_failures=3)
        sent = srv.requests
    assert len(df) == 3 and sent == 3          # stopped launching after 3 straight failures
    assert not df.ok.any()
    assert df.error.str.contains(needle).all(), df.error.tolist()
    assert "aborted after 3 consecutive failures" in msg


def test_some_failures_keep_the_rest():
    with FakeSGLang(ttft_s=0.01, step_s=0.005, fault="http500", fault_every=2) as srv:
        df, s, _ = probe(srv.url, requests=6, max_new_tokens=8)
    assert len(df) == 6 and df.ok.sum() == 3
    assert s["ok_requests"] == 3


def test_429_backs_off_then_succeeds():
    with FakeSGLang(ttft_s=0.01, step_s=0.005, fault="http429", http429_times=1) as srv:
        df, _, _ = probe(srv.url, requests=2, max_new_tokens=8, backoff_s=0.01)
    assert df.ok.all() and (df.retries == 1).all()


def test_non_sglang_and_unreachable_are_clear_errors():
    with FakeSGLang(fault="non_sglang") as srv:
        with pytest.raises(ProbeError, match="not an SGLang server"):
            probe(srv.url)
        assert srv.requests == 0          # no load sent
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]         # closed port: nothing listens there
    with pytest.raises(ProbeError, match="cannot reach"):
        probe(f"http://127.0.0.1:{port}")


def test_parquet_rows_carry_identity_and_provenance(tmp_path):
    with FakeSGLang(ttft_s=0.01, step_s=0.005) as srv:
        msg = probe_to_parquet(ProbeConfig(url=srv.url, requests=3, max_new_tokens=7), tmp_path / "p.parquet")
    rows = pd.read_parquet(tmp_path / "p.parquet")
    summ = pd.read_parquet(tmp_path / "p_summary.parquet")
    assert len(rows) == 3 and "3/3 requests ok" in msg
    for col in ("run_id", "utc_time", "git_commit", "host", "server_url", "model", "server_version",
                "spec_settings", "prompt_set_hash", "probe_config", "ttft_s", "accept_length"):
        assert col in rows.columns, col
    assert summ.verify_step_ms.notna().all()


def test_cli_records_an_unreachable_service(tmp_path):
    from kdtree.cli import main
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "p.parquet"
    with pytest.raises(SystemExit) as e:
        main(["probe", "--url", f"http://127.0.0.1:{port}", "--out", str(out), "--record-failure"])
    assert e.value.code == 0
    row = pd.read_parquet(out).iloc[0]
    assert not row.ok and "cannot reach" in row.error


def test_config_bounds_are_checked():
    with pytest.raises(ValueError, match="concurrency: expected <= 64"):
        ProbeConfig(url="http://x", concurrency=500).check()
    with pytest.raises(ValueError, match="url: expected http"):
        ProbeConfig(url="ftp://x").check()


def test_sse_parser_handles_split_and_crlf():
    p = SSELines()
    events = list(p.feed('data: {"a":')) + list(p.feed(' 1}\r\n\r\n: ping\n\ndata: [DO'))
    events += list(p.feed("NE]\n")) + list(p.close())
    assert events == [("data", '{"a": 1}'), ("done", None)]


def test_prompt_files(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text('{"text": "hello"}\nplain line\n\n')
    assert load_prompts(str(f)) == ["hello", "plain line"]
    assert len(load_prompts(None)) >= 6
