"""Live-service baseline probe for SGLang (shared/spec/probe.md).

A client only, safe by construction: read-only endpoints and ``POST /generate``;
bounded concurrency, request count, wall time, per-request timeout and
max_new_tokens; back-off on 429/503; abort after N consecutive failures keeping
every row measured so far. A failed request is a row with its error.

Metrics follow sglang's own serving benchmark: TTFT = first chunk with output -
send time; ITL from completion-token deltas between chunks; TPOT = (e2e - TTFT) /
(output_len - 1); decode tok/s = (output_len - 1) / (e2e - TTFT); accept length =
sum(completion_tokens) / sum(spec_verify_ct) over the run (token-weighted).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import math
import pathlib
import statistics
import time
import urllib.parse
from dataclasses import asdict, dataclass, field, replace

import pandas as pd

from ..harness.provenance import new_run_id, provenance
from ..harness.results import check_output, write_parquets_atomic
from . import add_arguments  # noqa: F401  (the CLI's arguments live beside the package's doc)

BUILTIN_PROMPTS = [  # varied lengths: code, math, chat
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "Implement a thread-safe LRU cache in C++ with get and put in O(1). Explain the design briefly.",
    "What is 17 * 23? Show the steps.",
    "Solve for x: 3x + 7 = 25. Then check the answer by substitution.",
    "Prove that the sum of the first n odd numbers is n^2.",
    "Hi! Can you suggest three names for a small bakery?",
    "Summarize the plot of a heist movie in two sentences, then list its main characters.",
    ("You are reviewing a pull request. The change replaces a Python heap-based tree builder "
     "with a CUDA kernel. List the questions you would ask about correctness, tie handling, "
     "testing, and how the speedup should be measured against the whole decode step."),
]


class ProbeError(RuntimeError):
    """The endpoint is unreachable or is not an SGLang server: the message says which."""


@dataclass
class ProbeConfig:
    url: str
    requests: int = 8
    concurrency: int = 1
    max_new_tokens: int = 128
    timeout_s: float = 60.0
    max_wall_s: float = 300.0
    max_consecutive_failures: int = 3
    max_retries: int = 2
    backoff_s: float = 1.0
    temperature: float = 0.0
    prompts_file: str | None = None
    prompts: list = field(default_factory=list)

    def check(self):
        for name, (lo, hi) in LIMITS.items():
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if name in INT_LIMITS:
                ok = ok and float(v).is_integer()
            if not ok or not (lo < v <= hi if name in OPEN_BELOW else lo <= v <= hi):
                low = f"> {lo}" if name in OPEN_BELOW else f">= {lo}"
                kind = "an integer" if name in INT_LIMITS else "a number"
                raise ValueError(f"{name}: expected {kind} {low} and <= {hi} (a probe of a production "
                                 f"service is bounded), got {v!r}")
        check_url(self.url)


# Bounds of a probe run (spec probe.md: everything bounded). Seconds for the *_s keys.
LIMITS = {"requests": (1, 10_000), "concurrency": (1, 64), "max_new_tokens": (1, 32_768),
          "max_consecutive_failures": (1, 1_000), "max_retries": (0, 10), "timeout_s": (0, 3_600),
          "max_wall_s": (0, 86_400), "backoff_s": (0, 60), "temperature": (0, 100)}
INT_LIMITS = {"requests", "concurrency", "max_new_tokens", "max_consecutive_failures", "max_retries"}
OPEN_BELOW = {"timeout_s", "max_wall_s"}


def check_url(url: str) -> None:
    """http(s)://host[:port] with a port in 1..65535, or ValueError naming what is wrong."""
    try:
        u = urllib.parse.urlsplit(url)
        port = u.port
    except ValueError as e:
        raise ValueError(f"url: expected http(s)://host:port with a port in 1-65535, got {url!r} ({e})") from None
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"url: expected http(s)://host:port, got {url!r}")
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"url: port {port} out of range 1-65535 in {url!r}")


