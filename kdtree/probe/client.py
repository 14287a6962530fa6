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
import pathlib
import statistics
import time
from dataclasses import asdict, dataclass, field

import pandas as pd

from ..harness.provenance import new_run_id, provenance
from ..harness.results import write_parquet_atomic
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
        for name in ("requests", "concurrency", "max_new_tokens", "max_consecutive_failures"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {getattr(self, name)}")
        if self.concurrency > 64:
            raise ValueError(f"concurrency: expected <= 64 for a probe of a production service, "
                             f"got {self.concurrency}")
        for name in ("timeout_s", "max_wall_s"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(f"{name}: expected a positive number of seconds")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url: expected http(s)://host:port, got {self.url!r}")


def load_prompts(path: str | None) -> list[str]:
    """Built-in prompts, or a user file: JSON lines with a "text" key, or one prompt per line."""
    if not path:
        return list(BUILTIN_PROMPTS)
    lines = [ln for ln in pathlib.Path(path).read_text().splitlines() if ln.strip()]
    out = []
    for ln in lines:
        if ln.lstrip().startswith("{"):
            obj = json.loads(ln)
            if "text" not in obj:
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


async def _get_json(client, url: str, timeout: float):
    r = await client.get(url, timeout=timeout)
    if r.status_code != 200:
        return None, r.status_code
    try:
        return r.json(), 200
    except ValueError:
        return None, r.status_code


async def server_identity(client, cfg: ProbeConfig) -> dict:
    """/health, then /server_info (or /get_server_info), /v1/models and /metrics when present."""
    import httpx

    base = cfg.url.rstrip("/")
    try:
        h = await client.get(base + "/health", timeout=min(cfg.timeout_s, 10))
    except httpx.HTTPError as e:
        raise ProbeError(f"cannot reach {base}: {type(e).__name__}: {e}") from e
    if h.status_code != 200:
        raise ProbeError(f"{base}/health answered HTTP {h.status_code}: the service is not healthy "
                         "(or this is not an SGLang server); no load was sent")
    info, _ = await _get_json(client, base + "/server_info", 10)
    if info is None:
        info, _ = await _get_json(client, base + "/get_server_info", 10)
    if info is None:
        raise ProbeError(f"{base} has no /server_info or /get_server_info: not an SGLang server?")
    models, _ = await _get_json(client, base + "/v1/models", 10)
    model = ""
    if isinstance(models, dict) and models.get("data"):
        model = str(models["data"][0].get("id", ""))
    model = model or str(info.get("model_path") or info.get("served_model_name") or "")
    metrics = ""
    try:
        m = await client.get(base + "/metrics", timeout=10)
        metrics = m.text if m.status_code == 200 else ""
    except httpx.HTTPError:
        pass
    internal = info.get("internal_states") or [{}]
    avg_accept = internal[0].get("avg_spec_accept_length") if isinstance(internal, list) and internal else None
    spec = {k: info.get(k) for k in ("speculative_algorithm", "speculative_num_steps",
                                      "speculative_eagle_topk", "speculative_num_draft_tokens")}
    return {"server_url": base, "model": model, "server_version": str(info.get("version", "")),
            "spec_settings": json.dumps(spec, sort_keys=True), "tree_budget": spec.get("speculative_num_draft_tokens"),
            "avg_spec_accept_length": avg_accept, "has_metrics": bool(metrics)}


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
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
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


async def run_probe(cfg: ProbeConfig) -> tuple[pd.DataFrame, dict, str]:
    """Returns (per-request rows, run summary, message)."""
    import httpx

    cfg.check()
    prompts = cfg.prompts or load_prompts(cfg.prompts_file)
    limits = httpx.Limits(max_connections=cfg.concurrency + 2)
    async with httpx.AsyncClient(limits=limits) as client:
        ident = await server_identity(client, cfg)
        rows: list[dict] = []
        consecutive = 0
        stop_reason = ""
        next_idx = 0
        t_start = time.perf_counter()
        lock = asyncio.Lock()

        async def worker():
            nonlocal consecutive, stop_reason, next_idx
            while True:
                async with lock:
                    if stop_reason or next_idx >= cfg.requests:
                        return
                    if time.perf_counter() - t_start > cfg.max_wall_s:
                        stop_reason = f"wall-time bound of {cfg.max_wall_s}s reached"
                        return
                    idx = next_idx
                    next_idx += 1
                row = await one_request(client, cfg, prompts[idx % len(prompts)], idx)
                async with lock:
                    rows.append(row)
                    consecutive = 0 if row["ok"] else consecutive + 1
                    if consecutive >= cfg.max_consecutive_failures and not stop_reason:
                        stop_reason = (f"aborted after {consecutive} consecutive failures "
                                       f"(last: {row['error']})")

        await asyncio.gather(*[worker() for _ in range(cfg.concurrency)])
        wall = time.perf_counter() - t_start
        after, _ = await _get_json(client, cfg.url.rstrip("/") + "/server_info", 10)
    df = pd.DataFrame(rows).sort_values("request_index").reset_index(drop=True)
    summary = summarize(df, wall, cfg, ident)
    # Cross-check: the server's own running average (over all its traffic, not only ours).
    server_after = None
    if isinstance(after, dict):
        st = after.get("internal_states") or [{}]
        server_after = st[0].get("avg_spec_accept_length") if st else None
    summary["server_avg_spec_accept_length_after"] = server_after
    summary["accept_length_vs_server_rel"] = (
        (summary["accept_length"] - server_after) / server_after
        if summary.get("accept_length") and server_after else None)
    msg = (f"probe: {int(df.ok.sum())}/{len(df)} requests ok in {wall:.1f}s"
           + (f"; {stop_reason}" if stop_reason else ""))
    summary["stop_reason"] = stop_reason
    return df, summary, msg


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


def probe_to_parquet(cfg: ProbeConfig, out, summary_out=None) -> str:
    df, summary, msg = asyncio.run(run_probe(cfg))
    prompts = cfg.prompts or load_prompts(cfg.prompts_file)
    prompt_hash = hashlib.sha256("\n\x00".join(prompts).encode()).hexdigest()[:12]
    probe_cfg = {k: v for k, v in asdict(cfg).items() if k != "prompts"}
    prov = provenance(new_run_id(), probe_cfg)
    ident_cols = {k: summary[k] for k in ("server_url", "model", "server_version", "spec_settings")}
    extra = dict(prov, **ident_cols, prompt_set_hash=prompt_hash, probe_config=json.dumps(probe_cfg))
    rows = df.drop(columns=["_itl"], errors="ignore").assign(**extra)
    write_parquet_atomic(rows, out)
    summary_out = summary_out or pathlib.Path(out).with_name(pathlib.Path(out).stem + "_summary.parquet")
    write_parquet_atomic(pd.DataFrame([dict(summary, **extra)]), summary_out)
    return msg


def main(args) -> int:
    cfg = ProbeConfig(url=args.url, requests=args.requests, concurrency=args.concurrency,
                      max_new_tokens=args.max_new_tokens, timeout_s=args.timeout,
                      max_wall_s=args.max_wall, max_consecutive_failures=args.max_consecutive_failures,
                      temperature=args.temperature, prompts_file=args.prompts)
    try:
        cfg.check()
        print(probe_to_parquet(cfg, args.out))
    except (ProbeError, ValueError) as e:
        print(f"probe: {e}")
        # Nothing lost: the failure itself is a row, so a pipeline run shows why it has no data.
        prov = provenance(new_run_id(), {"url": args.url})
        row = dict(prov, request_index=-1, ok=False, error=str(e), server_url=args.url)
        write_parquet_atomic(pd.DataFrame([row]), args.out)
        summary = pathlib.Path(args.out).with_name(pathlib.Path(args.out).stem + "_summary.parquet")
        write_parquet_atomic(pd.DataFrame([dict(row, stop_reason=str(e), verify_step_ms=None)]), summary)
        return 0 if args.record_failure else 2
    return 0
