"""The live-service probe: a bounded, read-only client of a running SGLang server
(spec probe.md). ``client`` measures; this module only declares its command-line
arguments, so ``kdtree --help`` needs none of the probe's dependencies."""
from __future__ import annotations


def add_arguments(p):
    p.add_argument("--url", required=True, help="SGLang base URL, e.g. http://127.0.0.1:30000")
    p.add_argument("--out", required=True, help="per-request Parquet; a _summary.parquet goes beside it")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompts", help="file: one prompt per line, or JSON lines with 'text'")
    p.add_argument("--timeout", type=float, default=60.0, help="per-request timeout (s)")
    p.add_argument("--max-wall", type=float, default=300.0, help="bound on the whole run (s)")
    p.add_argument("--max-consecutive-failures", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--record-failure", action="store_true",
                   help="exit 0 when the service cannot be probed, with the failure as a row")
