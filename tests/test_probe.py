"""The probe against a real HTTP server on loopback speaking SGLang's wire format."""
import asyncio
import logging
import math
import os
import pathlib
import signal
import socket
import stat
import subprocess
import sys
import time

import pandas as pd
import pytest

from kdtree.probe.client import (ProbeConfig, ProbeError, SSELines, load_prompts, probe_to_parquet, run_probe,
                                  run_until_interrupted)
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
    assert s["attention_backends"] == '{"attention_backend": "triton"}' and s["tp_size"] == 8
    assert s["server_avg_spec_accept_length_after"] == pytest.approx(M / steps)
    assert abs(s["accept_length_vs_server_rel"]) < 1e-9


def test_concurrency_is_bounded_and_throughput_counts_tokens():
    with FakeSGLang(ttft_s=0.02, step_s=0.01, accept=4) as srv:
        df, s, _ = probe(srv.url, requests=8, concurrency=3, max_new_tokens=17)
        assert srv.requests == 8
        assert srv.max_in_flight == 3          # never more than asked, and it did run 3 at once
    assert df.ok.all() and s["output_tokens"] == 8 * 17
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
        res = probe_to_parquet(ProbeConfig(url=srv.url, requests=3, max_new_tokens=7), tmp_path / "p.parquet")
    rows = pd.read_parquet(tmp_path / "p.parquet")
    summ = pd.read_parquet(tmp_path / "p_summary.parquet")
    assert len(rows) == 3 and "3/3 requests ok" in res.message and res.ok_requests == 3
    assert rows.run_id.iloc[0] == summ.run_id.iloc[0]          # one run, both files
    for f in ("p.parquet", "p_summary.parquet"):
        assert stat.S_IMODE((tmp_path / f).stat().st_mode) == 0o644, f   # as the committed results
    assert not [f.name for f in tmp_path.iterdir() if f.name.startswith(".")]  # no staging left
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
    with pytest.raises(ValueError, match="concurrency: expected an integer >= 1 and <= 64"):
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


def cli(*argv):
    """The probe command's exit code."""
    from kdtree.cli import main
    with pytest.raises(SystemExit) as e:
        main(["probe", *map(str, argv)])
    return e.value.code


def test_server_dying_mid_run_keeps_every_measured_row(tmp_path, capsys):
    out = tmp_path / "p.parquet"
    with FakeSGLang(ttft_s=0.01, step_s=0.005, fault="die", die_after=3) as srv:
        code = cli("--url", srv.url, "--out", out, "--requests", 10, "--max-new-tokens", 8, "--timeout", 2)
    rows, summ = pd.read_parquet(out), pd.read_parquet(tmp_path / "p_summary.parquet")
    assert code == 0 and "Traceback" not in capsys.readouterr().err
    assert rows.ok.sum() == 3 and (~rows.ok).sum() == 3        # 3 measured, then 3 failures and stop
    assert rows[~rows.ok].error.str.contains("ConnectError|ReadError").all()
    assert "aborted after 3 consecutive failures" in summ.stop_reason.iloc[0]
    assert summ.server_avg_spec_accept_length_after.isna().all()   # the closing call failed quietly


def test_hang_after_health_is_bounded_by_the_timeout(tmp_path, capsys):
    out = tmp_path / "p.parquet"
    with FakeSGLang(fault="hang_info") as srv:
        t0 = time.perf_counter()
        code = cli("--url", srv.url, "--out", out, "--timeout", 1)
        took = time.perf_counter() - t0
        assert srv.requests == 0                                   # no load sent
    assert code == 2 and took < 5
    msg = capsys.readouterr().out
    assert "/server_info: ReadTimeout: no answer within 1 s" in msg
    assert pd.read_parquet(out).error.str.contains("no answer within").all()   # the failure is a row


