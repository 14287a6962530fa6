"""A fuzzing campaign on the GPU: random shapes and inputs for the three kernels against their
references, for a time budget. The GPU tests fix their grids; this draws what they do not
combine (ragged prefixes with odd page sizes and head counts, forced kernels and split counts,
per-request plans under wide tables, budgets past the reachable nodes, unsorted or positive
rows, a smaller GPU's shared memory).

Every case's parameters and verdict go to a JSON-lines file as the case ends, so an interrupted
campaign keeps what it ran; `--replay LINE` runs one recorded case again (its seed is in it).

    python3 scripts/fuzz_gpu.py --seconds 120 --out fuzz.jsonl [--seed 0] [--ops build verify accept]
    python3 scripts/fuzz_gpu.py --replay "$(grep '"ok": false' fuzz.jsonl | head -1)"

Checks: the build byte for byte against the CPU build (every output, the dense mask in half
the cases, status bits as the inputs imply); verify against the float64 reference (no NaN, relative error <= 5e-3, lse
within 1e-3: the tests' bounds); accept (links and parents forms) against the CPU walk.
Outputs are poisoned before each launch. Exit status 1 if any case failed.
"""
from __future__ import annotations

import argparse
import json
import time
import traceback

import numpy as np
import torch

from kdtree import ops
from kdtree.harness.workloads import (follow_targets, paged_case, poisoned_accept, poisoned_trees, stage_a_inputs,
                                      widened_table)
from kdtree.reference.attention import verify_attention_ref
from kdtree.reference.tree import build_trees, greedy_accept_batch, pack_visibility

DEV = "cuda"
TREE_FIELDS = ("node_counts", "tokens", "depths", "parents", "positions", "next_token", "next_sibling",
               "visibility", "visibility_bits")
SM120_ROOM = 99 * 1024 - 26656  # the build's dynamic shared memory on an RTX PRO 6000


def pick(rng, values, p=None):
    return values[int(rng.choice(len(values), p=p))]


# ---------------------------------------------------------------- cases
def build_case(rng) -> dict:
    bmax = int(pick(rng, [0, 1, 2, 15, 16, 17, 31, 64, 100, 200, 256, 511, 1024]))
    return {"B": int(pick(rng, [1, 2, 5, 16, 33, 64, 131, 132, 133, 256])),
            "L": int(pick(rng, [1, 2, 3, 8, 15, 15, 15, 16, 17, 24])),
            "V": int(pick(rng, [1, 2, 3, 7, 50, 1000, 8192, 32000])),
            "budget_max": bmax,
            "ragged": bool(rng.random() < 0.5),
            "extra_slots": int(pick(rng, [0, 0, 0, 1, 9])) if bmax < 1024 else 0,
            "coarse": float(pick(rng, [0.0, 0.3, 1.0])),
            "drafts": str(pick(rng, ["mixed", "confident"])),
            "neg_inf_tail": bool(rng.random() < 0.1),
            "unsorted": bool(rng.random() < 0.1),
            "positive": bool(rng.random() < 0.05),
            "smem_limit": int(pick(rng, [0, 0, 0, SM120_ROOM, 1])),
            "dense": bool(rng.random() < 0.5),
            "seed": int(rng.integers(1 << 30))}