def load_prompts(path: str | None) -> list[str]:
    """Built-in prompts, or a user file: JSON lines with a "text" key, or one prompt per line."""
    if not path:
        return list(BUILTIN_PROMPTS)
    try:
        lines = [ln for ln in pathlib.Path(path).read_text().splitlines() if ln.strip()]
    except OSError as e:
        raise ValueError(f"prompts: cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"prompts: {path} is not UTF-8 text") from None
    out = []
    for ln in lines:
        if ln.lstrip().startswith("{"):
            try:
                obj = json.loads(ln)
            except json.JSONDecodeError as e:
                raise ValueError(f"prompts file {path}: a line starting with '{{' is not JSON ({e}): {ln[:80]}") from None
            if not isinstance(obj, dict) or "text" not in obj:
                raise ValueError(f"prompts file {path}: JSON line without a 'text' key: {ln[:80]}")
            out.append(str(obj["text"]))
        else:
            out.append(ln)
    if not out:
        raise ValueError(f"prompts file {path}: no prompts")
    return out


class StreamCut(RuntimeError):
    """The body ended mid-event or before the final chunk."""


class SSELines:
    """Incremental SSE parser: split lines across chunks, keep-alives, CRLF, missing [DONE]."""

    def __init__(self):
        self.buf = ""

    def feed(self, text: str):
        self.buf += text
        *lines, self.buf = self.buf.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        for ln in lines:
            yield from self._event(ln)

    def close(self):
        rest, self.buf = self.buf, ""
        yield from self._event(rest)

    @staticmethod
    def _event(line: str):
        line = line.strip()
        if not line or line.startswith(":"):      # blank separator or keep-alive comment
            return
        if line.startswith("data:"):
            payload = line[5:].strip()
            if payload == "[DONE]":
                yield "done", None
            else:
                yield "data", payload


def _percentiles(values, prefix: str) -> dict:
    v = sorted(x for x in values if x is not None)
    if not v:
        return {f"{prefix}_{k}": None for k in ("mean", "median", "p90", "p99")}
    q = lambda p: v[min(len(v) - 1, int(round(p * (len(v) - 1))))]
    return {f"{prefix}_mean": statistics.fmean(v), f"{prefix}_median": statistics.median(v),
            f"{prefix}_p90": q(0.90), f"{prefix}_p99": q(0.99)}


def describe(e: BaseException, timeout: float | None = None) -> str:
    """An exception as "Type: reason", with a reason even where the library gives none
    (httpx's timeouts carry an empty message)."""
    import httpx

    why = str(e).strip()
    if not why:
        if isinstance(e, httpx.TimeoutException):
            why = f"no answer within {timeout:g} s" if timeout else "timed out"
        elif isinstance(e, httpx.HTTPError):
            why = "the connection failed"
        else:
            why = "no detail"
    return f"{type(e).__name__}: {why[:200]}"


def setup_timeout(cfg: "ProbeConfig") -> float:
    """Identity calls (health, server info, models, metrics) wait at most this long each."""
    return min(cfg.timeout_s, 10.0)


async def _get_json(client, url: str, timeout: float):
    """(json or None, HTTP status or an error string). Never raises for HTTP trouble."""
    import httpx

    try:
        r = await client.get(url, timeout=httpx.Timeout(timeout))
    except httpx.HTTPError as e:
        return None, describe(e, timeout)
    if r.status_code != 200:
        return None, r.status_code
    try:
        return r.json(), 200
    except ValueError:
        return None, r.status_code


# /server_info's server arguments naming the attention backends (one for all, or prefill's and
# decode's apart).
ATTENTION_KEYS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")


async def server_identity(client, cfg: ProbeConfig) -> dict:
    """/health, then /server_info (or /get_server_info), /v1/models and /metrics when present.
    Every call waits at most setup_timeout(cfg)."""
    import httpx

    base = cfg.url.rstrip("/")
    t = setup_timeout(cfg)
    try:
        h = await client.get(base + "/health", timeout=httpx.Timeout(t))
    except httpx.HTTPError as e:
        raise ProbeError(f"cannot reach {base}: {describe(e, t)}") from e
    if h.status_code != 200:
        raise ProbeError(f"{base}/health answered HTTP {h.status_code}: the service is not healthy "
                         "(or this is not an SGLang server); no load was sent")
    info, status = await _get_json(client, base + "/server_info", t)
    if info is None and isinstance(status, str):   # it hung or dropped: the older name would too
        raise ProbeError(f"{base}/server_info: {status}; no load was sent")
    if info is None:
        info, status = await _get_json(client, base + "/get_server_info", t)
    if not isinstance(info, dict):
        raise ProbeError(f"{base} has no /server_info or /get_server_info ({status}): not an SGLang server?")
    models, _ = await _get_json(client, base + "/v1/models", t)
    model = ""
    if isinstance(models, dict) and isinstance(models.get("data"), list) and models["data"]:
        first = models["data"][0]
        model = str(first.get("id", "")) if isinstance(first, dict) else ""
    model = model or str(info.get("model_path") or info.get("served_model_name") or "")
    metrics = ""
    try:
        m = await client.get(base + "/metrics", timeout=httpx.Timeout(t))
        metrics = m.text if m.status_code == 200 else ""
    except httpx.HTTPError:
        pass
    spec = {k: info.get(k) for k in ("speculative_algorithm", "speculative_num_steps",
                                      "speculative_eagle_topk", "speculative_num_draft_tokens")}
    # Which attention kernels verify (the whole-step breakdown's KDTREE_SGLANG_ATTENTION bar).
    backends = {k: info[k] for k in ATTENTION_KEYS if isinstance(info.get(k), str) and info[k]}
    tp = info.get("tp_size")
    return {"server_url": base, "model": model, "server_version": str(info.get("version", "")),
            "spec_settings": json.dumps(spec, sort_keys=True), "tree_budget": spec.get("speculative_num_draft_tokens"),
            "avg_spec_accept_length": server_accept_length(info), "has_metrics": bool(metrics),
            "attention_backends": json.dumps(backends, sort_keys=True),
            "tp_size": tp if isinstance(tp, int) and not isinstance(tp, bool) and tp > 0 else None}


def server_accept_length(info) -> float | None:
    """/server_info's running average accept length, where the server reports one."""
    if not isinstance(info, dict):
        return None
    st = info.get("internal_states")
    if isinstance(st, list) and st and isinstance(st[0], dict):
        return st[0].get("avg_spec_accept_length")
    return None


async def one_request(client, cfg: ProbeConfig, prompt: str, idx: int) -> dict:
    """Stream one /generate; returns a row whatever happens."""
    import httpx

    body = {"text": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature}}
    row = {"request_index": idx, "ok": False, "error": "", "http_status": None, "retries": 0,
           "prompt_tokens": None, "completion_tokens": None, "cached_tokens": None, "finish_reason": None,
           "ttft_s": None, "e2e_s": None, "tpot_s": None, "itl_mean_s": None, "decode_tok_s": None,
           "spec_verify_ct": None, "accept_length": None, "server_e2e_latency_s": None, "chunks": 0}
    for attempt in range(cfg.max_retries + 1):
        row["retries"] = attempt
        t0 = time.perf_counter()
        first = None
        last_t, last_c = None, 0
        itl: list[float] = []
        meta: dict = {}
        parser = SSELines()
        try:
            async with client.stream("POST", cfg.url.rstrip("/") + "/generate", json=body,
                                     timeout=httpx.Timeout(cfg.timeout_s)) as r:
                row["http_status"] = r.status_code
                if r.status_code in (429, 503) and attempt < cfg.max_retries:
                    await r.aread()
                    ra = r.headers.get("retry-after")
                    delay = float(ra) if ra and ra.replace(".", "", 1).isdigit() else cfg.backoff_s * 2 ** attempt
                    await asyncio.sleep(min(delay, 30.0))
                    continue
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")[:200]
                    row["error"] = f"HTTP {r.status_code}: {text}"
                    return row
                done = False

                def handle(kind, payload):
                    nonlocal first, last_t, last_c, meta, done
                    if kind == "done":
                        done = True
                        return
                    obj = json.loads(payload)   # a malformed line raises: recorded as the error
                    if "error" in obj and "meta_info" not in obj:
                        raise RuntimeError(f"server error in stream: {str(obj['error'])[:200]}")
                    now = time.perf_counter()
                    meta = obj.get("meta_info", meta) or meta
                    c = int(meta.get("completion_tokens", 0) or 0)
                    row["chunks"] += 1
                    if first is None and (obj.get("text") or c > 0):
                        first = now
                    elif first is not None and c > last_c and last_t is not None:
                        itl.extend([(now - last_t) / (c - last_c)] * (c - last_c))
                    if c > last_c or last_t is None:
                        last_t, last_c = now, c

                async for chunk in r.aiter_text():
                    for kind, payload in parser.feed(chunk):
                        handle(kind, payload)
                if parser.buf.strip():
                    raise StreamCut(f"stream cut inside an event (connection dropped?): "
                                    f"{parser.buf.strip()[:60]!r}")
                if not done and not (meta or {}).get("finish_reason"):
                    raise StreamCut("stream ended before its final chunk (connection dropped?)")
            t_end = time.perf_counter()
        except (httpx.HTTPError, json.JSONDecodeError, RuntimeError) as e:  # StreamCut included
            row["error"] = describe(e, cfg.timeout_s)
            row["e2e_s"] = time.perf_counter() - t0
            return row
        if not meta:
            row["error"] = "stream ended without any data chunk"
            return row
        n_out = int(meta.get("completion_tokens", 0) or 0)
        row.update(prompt_tokens=meta.get("prompt_tokens"), completion_tokens=n_out,
                   cached_tokens=meta.get("cached_tokens"),
                   finish_reason=json.dumps(meta.get("finish_reason")),
                   spec_verify_ct=meta.get("spec_verify_ct"),
                   server_e2e_latency_s=meta.get("e2e_latency"), e2e_s=t_end - t0)
        if first is not None:
            row["ttft_s"] = first - t0
            if n_out > 1 and t_end > first:
                row["tpot_s"] = (t_end - first) / (n_out - 1)
                row["decode_tok_s"] = (n_out - 1) / (t_end - first)
        if itl:
            row["itl_mean_s"] = statistics.fmean(itl)
        row["_itl"] = itl
        if row["spec_verify_ct"]:
            row["accept_length"] = n_out / float(row["spec_verify_ct"])
        row["ok"] = True
        return row
    return row


