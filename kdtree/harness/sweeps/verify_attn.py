"""Tree-verify attention: the kernel against torch SDPA with a tree mask, beside the roofline."""
from __future__ import annotations

import itertools
import math

from ...reference.attention import LATENT_DIM, QK_DIM, attention_bytes, attention_flops
from .. import sglang_peers
from ..gpu import ensure_fits, measure_ceilings
from ..timing import ALTERNATING, time_events, time_graph, time_graphs_alternating
from ..workloads import page_order
from .runner import run_sweep

SPEC_BW = 4.3e12       # bytes/s (spec verify_attention.md, measured copy on an H200)
SPEC_FLOPS = 790e12    # bf16 FLOP/s


def floor_us(B, D, H, P) -> float:
    return max(attention_bytes(B, D, H, P) / SPEC_BW, attention_flops(B, D, H, P) / SPEC_FLOPS) * 1e6


def gpu_case(B, D, H, P, page, seed, layout="scattered"):
    """Paged cache, block table (``layout``: workloads.page_order's; scattered is a shuffle)
    and random tree masks, made on the GPU."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    S = P + D
    per = math.ceil(S / page)
    num_pages = B * per + 1
    cache = torch.randn(num_pages, page, QK_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    cache[-1] = float("nan")   # a poisoned spare page that no live row points at
    if layout == "scattered":
        table = torch.randperm(num_pages - 1, device="cuda", generator=g)[:B * per].view(B, per).int()
    else:
        order = page_order([per] * B, 0, layout, torch.Generator().manual_seed(seed))
        table = order.view(B, per).int().to("cuda")
    q = torch.randn(B, D, H, QK_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    seq = torch.full((B,), S, dtype=torch.int32, device="cuda")
    vis = torch.zeros(B, D, D, dtype=torch.bool, device="cuda")
    for i in range(D):
        if i:
            p = torch.randint(max(0, i - 8), i, (B,), device="cuda", generator=g)
            vis[:, i] = vis[torch.arange(B, device="cuda"), p]
        vis[:, i, i] = True
    return q, cache, table, seq, vis


def sdpa_baseline(q, cache, table, seq, vis, scale):
    """What a user would write: gather the latent rows, fold heads into query rows, SDPA with a mask."""
    import torch
    import torch.nn.functional as F

    B, D, H, _ = q.shape
    page = cache.shape[1]
    S = int(seq[0])
    pos = torch.arange(S, device="cuda")
    kv = cache[table.long()[:, pos // page], pos % page]            # [B, S, 576]
    mask = torch.ones(B, D, S, dtype=torch.bool, device="cuda")
    mask[:, :, S - D:] = vis
    mask = mask[:, :, None, :].expand(B, D, H, S).reshape(B, 1, D * H, S)
    qf = q.reshape(B, 1, D * H, QK_DIM)
    k, v = kv[:, None], kv[:, None, :, :LATENT_DIM]
    return lambda: F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=scale)


def flashmla_module():
    """FlashMLA (the sgl-flash-mla wheel), or None where it does not import."""
    try:
        import flash_mla
        return flash_mla
    except Exception:  # not installed, or built for another torch/CUDA: a peer not available
        return None


FLASHMLA_PAGE = 64   # the page size FlashMLA's dense decode takes
FLASHMLA_MISSING = "flash_mla not importable (sgl-flash-mla not installed)"


def flashmla_calls(fm, q, caches, table, seq, scale):
    """FlashMLA's dense decode on these inputs: a function giving a call that reads the cache
    copies in turn, from the first, each time it is asked (one a timing). The first call,
    which fills the scheduler metadata, is made here, outside any graph."""
    import torch

    meta = fm.get_mla_metadata()[0]
    k_caches = [c.view(c.shape[0], c.shape[1], 1, c.shape[2]) for c in caches]

    def call(kc):
        return fm.flash_mla_with_kvcache(q, kc, table, seq, LATENT_DIM, meta, softmax_scale=scale, causal=True,
                                         use_legacy=True)

    call(k_caches[0])
    torch.cuda.synchronize()

    def calls():
        next_k = rotation(k_caches)
        return lambda: call(next_k())
    return calls


def require_flashmla(who: str):
    """FlashMLA for a probe that times it against kdtree; exits naming `who` where it does not import."""
    fm = flashmla_module()
    if fm is None:
        raise SystemExit(f"{who}: flash_mla does not import (install the sgl-flash-mla wheel)")
    return fm


def peer_calls(fm, B, D, H, P, scale):
    """kdtree's verify and FlashMLA's dense decode on one shape's sweep inputs (runs tables,
    page 64, rotating cache copies; seed 0), for the probes that time the two against each
    other: (a function giving a kdtree call, one giving a FlashMLA call, each over the copies
    from the first, and the launches a graph replay captures)."""
    from ... import ops

    cfg = {"seed": 0, "gpu_mem_cap_gb": 80, "graph_inner": 3}
    (q, cache, table, seq, vis), caches, inner = point_inputs(B, D, H, P, FLASHMLA_PAGE, cfg, "runs")
    out = ops.tree_verify(q, cache, table, seq, vis, scale)

    def kdtree_call():
        nxt = rotation(caches)
        return lambda: ops.tree_verify(q, nxt(), table, seq, vis, scale, out=out)
    return kdtree_call, flashmla_calls(fm, q, caches, table, seq, scale), inner


def flashmla_peer(base: dict, q, caches, table, seq, scale):
    """FlashMLA's dense bf16 decode on the same inputs, as a peer: a causal (chain) mask over
    the D query positions, not the tree's, so the same bytes and nearly the same FLOPs.
    Returns its row without timings and a function giving a call over the same rotating cache
    copies (flashmla_calls); the function is None, and the row says why, where FlashMLA does
    not import, the page size is not its own or it refuses the shape."""
    fm = flashmla_module()
    row = dict(base, impl="flashmla", kernel="flashmla_dense_legacy")
    if fm is None:
        return dict(row, status="not_available", reason=FLASHMLA_MISSING), None
    if caches[0].shape[1] != FLASHMLA_PAGE:
        reason = f"FlashMLA's dense decode takes page size {FLASHMLA_PAGE} only"
        return dict(row, status="not_available", reason=reason), None
    try:
        return row, flashmla_calls(fm, q, caches, table, seq, scale)
    except Exception as e:  # a shape FlashMLA refuses is a row, not a crash
        return flashmla_error(row, e), None


def flashmla_error(row: dict, e: Exception) -> dict:
    return dict(row, status="error", reason=f"{type(e).__name__}: {e}"[:300])


def sglang_triton_row(base: dict, q, caches, table, seq, vis, scale: float, kd_out, reps: int) -> dict:
    """SGLang's Triton tree verify (extend_attention_fwd with the custom mask, what its Triton
    backend runs for MLA trees) on the same inputs at page size 1, its output checked against
    kdtree's before it is timed (eager calls: milliseconds each); a not_available row where
    SGLang does not import or the page size is not its pool's."""
    import torch

    row = dict(base, impl="sglang_triton", kernel=sglang_peers.TRITON_FUNCTION,
               peer_version=sglang_peers.sglang_version())
    if caches[0].shape[1] != sglang_peers.TRITON_PAGE:
        return dict(row, status="not_available",
                    reason=f"timed at page size {sglang_peers.TRITON_PAGE} only (SGLang's token pool)")
    fn, why = sglang_peers.triton_verify()
    if fn is None:
        return dict(row, status="not_available", reason=f"SGLang's Triton kernel not importable: {why}")
    try:
        call, out = sglang_peers.triton_call(fn, q, caches, table, seq, vis, scale)
        call()   # the first copy, against kdtree's output on the same keys
        torch.cuda.synchronize()
        diff, ref = (out.float() - kd_out.float()).abs(), kd_out.float().abs()
        if not bool((diff <= TRITON_TOL * (1 + ref)).all()):   # NaN fails too
            return dict(row, status="error", reason=f"output differs from kdtree's by up to {float(diff.max()):.3g}"
                        f" (allowed {TRITON_TOL} x (1 + |kdtree's|))")
        return timed_row(row, time_events(call, reps=reps))
    except Exception as e:  # a shape it refuses, or out of memory: a row, not a crash
        return dict(row, status="error", reason=f"{type(e).__name__}: {e}"[:300])
    finally:
        torch.cuda.empty_cache()


