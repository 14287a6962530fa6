"""SGLang's DDTree worker round at its boundary (spec sglang.md, section 1): the CPU path as
the worker runs it (the top-k copied to the host, the heapq build per request, padding and
upload, the [q, P + q] custom mask built and uploaded, the target's argmax copied back, the
child-map accept), the same path with ``kdtree.sglang.patch()``'s builder (what
``KDTREE_SGLANG=1`` alone changes), against kdtree.sglang's drop-in (build into the padded
layout, the mask, the accept) captured in one CUDA graph. Beside them, one layer of
tree-verify attention on SGLang's KV metadata, so a row says where the round's time goes."""
from __future__ import annotations

import time

from ..gpu import ensure_fits
from ..timing import summarize, time_graph
from ..workloads import stage_a_inputs
from .runner import run_sweep


def _cpu_path(build, ref, lp, ids, budget, bonus_h, prefix_h, target, q, dev, torch):
    """One round of the CPU path with the builder ``build`` (the worker's, or the one
    ``kdtree.sglang.patch()`` puts in its place); returns each part's seconds (synchronised)."""
    t0 = time.perf_counter()
    trees = [build(lp[i], ids[i], budget) for i in range(lp.shape[0])]
    t1 = time.perf_counter()
    layout = ref.pad_round(trees, bonus_h, prefix_h, q)
    up = [torch.from_numpy(a).to(dev) for a in layout]
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    mask, indptr = ref.custom_mask(layout[4], prefix_h)
    mask_d, indptr_d = torch.from_numpy(mask).to(dev), torch.from_numpy(indptr).to(dev)
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    ref.accept([t[3] for t in trees], layout[0], target.cpu().numpy(), q)
    t4 = time.perf_counter()
    del up, mask_d, indptr_d
    return {"build": t1 - t0, "pad_upload": t2 - t1, "mask_upload": t3 - t2, "accept": t4 - t3, "round": t4 - t0}


def measure_point(p: dict, cfg: dict) -> list[dict]:
    import numpy as np
    import torch

    from ... import sglang
    from ...sglang import reference as ref

    bs, budget, P, H = p["batch"], p["budget"], p["prefix"], p["heads"]
    q, L, dev = budget + 1, cfg["L"], torch.device("cuda")
    mask_bytes = sglang.mask_size(bs, q, P)
    pool = bs * (P + q) + 1
    ensure_fits(2 * mask_bytes + pool * 576 * 2 + bs * q * H * (576 + 512) * 2 + (64 << 20), cfg["gpu_mem_cap_gb"])
    lp, ids = stage_a_inputs(bs, L, cfg["vocab"], budget, seed=cfg["seed"] + bs + budget)
    lp, ids = lp.to(dev), ids.to(dev)
    rng = np.random.default_rng(cfg["seed"] + P)
    bonus_h = rng.integers(0, cfg["vocab"], bs)
    prefix_h = np.full(bs, P)
    bonus, prefix = torch.as_tensor(bonus_h, device=dev), torch.as_tensor(prefix_h, device=dev)
    budgets = torch.full((bs,), budget, dtype=torch.int32, device=dev)
    target = torch.randint(0, cfg["vocab"], (bs, q), device=dev)

    rows = []
    # The worker as it is, and with KDTREE_SGLANG=1 (patch() swaps its builder alone).
    for impl, build in (("sglang_cpu_path", ref.build_ddtree_tree_from_topk),
                        ("sglang_cpu_path_patched", sglang.build_ddtree_tree_from_topk)):
        samples = {}
        _cpu_path(build, ref, lp, ids, budget, bonus_h, prefix_h, target, q, dev, torch)   # warm-up
        for _ in range(cfg.get("cpu_reps", 3)):
            for k, v in _cpu_path(build, ref, lp, ids, budget, bonus_h, prefix_h, target, q, dev, torch).items():
                samples.setdefault(k, []).append(v)
        for part, s in samples.items():
            rows.append(dict(p, impl=impl, part=part, **summarize(s)))

    rb = sglang.RoundBuilder(bs, budget, dev)
    mask_buf = torch.empty(mask_bytes, dtype=torch.uint8, device=dev)
    indptr = torch.empty(bs + 1, dtype=torch.int64, device=dev)
    acc = sglang.AcceptOutput(torch.empty(bs, q, dtype=torch.int64, device=dev),
                              torch.empty(bs, dtype=torch.int32, device=dev),
                              torch.empty(bs, q, dtype=torch.int64, device=dev))

    def dropin(with_mask):
        def round_():
            lay = rb.build(lp, ids, budgets, bonus, prefix)
            if with_mask:
                sglang.custom_mask(lay.visibility, prefix, out=mask_buf, mask_indptr=indptr)
            sglang.accept(lay.tree_tokens, lay.retrieve_next_token, lay.retrieve_next_sibling, target, out=acc)
        return round_

    for impl, fn in (("kdtree_dropin_graph", dropin(True)), ("kdtree_dropin_graph_nomask", dropin(False))):
        t = time_graph(fn, replays=cfg["gpu_replays"], inner=1)
        rows.append(dict(p, impl=impl, part="round", **t))

    # One layer of verify attention on SGLang's metadata (token pool, req_to_token in place).
    g = torch.Generator(device="cuda").manual_seed(cfg["seed"])
    kv = torch.randn(pool, 1, 576, device=dev, dtype=torch.bfloat16, generator=g)
    req_to_token = torch.randperm(pool - 1, device=dev, generator=g)[:bs * (P + q)].view(bs, P + q).int()
    rows_idx = torch.arange(bs, dtype=torch.int32, device=dev)
    qx = torch.randn(bs * q, H, 576, device=dev, dtype=torch.bfloat16, generator=g)
    lay = rb.build(lp, ids, budgets, bonus, prefix)
    va = sglang.VerifyAttention(bs, q, H, P + q, device=dev)
    out = va.run(qx, kv, req_to_token, rows_idx, prefix, lay.visibility, cfg["scale"])   # prepares
    # A layer after the forward's prepare(): what each of the model's layers costs.
    t = time_graph(lambda: va.run(qx, kv, req_to_token, None, None, lay.visibility, cfg["scale"], out=out),
                   replays=cfg["gpu_replays"], inner=1)
    rows.append(dict(p, impl="kdtree_verify_layer", part="attention", kernel=va.plan.name,
                     num_splits=va.plan.num_splits, **t))
    del kv, req_to_token, qx, out, mask_buf, rb
    torch.cuda.empty_cache()
    for r in rows:
        r["mask_bytes"] = mask_bytes
    return rows


def run(cfg: dict, out_path, library=None):
    points = [{"batch": int(b), "budget": int(k), "prefix": int(pp), "heads": int(h)}
              for b in cfg["batches"] for k in cfg["budgets"] for pp in cfg["prefixes"] for h in cfg["heads"]]
    return run_sweep("worker_round", points, lambda p: measure_point(p, cfg), out_path, cfg, library,
                     settle=True)