@dataclass
class ProbeRun:
    """What a run has measured so far: kept when the run ends early (Ctrl-C included)."""
    rows: list = field(default_factory=list)
    ident: dict = field(default_factory=dict)
    stop_reason: str = ""
    wall_s: float = 0.0
    t_start: float | None = None
    server_after: dict | None = None


async def run_probe(cfg: ProbeConfig, state: ProbeRun | None = None) -> tuple[pd.DataFrame, dict, str]:
    """Returns (per-request rows, run summary, message). `state` collects the rows as they
    finish, so a caller still has them when the run is interrupted.

    Load is added only once the service has answered: the first request goes alone, and
    after a failure requests go one at a time until one succeeds. A failing service thus
    sees at most max_consecutive_failures requests, whatever the concurrency."""
    import httpx

    cfg.check()
    prompts = cfg.prompts or load_prompts(cfg.prompts_file)
    st = state if state is not None else ProbeRun()
    # Identity calls on their own connections: the measured requests never reuse them.
    async with httpx.AsyncClient() as setup:
        st.ident = await server_identity(setup, cfg)
    limits = httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency)
    t_start = st.t_start = time.perf_counter()
    async with httpx.AsyncClient(limits=limits) as client:
        consecutive, in_flight, next_idx, proven = 0, 0, 0, False
        cond = asyncio.Condition()

        async def worker():
            nonlocal consecutive, in_flight, next_idx, proven
            while True:
                async with cond:
                    while True:
                        if st.stop_reason or next_idx >= cfg.requests:
                            return
                        if time.perf_counter() - t_start > cfg.max_wall_s:
                            st.stop_reason = f"wall-time bound of {cfg.max_wall_s:g} s reached"
                            return
                        if in_flight == 0 or (proven and consecutive == 0):
                            break
                        await cond.wait()
                    idx, next_idx, in_flight = next_idx, next_idx + 1, in_flight + 1
                try:
                    row = await one_request(client, cfg, prompts[idx % len(prompts)], idx)
                except asyncio.CancelledError:
                    st.rows.append(dict(request_index=idx, ok=False, error="interrupted before it finished"))
                    raise
                async with cond:
                    in_flight -= 1
                    st.rows.append(row)
                    consecutive = 0 if row["ok"] else consecutive + 1
                    proven = proven or row["ok"]
                    if consecutive >= cfg.max_consecutive_failures and not st.stop_reason:
                        st.stop_reason = (f"aborted after {consecutive} consecutive failures "
                                          f"(last: {row['error']})")
                    cond.notify_all()

        await asyncio.gather(*[worker() for _ in range(cfg.concurrency)])
    st.wall_s = time.perf_counter() - t_start
    # The server's own running average afterwards, for the cross-check; a server that died
    # or hangs now costs one bounded call and no rows.
    async with httpx.AsyncClient() as after:
        info, _ = await _get_json(after, cfg.url.rstrip("/") + "/server_info", setup_timeout(cfg))
    st.server_after = info if isinstance(info, dict) else None
    return finish(cfg, st)