def run_build(c: dict) -> str | None:
    rng = np.random.default_rng(c["seed"])
    B, L, V, bmax = c["B"], c["L"], c["V"], c["budget_max"]
    lp, ids = stage_a_inputs(B, L, V, max(bmax, 1), seed=c["seed"], coarse_fraction=c["coarse"], drafts=c["drafts"])
    K = lp.shape[-1]
    if c["neg_inf_tail"] and K > 2:
        lp[:, :, K // 2:] = float("-inf")
    if c["unsorted"] and K > 1:  # outside stage A's contract: the warp loop builds these rows
        b, d = int(rng.integers(B)), int(rng.integers(L))
        perm = torch.as_tensor(rng.permutation(K))
        lp[b, d], ids[b, d] = lp[b, d, perm].clone(), ids[b, d, perm].clone()
    if c["positive"]:
        lp[0, 0, 0] = 0.5
    budgets = np.where(rng.random(B) < 0.5, rng.integers(0, bmax + 1, B), bmax) if c["ragged"] else np.full(B, bmax)
    seq, roots = rng.integers(0, 100_000, B), rng.integers(0, max(V, 1), B)
    want = build_trees(lp, ids, budgets, seq_lens=seq, root_tokens=roots, d_max=bmax + 1 + c["extra_slots"])
    # The first campaign's lines have no "dense": those cases all asked for the dense mask.
    out = poisoned_trees(B, want.D, DEV, dense=c.get("dense", True))  # every output must be written
    fields = [f for f in TREE_FIELDS if f != "visibility" or out.visibility is not None]
    old = ops.lib().kd_build_set_smem_limit(c["smem_limit"])
    try:
        got = ops.tree_build(lp.to(DEV), ids.to(DEV), torch.as_tensor(budgets, dtype=torch.int32, device=DEV),
                             seq_lens=torch.as_tensor(seq, dtype=torch.int32, device=DEV),
                             root_tokens=torch.as_tensor(roots, dtype=torch.int64, device=DEV), d_max=want.D, out=out)
        torch.cuda.synchronize()
    finally:
        ops.lib().kd_build_set_smem_limit(old)
    for f in fields:
        g, w = getattr(got, f).cpu().numpy(), getattr(want, f)
        if g.dtype != w.dtype or g.shape != w.shape:
            return f"{f}: {g.dtype} {g.shape}, expected {w.dtype} {w.shape}"
        if not np.array_equal(g, w):
            return f"{f} differs in requests {np.argwhere((g != w).reshape(B, -1).any(1)).ravel()[:8].tolist()}"
    st = got.status.cpu().numpy()
    if (st & ~ops.STATUS_WARP_LOOP & ~ops.STATUS_BUDGET_CLAMPED).any():
        return f"status bits {sorted(set(st.tolist()))} on finite inputs"
    return None


# (B, D, H) whose per-request plans split only the last row tile on 132 SMs (verify v25)
TAIL_SHAPES = [(16, 65, 8), (16, 33, 16), (16, 65, 16), (8, 65, 16)]


def verify_case(rng) -> dict:
    H = int(pick(rng, [1, 2, 3, 8, 16, 22, 32, 64, 128]))
    D = int(pick(rng, [1, 2, 3, 5, 8, 16, 17, 33, 64, 65, 100, 257, 513, 1025]))
    B = int(pick(rng, [1, 1, 2, 3, 8, 16, 24]))
    per_request = int(pick(rng, [0, 0, 0, 0, 0, 1, 4, 64]))
    if per_request and rng.random() < 0.5:
        B, D, H = (int(x) for x in TAIL_SHAPES[int(rng.integers(len(TAIL_SHAPES)))])
    while D * H > 16384:
        D = max(1, D // 2)
    pmax = int(pick(rng, [0, 1, 64, 100, 1000, 5000, 20000, 40000]))
    while B * (pmax + D) > 400_000 and B > 1:
        B //= 2
    while D * H * (pmax + D) > 200_000_000:  # the float64 reference's scores of one request
        pmax //= 2
    return {"B": B, "D": D, "H": H, "pmax": pmax,
            "page": int(pick(rng, [1, 1, 2, 16, 32, 64, 64, 128, 256])),
            "layout": str(pick(rng, ["scattered", "runs", "runs", "broken_runs"])),
            "kernel": str(pick(rng, ["auto", "auto", "mma_sync", "wgmma_cp_async", "wgmma_combine"])),
            "num_splits": None if per_request else pick(rng, [None, None, None, 1, 2, 3, 7, 32, 128]),
            # per-request split counts (the SGLang drop-in's plans; tail plans among them) under
            # a table this many times the longest request's pages
            "per_request": per_request,
            "bits": bool(rng.random() < 0.5),
            "scale": float(pick(rng, [0.130861, 0.0416667, 0.5])),
            "seed": int(rng.integers(1 << 30))}


def run_verify(c: dict) -> str | None:
    if c["kernel"].startswith("wgmma") and torch.cuda.get_device_capability() != (9, 0):
        return "skipped: wgmma kernels run on Hopper only"
    rng = np.random.default_rng(c["seed"])
    prefixes = [int(x) for x in rng.integers(0, c["pmax"] + 1, c["B"])]
    case = paged_case(prefixes, c["D"], c["H"], c["page"], seed=c["seed"], device=DEV, layout=c["layout"])
    vis = case.visibility
    if c["bits"]:
        vis = torch.from_numpy(pack_visibility(vis.cpu().numpy())).to(DEV)
    B, D, H = c["B"], c["D"], c["H"]
    out = torch.full((B, D, H, 512), float("nan"), dtype=torch.bfloat16, device=DEV)
    lse = torch.full((B, D, H), float("nan"), dtype=torch.float32, device=DEV)
    wide = c.get("per_request", 0)
    if wide:
        table = widened_table(case.block_table, case.block_table.shape[1] * wide)
        plan = ops.TreeVerifyPlan(B, D, H, c["page"], table.shape[1], kernel=c["kernel"], per_request_splits=True)
        plan.run(case.q, case.kv_cache, table, case.seq_lens, vis, c["scale"], out=(out, lse))
    else:
        ops.tree_verify(case.q, case.kv_cache, case.block_table, case.seq_lens, vis, c["scale"],
                        kernel=c["kernel"], num_splits=c["num_splits"], out=(out, lse))
    ref_o, ref_l = verify_attention_ref(case.q, case.kv_cache, case.block_table, case.seq_lens, case.visibility,
                                        c["scale"])
    if torch.isnan(out).any() or torch.isnan(lse).any():
        return "NaN in out or lse"
    rel = float((out.double() - ref_o).norm() / ref_o.norm())
    err = float((lse.double() - ref_l).abs().max())
    if not rel <= 5e-3 or not err <= 1e-3:
        return f"relative error {rel:.3g}, lse error {err:.3g}"
    return None


def accept_case(rng) -> dict:
    return {"B": int(pick(rng, [1, 3, 16, 64, 256])),
            "budget": int(pick(rng, [0, 1, 16, 64, 256, 1024])),
            "L": int(pick(rng, [1, 4, 15])),
            "max_depth": int(pick(rng, [0, 1, 7, 15, 40])),
            "follow": float(pick(rng, [0.0, 0.85, 1.0])),
            "V": int(pick(rng, [2, 40, 32000])),
            "seed": int(rng.integers(1 << 30))}


def run_accept(c: dict) -> str | None:
    rng = np.random.default_rng(c["seed"])
    B, budget, V = c["B"], c["budget"], c["V"]
    budgets = np.where(rng.random(B) < 0.3, rng.integers(0, budget + 1, B), budget)
    lp, ids = stage_a_inputs(B, c["L"], V, max(budget, 1), seed=c["seed"], coarse_fraction=0.5)
    tb = build_trees(lp, ids, budgets, root_tokens=rng.integers(0, V, B), d_max=budget + 1)
    target = follow_targets(tb, V, c["follow"], rng)
    md = c["max_depth"]
    want = greedy_accept_batch(tb.tokens, tb.next_token, tb.next_sibling, target, md)
    t = lambda a: torch.as_tensor(np.ascontiguousarray(a)).to(DEV)
    for form, kw in (("links", {"next_token": t(tb.next_token), "next_sibling": t(tb.next_sibling)}),
                     ("parents", {"parents": t(tb.parents), "node_counts": t(tb.node_counts)})):
        out = poisoned_accept(B, md, DEV)
        got = ops.tree_accept(t(tb.tokens), t(target), md, out=out, **kw)
        for name, g, w in zip(("accept_index", "accept_len", "bonus"), got, want):
            if not np.array_equal(g.cpu().numpy(), w):
                return f"{form}: {name} differs"
    return None


CASES = {"build": (build_case, run_build), "verify": (verify_case, run_verify), "accept": (accept_case, run_accept)}


def run_one(op: str, c: dict) -> dict:
    t0 = time.perf_counter()
    try:
        why = CASES[op][1](c)
    except Exception as e:  # a crash is a failed case, recorded with its parameters
        why = f"{type(e).__name__}: {e}"[:400] + " | " + traceback.format_exc().splitlines()[-3][:200]
    skipped = why is not None and why.startswith("skipped")
    return {"op": op, "case": c, "ok": why is None or skipped, "skipped": skipped, "why": why,
            "seconds": round(time.perf_counter() - t0, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="time budget of the campaign")
    ap.add_argument("--out", help="JSON-lines file a case a line (appended)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ops", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--replay", help="one line of an earlier campaign's file: run that case again")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fuzz_gpu: needs a CUDA device")
    ops.lib()
    if a.replay:
        rec = json.loads(a.replay)
        r = run_one(rec["op"], rec["case"])
        print(json.dumps(r))
        return 0 if r["ok"] else 1
    rng = np.random.default_rng(a.seed)
    sink = open(a.out, "a") if a.out else None
    counts = {op: [0, 0, 0] for op in a.ops}  # ran, failed, skipped
    t_end = time.perf_counter() + a.seconds
    while time.perf_counter() < t_end:
        op = a.ops[int(rng.integers(len(a.ops)))]
        r = run_one(op, CASES[op][0](rng))
        counts[op][0] += 1
        counts[op][1] += not r["ok"]
        counts[op][2] += r["skipped"]
        if sink:
            sink.write(json.dumps(r) + "\n")
            sink.flush()
        if not r["ok"]:
            print("FAIL", json.dumps(r), flush=True)
    if sink:
        sink.close()
    for op, (n, bad, skip) in counts.items():
        print(f"{op}: {n} cases, {bad} failed, {skip} skipped")
    return 1 if any(bad for _, bad, _ in counts.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