# Two bf16 attentions of the same f32 math, each rounded to bf16 (2^-8 relative, so up to
# ~0.03 apart at |x| ~ 2); a wrong mask or scale moves outputs by ~0.1 or more.
TRITON_TOL = 0.02


def timed_row(row: dict, t: dict) -> dict:
    """A row with its timing and the fractions of the roofline and copy bandwidth it reaches."""
    return dict(row, roofline_fraction=row["floor_us"] / t["median_us"],
                copy_fraction=row["bytes"] / (t["median_us"] * 1e-6) / (row["copy_gbps"] * 1e9), **t)


def cache_copies(cache, cap: int = 128) -> int:
    """How many copies of `cache` a timing rotates through: enough that one pass over them
    exceeds twice the L2, so a replay reads HBM as a real decode step does (spec pipeline.md:
    never time the cache); at most `cap`."""
    import torch

    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(1, min(cap, math.ceil(2 * l2 / max(cache.numel() * 2, 1))))


def cache_set(cache, copies: int) -> list:
    """`cache` and `copies - 1` clones of it, for a timing to rotate through (cache_copies)."""
    return [cache] + [cache.clone() for _ in range(copies - 1)]


def replay_inner(copies: int, want: int) -> int:
    """Calls a captured graph holds: at least `want`, a whole number of passes over the copies."""
    return copies * max(1, math.ceil(want / copies))