def finish(cfg: ProbeConfig, st: ProbeRun) -> tuple[pd.DataFrame, dict, str]:
    """Rows, summary and message from what a run measured, complete or not."""
    if not st.wall_s and st.t_start is not None:
        st.wall_s = time.perf_counter() - st.t_start
    df = pd.DataFrame(st.rows, columns=ROW_COLUMNS if not st.rows else None)
    for c in ROW_COLUMNS:
        if c not in df:
            df[c] = None
    df["ok"] = df["ok"].fillna(False).astype(bool)
    df = df.sort_values("request_index").reset_index(drop=True)
    ident = st.ident or {"server_url": cfg.url.rstrip("/"), "model": "", "server_version": "",
                         "spec_settings": "", "tree_budget": None, "avg_spec_accept_length": None,
                         "has_metrics": False, "attention_backends": "", "tp_size": None}
    summary = summarize(df, st.wall_s, cfg, ident)
    server_after = server_accept_length(st.server_after)
    summary["server_avg_spec_accept_length_after"] = server_after
    summary["accept_length_vs_server_rel"] = (
        (summary["accept_length"] - server_after) / server_after
        if summary.get("accept_length") and server_after else None)
    summary["stop_reason"] = st.stop_reason
    msg = (f"probe: {int(df.ok.sum())}/{len(df)} requests ok in {st.wall_s:.1f}s"
           + (f"; {st.stop_reason}" if st.stop_reason else ""))
    return df, summary, msg


