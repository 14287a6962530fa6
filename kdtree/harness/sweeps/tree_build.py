"""CPU (the reference heapq build, SGLang's builder if present) against the GPU kernel."""
from __future__ import annotations

from .. import sglang_peers
from ..gpu import cuda_available, ensure_fits
from ..timing import time_cpu, time_eager_latency, time_graph
from ...reference.tree import _check_stage_b, heap_build
from ..workloads import DRAFTS, stage_a_inputs
from .runner import run_sweep


def point_seed(seed: int, batch: int, budget: int) -> int:
    """The seed of one point's stage-A inputs (the profiling scripts reproduce a point of the
    default config, seed 0, with it)."""
    return seed + batch * 7919 + budget


# The reference set's tree-build sweep (config/reference.yaml over config/config.yaml): the
# rows' depth, the vocabulary and the seed. A CPU test holds them to the config files.
REFERENCE_L, REFERENCE_VOCAB, REFERENCE_SEED = 15, 8192, 0


def reference_inputs(batch: int, budget: int, topk: int, drafts: str):
    """Stage-A inputs (top-K log-probs, ids) of one point of the reference set's tree-build
    sweep at K = topk: what the profiling and timing scripts reproduce."""
    return stage_a_inputs(batch, REFERENCE_L, REFERENCE_VOCAB, topk,
                          seed=point_seed(REFERENCE_SEED, batch, budget), drafts=drafts)


def sglang_row(p: dict, cfg: dict, lp, ids, budget: int) -> dict:
    """SGLang's DDTree worker builder (spec sglang.md step 2) on the host copies of the same
    rows, a request at a time as the worker calls it, where SGLang has one; its first
    request's tree checked against the reference's before it is timed."""
    from ...sglang import reference as sglang_ref

    row = dict(p, impl="sglang", metric="batch_time", kernel=sglang_peers.BUILDER,
               peer_version=sglang_peers.sglang_version())
    fn, why = sglang_peers.builder()
    if fn is None:
        return dict(row, status="not_available", reason=f"no SGLang DDTree builder: {why}")
    try:
        got, want = fn(lp[0], ids[0], budget), sglang_ref.build_ddtree_tree_from_topk(lp[0], ids[0], budget)
        if not sglang_peers.same_tree(got, want):
            return dict(row, status="error", reason="its tree for request 0 differs from the reference build's")
        t = time_cpu(lambda: [fn(lp[b], ids[b], budget) for b in range(lp.shape[0])],
                     reps=cfg["cpu_reps"], max_seconds=cfg["cpu_max_seconds"])
    except Exception as e:  # a builder that fails on these inputs is a row, not a crash
        return dict(row, status="error", reason=f"{type(e).__name__}: {e}"[:300])
    return dict(row, **t)


def measure_point(p: dict, cfg: dict, gpu: bool) -> list[dict]:
    B, budget, L, V = p["batch"], p["budget"], cfg["L"], cfg["vocab"]
    # K = min(budget, vocab, max_topk): a drafter's top-k is often capped below the budget
    topk = min(budget, V, cfg.get("max_topk") or budget)
    lp, ids = stage_a_inputs(B, L, V, topk, seed=point_seed(cfg["seed"], B, budget), drafts=p["drafts"])
    p = dict(p, topk=lp.shape[-1])
    lp_np, ids_np = lp.numpy(), ids.numpy()
    rows = []
    checked = [_check_stage_b(lp_np[b], ids_np[b], budget) for b in range(B)]  # once, outside the timing
    cpu = time_cpu(lambda: [heap_build(*c) for c in checked],
                   reps=cfg["cpu_reps"], max_seconds=cfg["cpu_max_seconds"])
    rows.append(dict(p, impl="cpu_heapq", metric="batch_time", **cpu))
    rows.append(sglang_row(p, cfg, lp, ids, budget))
    if not gpu:
        rows.append(dict(p, impl="gpu_kernel", metric="device_time", status="skipped",
                         reason="no CUDA device"))
        return rows
    import torch

    from ... import ops

    D = budget + 1
    ensure_fits(B * (D * D * 2 + D * 64) + lp.numel() * 12, cfg["gpu_mem_cap_gb"])
    lp_d, ids_d = lp.cuda(), ids.cuda()
    budgets = torch.full((B,), budget, dtype=torch.int32, device="cuda")
    out = ops.tree_build(lp_d, ids_d, budgets, d_max=D)
    # Requests the kernel could not certify for threshold selection (built by its warp loop).
    warp_loop = int(((out.status & ops.STATUS_WARP_LOOP) != 0).sum())
    fn = lambda: ops.tree_build(lp_d, ids_d, budgets, d_max=D, out=out)
    dev = time_graph(fn, replays=cfg["gpu_replays"])
    lat = time_eager_latency(fn, reps=cfg["gpu_replays"])
    tiny = torch.zeros(1, device="cuda")
    empty = time_eager_latency(lambda: tiny.add_(0), reps=cfg["gpu_replays"])
    rows.append(dict(p, impl="gpu_kernel", metric="device_time", warp_loop_requests=warp_loop, **dev))
    rows.append(dict(p, impl="gpu_kernel", metric="caller_latency", **lat))
    rows.append(dict(p, impl="torch_tiny_op", metric="caller_latency", **empty))
    if cfg.get("dense_visibility"):  # the SGLang drop-in's build: the dense mask besides the bits
        dense = ops.tree_build(lp_d, ids_d, budgets, d_max=D, dense_visibility=True)
        dense_dev = time_graph(lambda: ops.tree_build(lp_d, ids_d, budgets, d_max=D, dense_visibility=True, out=dense),
                               replays=cfg["gpu_replays"])
        rows.append(dict(p, impl="gpu_kernel_dense", metric="device_time", warp_loop_requests=warp_loop, **dense_dev))
    return rows


def run(cfg: dict, out_path, gpu: bool | None = None, library=None):
    gpu = cuda_available() if gpu is None else gpu
    drafts = cfg.get("drafts") or [DRAFTS[0]]  # the schema's default: [mixed]
    points = [{"batch": int(B), "budget": int(b), "drafts": k}
              for B in cfg["batches"] for b in cfg["budgets"] for k in drafts]
    return run_sweep("tree_build", points, lambda p: measure_point(p, cfg, gpu), out_path, cfg,
                     library if gpu else None, extra={"L": cfg["L"], "vocab": cfg["vocab"]}, settle=gpu)
