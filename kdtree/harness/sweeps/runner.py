"""The loop every sweep shares: resume, progress, one failed point = one recorded row."""
from __future__ import annotations

import json
import traceback

from tqdm import tqdm

from ..gpu import MemoryBudgetError
from ..provenance import new_run_id, provenance
from ..results import ResumableSweep


def point_id(point: dict) -> str:
    return json.dumps(point, sort_keys=True)


def run_sweep(name: str, points: list[dict], measure, out_path, cfg: dict, library=None,
              extra: dict | None = None, settle: bool = False):
    """measure(point) -> list of row dicts. Writes `out_path` when every point is done.

    settle: measure the first point once, unrecorded, before the recorded pass, because the
    first CUDA graph a process times can run fast (~8% at batch 1 on the H200; measured in
    docs/kernels/verify_attention.md, session 43) and would not be timed as the others are.
    A failure here is left to the recorded pass to record."""
    sweep = ResumableSweep(out_path)
    done = sweep.done()
    run_id = new_run_id()
    todo = [p for p in points if point_id(p) not in done]
    if done:
        print(f"{name}: resuming, {len(points) - len(todo)} of {len(points)} points already done")
    if settle and todo:
        try:
            measure(todo[0])
        except Exception:  # noqa: BLE001 - the recorded pass measures it again and records why
            pass
    for p in tqdm(todo, desc=name, unit="pt"):
        prov = provenance(run_id, cfg, library)
        try:
            rows = measure(p)
        except MemoryBudgetError as e:
            rows = [dict(p, status="skipped", reason=str(e))]
        except Exception as e:  # a failed point is a recorded row, not a crash
            rows = [dict(p, status="error", reason=f"{type(e).__name__}: {e}",
                         traceback=traceback.format_exc(limit=3))]
        for r in rows:
            r.setdefault("status", "ok")
            r.setdefault("reason", "")
            r["point"] = point_id(p)
            r["sweep"] = name
            r.update(extra or {})
            r.update(prov)
        sweep.add(rows)
    return sweep.finish()