ROW_COLUMNS = ["request_index", "ok", "error", "http_status", "retries", "prompt_tokens", "completion_tokens",
               "cached_tokens", "finish_reason", "ttft_s", "e2e_s", "tpot_s", "itl_mean_s", "decode_tok_s",
               "spec_verify_ct", "accept_length", "server_e2e_latency_s", "chunks"]


def summarize(df: pd.DataFrame, wall: float, cfg: ProbeConfig, ident: dict) -> dict:
    ok = df[df.ok] if len(df) else df
    itl = [x for lst in ok.get("_itl", pd.Series(dtype=object)) for x in (lst or [])]
    out_tokens = int(ok.completion_tokens.sum()) if len(ok) else 0
    verify = ok.spec_verify_ct.dropna().astype(float) if len(ok) else pd.Series(dtype=float)
    accept = out_tokens / verify.sum() if len(verify) and verify.sum() > 0 else None
    dec = ok.decode_tok_s.dropna() if len(ok) else pd.Series(dtype=float)
    decode_median = float(dec.median()) if len(dec) else None
    s = {"requests": len(df), "ok_requests": int(df.ok.sum()) if len(df) else 0, "wall_s": wall,
         "output_tokens": out_tokens, "output_throughput_tok_s": out_tokens / wall if wall > 0 else None,
         "accept_length": accept, "decode_tok_s_median": decode_median,
         # a verify step commits `accept` tokens: step time = accept / (decode tok/s)
         "verify_step_ms": (1e3 * accept / decode_median) if accept and decode_median else None,
         "concurrency": cfg.concurrency, **ident}
    s.update(_percentiles(ok.ttft_s.tolist() if len(ok) else [], "ttft_s"))
    s.update(_percentiles(itl, "itl_s"))
    s.update(_percentiles(ok.tpot_s.tolist() if len(ok) else [], "tpot_s"))
    s.update(_percentiles(ok.e2e_s.tolist() if len(ok) else [], "e2e_s"))
    return s


def summary_path(out) -> pathlib.Path:
    out = pathlib.Path(out)
    return out.with_name(out.stem + "_summary.parquet")


