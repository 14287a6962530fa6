"""A real HTTP server on loopback that speaks SGLang's /generate streaming wire format.

Deterministic token timing and speculative meta_info, so tests can check the probe's
figures against what the server was told to produce; plus fault modes.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Behaviour:
    ttft_s: float = 0.08          # time to the first token
    step_s: float = 0.03          # one verify step
    accept: int = 3               # tokens committed per verify step
    fault: str = ""               # "", drop, http500, http429, slow_first_byte, malformed,
                                  # non_sglang, split_lines, no_done, keepalive, stream_error,
                                  # hang_info (/server_info never answers), die (the server
                                  # stops listening after `die_after` generate requests)
    fault_every: int = 1          # apply the fault to every k-th request (1 = all)
    http429_times: int = 1        # 429s before success, per request
    die_after: int = 3            # fault "die": generate requests served before the server dies


class _Handler(BaseHTTPRequestHandler):
    # HTTP/1.1: the GET answers (with a length) keep their connection open, as a real
    # server's do; a streamed /generate body ends by closing its connection.
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):      # keep test output clean
        pass

    @property
    def b(self) -> Behaviour:
        return self.server.behaviour

    def _json(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        with self.server.lock:
            self.server.log.append((self.path, self.client_address[1]))
        if self.path in ("/server_info", "/get_server_info") and self.b.fault == "hang_info":
            time.sleep(30)
            return
        if self.path == "/health":
            return self._json(200, {}) if self.b.fault != "non_sglang" else self._html()
        if self.path in ("/server_info", "/get_server_info") and self.b.fault != "non_sglang":
            with self.server.lock:
                served = self.server.served
            return self._json(200, {"version": "0.5.test", "model_path": "fake/K2-mini",
                                    "speculative_algorithm": "DDTREE", "speculative_num_draft_tokens": 64,
                                    "attention_backend": "triton", "decode_attention_backend": None, "tp_size": 8,
                                    "internal_states": [{"avg_spec_accept_length": served or None}]})
        if self.path == "/v1/models" and self.b.fault != "non_sglang":
            return self._json(200, {"data": [{"id": "fake/K2-mini"}]})
        self._json(404, {"detail": "Not Found"})

    def _html(self):
        body = b"<html><body>hello</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        with self.server.lock:
            self.server.log.append((self.path, self.client_address[1]))
            self.server.in_flight += 1
            self.server.max_in_flight = max(self.server.max_in_flight, self.server.in_flight)
        try:
            self._post()
        finally:
            with self.server.lock:
                self.server.in_flight -= 1
                self.server.finished += 1
                die = self.b.fault == "die" and self.server.finished == self.b.die_after
            if die:  # a server process that exits: nothing listens on the port any more
                threading.Thread(target=self.server.die, daemon=True).start()

    def _post(self):
        length = int(self.headers.get("Content-Length", 0))
        req = json.loads(self.rfile.read(length) or b"{}")
        if self.path != "/generate" or self.b.fault == "non_sglang":
            return self._json(404, {"detail": "Not Found"})
        sp = req.get("sampling_params", {})
        unknown = set(sp) - {"max_new_tokens", "temperature", "ignore_eos", "top_p", "top_k"}
        if unknown:
            return self._json(400, {"error": f"unknown sampling params {sorted(unknown)}"})
        with self.server.lock:
            self.server.requests += 1
            n = self.server.requests
            key = req.get("text", "")
            self.server.attempts[key] = self.server.attempts.get(key, 0) + 1
            attempt = self.server.attempts[key]
        faulty = self.b.fault and (n % self.b.fault_every == 0)
        if faulty and self.b.fault == "http500":
            return self._json(500, {"error": "internal"})
        if self.b.fault == "http429" and attempt <= self.b.http429_times:
            self.send_response(429)
            self.send_header("Retry-After", "0.05")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        M = int(sp.get("max_new_tokens", 16))
        prompt_tokens = max(1, len(key.split()))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        if faulty and self.b.fault == "slow_first_byte":
            time.sleep(5.0)
        t0 = time.perf_counter()
        sent, steps, text = 0, 0, ""

        def chunk(final=False):
            meta = {"prompt_tokens": prompt_tokens, "completion_tokens": sent, "cached_tokens": 0,
                    "finish_reason": {"type": "length", "length": M} if final else None}
            if final:
                meta.update(e2e_latency=time.perf_counter() - t0, spec_verify_ct=steps,
                            spec_accept_length=sent / steps if steps else None)
            line = "data: " + json.dumps({"text": text, "meta_info": meta}) + "\n\n"
            if self.b.fault == "split_lines":          # deliver each event in pieces
                mid = len(line) // 2
                self.wfile.write(line[:mid].encode()); self.wfile.flush(); time.sleep(0.002)
                self.wfile.write(line[mid:].encode())
            else:
                self.wfile.write(line.encode())
            self.wfile.flush()

        # first token (prefill), then verify steps of `accept` tokens each
        time.sleep(self.b.ttft_s)
        sent, text = 1, "tok"
        chunk()
        while sent < M:
            time.sleep(self.b.step_s)
            if self.b.fault == "keepalive":
                self.wfile.write(b": keep-alive\n\n"); self.wfile.flush()
            k = min(self.b.accept, M - sent)
            sent += k
            steps += 1
            text += " tok" * k
            if faulty and self.b.fault == "drop" and sent > M // 2:
                self.wfile.write(b'data: {"text": "tok tok", "meta_in')
                self.wfile.flush()
                self.connection.shutdown(2)
                return
            if faulty and self.b.fault == "malformed" and steps == 2:
                self.wfile.write(b"data: {not json}\n\n"); self.wfile.flush()
                return
            if faulty and self.b.fault == "stream_error" and steps == 2:
                self.wfile.write(b'data: {"error": {"message": "out of memory"}}\n\n'); self.wfile.flush()
                return
            chunk(final=sent >= M)
        if self.b.fault != "no_done":
            self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        with self.server.lock:          # the server's running accept length, as /server_info reports it
            self.server.served = sent / steps if steps else None


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):  # a client that hung up (timeouts) is expected
        pass

    def die(self):
        self.shutdown()
        self.server_close()


class FakeSGLang:
    """Context manager: a server on 127.0.0.1:<free port>."""

    def __init__(self, **behaviour):
        self.behaviour = Behaviour(**behaviour)

    def __enter__(self):
        self.httpd = _Server(("127.0.0.1", 0), _Handler)
        self.httpd.behaviour = self.behaviour
        self.httpd.lock = threading.Lock()
        self.httpd.requests = 0
        self.httpd.served = 0
        self.httpd.attempts = {}
        self.httpd.log = []            # (path, client port) of every request, in order
        self.httpd.in_flight = self.httpd.max_in_flight = self.httpd.finished = 0
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    @property
    def requests(self) -> int:
        return self.httpd.requests

    @property
    def max_in_flight(self) -> int:
        return self.httpd.max_in_flight

    @property
    def log(self) -> list:
        return list(self.httpd.log)

    def __exit__(self, *exc):
        if self.httpd.socket.fileno() != -1:
            self.httpd.shutdown()
            self.httpd.server_close()