def rotation(items):
    """A function returning the next of `items` at each call, round and round: the calls a
    graph captures then read the cache copies in turn."""
    return itertools.cycle(items).__next__


def point_bytes(B, D, H, P, page) -> int:
    """GPU memory a verify point takes before its cache copies: the cache, q and out, the
    split workspace and the masks (checked by ensure_fits before anything is allocated)."""
    return (B * (math.ceil((P + D) / page) + 1) * page * QK_DIM * 2 + B * D * H * (QK_DIM + LATENT_DIM) * 2
            + B * 64 * D * H * LATENT_DIM * 4 + B * D * D)


def point_inputs(B, D, H, P, page, cfg: dict, layout: str):
    """A point's GPU inputs (gpu_case, seeded by the shape) and the cache copies its timings
    rotate through, each allocation checked against `gpu_mem_cap_gb` before it is made:
    ((q, cache, table, seq, vis), the copies, the launches a graph replay captures)."""
    need = point_bytes(B, D, H, P, page)
    ensure_fits(need, cfg["gpu_mem_cap_gb"])
    case = gpu_case(B, D, H, P, page, cfg["seed"] + B + D + H + P, layout)
    cache = case[1]
    copies = cache_copies(cache)
    ensure_fits(need + (copies - 1) * cache.numel() * 2, cfg["gpu_mem_cap_gb"])
    return case, cache_set(cache, copies), replay_inner(copies, cfg["graph_inner"])