def write_results(cfg: ProbeConfig, df: pd.DataFrame, summary: dict, out, summary_out=None) -> None:
    """The rows and the summary, both staged first, then renamed one after the other; both
    carry the run_id, so a reader can tell a matching pair."""
    try:
        prompts = cfg.prompts or load_prompts(cfg.prompts_file)
    except ValueError:
        prompts = []
    prompt_hash = hashlib.sha256("\n\x00".join(prompts).encode()).hexdigest()[:12]
    probe_cfg = {k: v for k, v in asdict(cfg).items() if k != "prompts"}
    prov = provenance(new_run_id(), probe_cfg)
    ident_cols = {k: summary.get(k) for k in ("server_url", "model", "server_version", "spec_settings")}
    extra = dict(prov, **ident_cols, prompt_set_hash=prompt_hash, probe_config=json.dumps(probe_cfg))
    rows = df.drop(columns=["_itl"], errors="ignore").assign(**extra)
    write_parquets_atomic({pathlib.Path(out): rows,
                           pathlib.Path(summary_out or summary_path(out)): pd.DataFrame([dict(summary, **extra)])})


def run_until_interrupted(coro):
    """asyncio.run for the probe, quiet after Ctrl-C: once the run is being cancelled, a reply
    that lands on a reader already cancelled (InvalidStateError in a transport callback, an
    httpx / anyio race) is dropped instead of printed as a traceback; its request is already
    a row. Every other loop error goes to asyncio's own handler."""
    state = {"task": None, "stopping": False}

    async def main():
        state["task"] = asyncio.current_task()
        return await coro

    def handler(loop, context):
        task = state["task"]
        stopping = state["stopping"] or (task is not None and task.cancelling() > 0)
        if stopping and isinstance(context.get("exception"), asyncio.InvalidStateError):
            return
        loop.default_exception_handler(context)

    with asyncio.Runner() as runner:
        runner.get_loop().set_exception_handler(handler)
        try:
            return runner.run(main())
        except KeyboardInterrupt:
            state["stopping"] = True  # the runner's close still runs the loop
            raise


@dataclass
class ProbeOutcome:
    message: str
    ok_requests: int
    requests: int


def probe_to_parquet(cfg: ProbeConfig, out, summary_out=None) -> ProbeOutcome:
    """Run the probe and write its Parquet; the rows measured before a Ctrl-C are written
    too (and KeyboardInterrupt raised again)."""
    cfg.check()
    check_output(out)
    check_output(summary_out or summary_path(out))
    cfg = replace(cfg, prompts=cfg.prompts or load_prompts(cfg.prompts_file))
    st = ProbeRun()
    try:
        df, summary, msg = run_until_interrupted(run_probe(cfg, st))
    except KeyboardInterrupt:
        st.stop_reason = "interrupted (Ctrl-C)"
        df, summary, msg = finish(cfg, st)
        write_results(cfg, df, summary, out, summary_out)
        raise
    write_results(cfg, df, summary, out, summary_out)
    return ProbeOutcome(msg, int(df.ok.sum()), len(df))


def main(args) -> int:
    """Exit 0: at least one request succeeded (or --record-failure and the service could
    not be probed); 1: the service was reached but no request succeeded; 2: a bad setting
    or output path (nothing sent); 130: interrupted (what was measured is written)."""
    cfg = ProbeConfig(url=args.url, requests=args.requests, concurrency=args.concurrency,
                      max_new_tokens=args.max_new_tokens, timeout_s=args.timeout,
                      max_wall_s=args.max_wall, max_consecutive_failures=args.max_consecutive_failures,
                      temperature=args.temperature, prompts_file=args.prompts)
    try:
        cfg.check()
        cfg.prompts = load_prompts(args.prompts)   # read once: the run and the prompt hash use it
        check_output(args.out)
        check_output(summary_path(args.out))
    except ValueError as e:
        print(f"probe: {e}")
        return 2
    try:
        outcome = probe_to_parquet(cfg, args.out)
    except KeyboardInterrupt:
        print(f"probe: interrupted; the requests that finished are in {args.out}")
        return 130
    except ProbeError as e:
        print(f"probe: {e}")
        # Nothing lost: the failure itself is a row, so a pipeline run shows why it has no data.
        row = dict(request_index=-1, ok=False, error=str(e))
        write_results(cfg, pd.DataFrame([row]), dict(server_url=cfg.url.rstrip("/"), stop_reason=str(e),
                                                     verify_step_ms=None, requests=0, ok_requests=0), args.out)
        return 0 if args.record_failure else 2
    print(outcome.message)
    if outcome.ok_requests == 0:
        print("probe: no request succeeded" + (" (recorded: --record-failure)" if args.record_failure else ""))
        return 0 if args.record_failure else 1
    return 0