def test_a_reply_landing_after_the_run_is_cancelled_is_not_a_traceback(caplog):
    """Ctrl-C cancels the run; a reply that then reaches a cancelled reader raises
    InvalidStateError in the transport's callback (an httpx / anyio race seen in CI). That one
    error is dropped while the run stops; before it, and any other error, asyncio reports."""
    late = {"message": "Fatal error: protocol.data_received() call failed.",
            "exception": asyncio.InvalidStateError("invalid state")}
    other = {"message": "Exception in callback", "exception": ValueError("a real fault")}

    async def run():
        loop = asyncio.get_running_loop()
        loop.call_exception_handler(late)   # the run is not stopping: reported
        asyncio.current_task().cancel()     # what the runner does on Ctrl-C
        loop.call_exception_handler(late)   # stopping: dropped
        loop.call_exception_handler(other)  # stopping, another error: reported
        await asyncio.sleep(0)

    with caplog.at_level(logging.ERROR, logger="asyncio"), pytest.raises(asyncio.CancelledError):
        run_until_interrupted(run())
    messages = [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    assert sum("data_received" in m for m in messages) == 1, messages
    assert sum("Exception in callback" in m for m in messages) == 1, messages


def test_sigint_keeps_the_finished_requests(tmp_path):
    out = tmp_path / "p.parquet"
    with FakeSGLang(ttft_s=0.01, step_s=0.02, accept=2) as srv:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # SIGINT at its default in the child, so Python raises KeyboardInterrupt for it even
        # where these tests run as a background job (a shell starts those with SIGINT ignored).
        proc = subprocess.Popen([sys.executable, "-m", "kdtree", "probe", "--url", srv.url, "--out", str(out),
                                 "--requests", "200", "--max-new-tokens", "8"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.time() + 60
        while srv.httpd.finished < 3 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        # The server counts a request finished when it has sent the last byte; give the
        # client time to read those answers (a request here takes ~0.2 s) before Ctrl-C.
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, (stdout, stderr)
    assert "Traceback" not in stderr and "interrupted" in stdout
    rows = pd.read_parquet(out)
    assert rows.ok.sum() >= 3 and len(rows) < 200
    assert pd.read_parquet(tmp_path / "p_summary.parquet").stop_reason.iloc[0] == "interrupted (Ctrl-C)"


def _unwritable(tmp_path, case):
    f = tmp_path / "a_file"
    f.write_text("x")
    (tmp_path / "a_dir").mkdir()
    return {"missing_parent": tmp_path / "nope" / "p.parquet", "under_a_file": f / "p.parquet",
            "is_a_dir": tmp_path / "a_dir", "proc": pathlib.Path("/proc/self/p.parquet")}[case]


@pytest.mark.parametrize("case,needle", [("missing_parent", "does not exist"), ("under_a_file", "is not a folder"),
                                         ("is_a_dir", "is a folder"), ("proc", "cannot write")])
def test_unwritable_output_refused_before_any_request(tmp_path, capsys, case, needle):
    out = _unwritable(tmp_path, case)
    with FakeSGLang() as srv:
        code = cli("--url", srv.url, "--out", out, "--record-failure")
        assert srv.log == []                                       # not even /health
    assert code == 2 and needle in capsys.readouterr().out


def test_a_server_that_never_answers_well_fails_after_the_limit(tmp_path, capsys):
    out = tmp_path / "p.parquet"
    with FakeSGLang(ttft_s=0.01, step_s=0.005, fault="malformed") as srv:
        code = cli("--url", srv.url, "--out", out, "--requests", 20, "--concurrency", 4,
                   "--max-consecutive-failures", 3)
        assert srv.requests == 3                                   # the limit bounds what is sent
    assert code == 1 and "no request succeeded" in capsys.readouterr().out
    assert len(pd.read_parquet(out)) == 3


@pytest.mark.parametrize("argv,needle", [
    (["--requests", 0], "requests: expected an integer >= 1"),
    (["--requests", 1_000_000_000], "requests: expected an integer >= 1 and <= 10000"),
    (["--max-new-tokens", 1_000_000_000], "max_new_tokens"),
    (["--max-wall", "inf"], "max_wall_s: expected a number > 0"),
    (["--timeout", "nan"], "timeout_s"),
    (["--url", "http://127.0.0.1:99999"], "with a port in 1-65535"),
    (["--url", "localhost:3000"], "url: expected http(s)://host:port"),
    (["--prompts", "/nonexistent/prompts.txt"], "prompts: cannot read /nonexistent/prompts.txt"),
])
def test_bad_settings_exit_2_even_with_record_failure(tmp_path, capsys, argv, needle):
    argv = (["--url", "http://127.0.0.1:1"] if "--url" not in argv else []) + argv
    code = cli(*argv, "--out", tmp_path / "p.parquet", "--record-failure")
    captured = capsys.readouterr()
    assert code == 2 and needle in captured.out, captured.out
    assert "Traceback" not in captured.err and not (tmp_path / "p.parquet").exists()


def test_a_hung_request_names_its_timeout():
    with FakeSGLang(ttft_s=0.01, fault="slow_first_byte") as srv:
        df, _, _ = probe(srv.url, requests=1, timeout_s=0.5, max_consecutive_failures=1)
    assert df.error.iloc[0] == "ReadTimeout: no answer within 0.5 s"


def test_measured_requests_do_not_reuse_the_setup_connections():
    with FakeSGLang(ttft_s=0.01, step_s=0.005) as srv:
        probe(srv.url, requests=2, max_new_tokens=4)
        log = srv.log
    setup = {port for path, port in log if path != "/generate"}
    measured = [port for path, port in log if path == "/generate"]
    assert len(setup) >= 1 and len(measured) == 2
    # the set-up GETs shared a kept-alive connection (reuse was possible), yet no /generate rode on it
    assert len([1 for path, _ in log if path != "/generate"]) > len(setup)
    assert not setup & set(measured)