def measure_point(p: dict, cfg: dict, ceilings: dict) -> list[dict]:
    import torch

    from ... import ops

    B, D, H, P, page = p["batch"], p["D"], p["heads"], p["prefix"], p["page_size"]
    S = P + D
    layout = cfg.get("table_layout", "scattered")
    (q, cache, table, seq, vis), caches, inner = point_inputs(B, D, H, P, page, cfg, layout)
    copies = len(caches)
    scale = cfg["scale"]
    out = ops.tree_verify(q, cache, table, seq, vis, scale)

    def call(kernel):
        next_cache = rotation(caches)
        return lambda: ops.tree_verify(q, next_cache(), table, seq, vis, scale, kernel=kernel, out=out)

    def plan(kernel):  # what tree_verify runs for this shape (its plan is kept per shape)
        return ops.TreeVerifyPlan(B, D, H, page, table.shape[1], kernel=kernel)
    fl = floor_us(B, D, H, P)
    nbytes = attention_bytes(B, D, H, P)
    base = dict(p, floor_us=fl, bytes=nbytes, flops=attention_flops(B, D, H, P), cache_copies=copies,
                table_layout=layout, **ceilings)

    def kernel_row(impl, kernel, t=None):
        pl = plan(kernel)
        if t is None:
            t = time_graph(call(kernel), replays=cfg["gpu_replays"], inner=inner)
        return timed_row(dict(base, impl=impl, kernel=pl.name, num_splits=pl.num_splits, split_merge=pl.merge), t)

    # kdtree and FlashMLA, the comparison issue 29's targets are about, are timed together:
    # their replays alternate (time_graphs_alternating), so neither gets the cooler board.
    fm_row, fm_call = flashmla_peer(base, q, caches, table, seq, scale) if cfg.get("compare_flashmla", True) \
        else (None, None)
    kd_t = None
    if fm_call is not None:
        try:
            kd_t, fm_t = time_graphs_alternating([call("auto"), fm_call()], replays=cfg["gpu_replays"], inner=inner)
            fm_row = timed_row(dict(fm_row, timing=ALTERNATING), fm_t)
        except Exception as e:  # FlashMLA refusing the capture: kdtree is then timed alone
            fm_row = flashmla_error(fm_row, e)
    rows = [kernel_row("kdtree_kernel", "auto", kd_t)]
    if kd_t is not None:
        rows[0]["timing"] = ALTERNATING
    kernel = rows[0]["kernel"]
    # A/Bs in the same run on the same inputs: the mma.sync kernel other GPUs (sm_120) run;
    # where the wgmma kernel copies keys by TMA, its cp.async copy; where its splits merge
    # in clusters, the combine kernel instead.
    others = []
    if kernel != "mma_sync" and cfg.get("compare_kernels", True):
        others.append("mma_sync")
    if kernel.startswith("wgmma_tma") and cfg.get("compare_copy", True):
        others.append("wgmma_cp_async")
    if rows[0]["split_merge"] == "cluster" and cfg.get("compare_merge", True):
        others.append("wgmma_combine")
    for path in others:
        rows.append(kernel_row(f"kdtree_{path}", path))
    if fm_row is not None:
        rows.append(fm_row)
    if cfg.get("compare_sglang_triton", True):
        rows.append(sglang_triton_row(base, q, caches, table, seq, vis, scale, out.out,
                                      reps=max(3, cfg["gpu_replays"] // 5)))
    sdpa_elems = B * D * H * S
    if sdpa_elems > cfg["sdpa_max_elems"]:
        rows.append(dict(base, impl="torch_sdpa_tree_mask", status="skipped",
                         reason=f"scores of {sdpa_elems:.3g} elements exceed sdpa_max_elems"))
    else:
        try:
            f = sdpa_baseline(q, cache, table, seq, vis, scale)
            ts = time_events(f, reps=max(3, cfg["gpu_replays"] // 5))
            rows.append(dict(base, impl="torch_sdpa_tree_mask", roofline_fraction=fl / ts["median_us"], **ts))
        except torch.OutOfMemoryError as e:
            rows.append(dict(base, impl="torch_sdpa_tree_mask", status="skipped", reason=f"OOM: {e}"[:300]))
        finally:
            torch.cuda.empty_cache()
    del q, cache, caches, table, seq, vis, out
    torch.cuda.empty_cache()
    return rows


def run(cfg: dict, out_path, library=None):
    ceilings = measure_ceilings()
    print(f"ceilings measured now: copy {ceilings['copy_gbps']:.0f} GB/s, "
          f"bf16 {ceilings['bf16_tflops']:.0f} TFLOP/s")
    points = [{"heads": int(h), "D": int(d), "prefix": int(pp), "batch": int(b), "page_size": int(ps)}
              for h in cfg["heads"] for d in cfg["slots"] for pp in cfg["prefixes"]
              for b in cfg["batches"] for ps in cfg["page_sizes"]]
    return run_sweep("verify_attn", points, lambda p: measure_point(p, cfg, ceilings), out_path,
                     cfg, library, settle=True)
