"""A stand-in for SGLang's Triton attention backend in a DDTree target-verify forward, with the
Triton extend kernel's contract in float64 (`extend_attention_fwd`), for the peers' and the
attention patch's tests (CPU and GPU alike)."""
from __future__ import annotations

import types

import numpy as np
import torch

from kdtree.reference.attention import verify_attention_ref
from kdtree.sglang import reference as sglang_ref

BACKEND_MODULE = "sglang.srt.layers.attention.triton_backend"


def fake_extend_attention_fwd(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
                              kv_indices, custom_mask, is_causal, mask_indptr, max_len_extend, k_scale, v_scale,
                              sm_scale=None, logit_cap=0.0, skip_prefix_custom_mask=True, sliding_window_size=-1,
                              sinks=None, window_kv_offsets=None, xai_temperature_len=-1, page_size: int = 1,
                              score_mod=None, aux_tensors=None, extend_seq_lens_cpu=None):
    """extend_attention_fwd's contract as SGLang's kernel reads its arguments, in float64:
    request i's queries qo_indptr[i]:qo_indptr[i+1] see its prefix slots kv_indices[kv_indptr[i]:
    kv_indptr[i+1]] (no mask: skip_prefix_custom_mask) and its extend tokens where the custom
    mask's row (prefix + extend columns, from mask_indptr[i]) holds a non-zero byte at prefix + j."""
    assert skip_prefix_custom_mask and page_size == 1 and k_scale == 1.0 and v_scale == 1.0
    assert logit_cap == 0 and sliding_window_size == -1 and sinks is None and window_kv_offsets is None
    assert xai_temperature_len <= 0 and score_mod is None and aux_tensors is None
    for i in range(qo_indptr.numel() - 1):
        q0, q1 = int(qo_indptr[i]), int(qo_indptr[i + 1])
        prefix = kv_indices[int(kv_indptr[i]):int(kv_indptr[i + 1])]
        P, E = prefix.numel(), q1 - q0
        assert E <= max_len_extend
        k = torch.cat([k_buffer[prefix, 0], k_extend[q0:q1, 0]]).double()
        v = torch.cat([v_buffer[prefix, 0], v_extend[q0:q1, 0]]).double()
        m = custom_mask[int(mask_indptr[i]):int(mask_indptr[i]) + E * (P + E)].view(E, P + E) != 0
        m[:, :P] = True
        s = torch.einsum("ehc,kc->ehk", q_extend[q0:q1].double(), k) * sm_scale
        s = s.masked_fill(~m[:, None, :], float("-inf"))
        o_extend[q0:q1] = torch.einsum("ehk,kc->ehc", torch.softmax(s, -1), v).to(o_extend.dtype)


class ForwardMode:
    def __init__(self, verify: bool):
        self.verify = verify

    def is_target_verify(self):
        return self.verify


class Pool:
    """MLATokenToKVPool's reading: one latent buffer [slots, 1, 576] a layer; V is its first 512."""

    def __init__(self, layers: int, slots: int, device):
        g = torch.Generator().manual_seed(7)
        self.kv = [torch.randn(slots, 1, 576, generator=g).bfloat16().to(device) for _ in range(layers)]

    def get_key_buffer(self, layer_id):
        return self.kv[layer_id]

    def get_value_buffer(self, layer_id):
        return self.kv[layer_id][..., :512]

    def set_kv_buffer(self, layer, loc, cache_k, cache_v):
        self.kv[layer.layer_id][loc] = cache_k.view(-1, 1, 576)


def layer(layer_id: int, H: int, scaling=0.130861, **attrs):
    """RadixAttention's attributes the backend reads (MLA absorbed: 576 / 512)."""
    base = dict(layer_id=layer_id, tp_q_head_num=H, qk_head_dim=576, v_head_dim=512, scaling=scaling, k_scale=None,
                v_scale=None, logit_cap=0.0, sliding_window_size=-1, is_cross_attention=False,
                xai_temperature_len=-1)
    base.update(attrs)
    return types.SimpleNamespace(**base)


class TritonAttnBackend:
    """The Triton backend's target-verify path as SGLang 0.5.x runs it: metadata from
    req_to_token and the spec info's custom mask once a forward, then per layer the verify
    slots' KV into the pool and extend_attention_fwd (an attribute of the instance) over the
    prefix (kv_indices) and the extend tokens (k, v), with the layer's options as keywords;
    deterministic mode takes another kernel. `kernel_calls` counts the Triton kernel's calls."""

    def __init__(self, pool: Pool, req_to_token, num_draft_tokens: int, use_mla=True):
        self.token_to_kv_pool, self.req_to_token = pool, req_to_token
        self.num_draft_tokens, self.use_mla = num_draft_tokens, use_mla
        self.enable_deterministic = False
        self.forward_metadata = None
        self.extend_attention_fwd = self._count(fake_extend_attention_fwd)
        self.kernel_calls = self.unified_calls = 0

    def _count(self, fn):
        def kernel(*args, **kwargs):
            self.kernel_calls += 1
            return fn(*args, **kwargs)
        return kernel

    def init_forward_metadata(self, fb):
        q = self.num_draft_tokens
        seq = fb.seq_lens.long().cpu()
        rows = fb.req_pool_indices.long().cpu()
        dev = fb.seq_lens.device
        kv_indptr = torch.zeros(len(seq) + 1, dtype=torch.int32)   # SGLang's dtypes: i32 offsets,
        kv_indptr[1:] = torch.cumsum(seq, 0)                          # i64 slots and mask offsets
        kv_indices = torch.cat([self.req_to_token[r, :s].long().cpu() for r, s in zip(rows.tolist(), seq.tolist())]
                               + [torch.zeros(0, dtype=torch.int64)])
        mask_indptr = torch.zeros(len(seq) + 1, dtype=torch.int64)
        mask_indptr[1:] = torch.cumsum(q * (seq + q), 0)
        self.forward_metadata = types.SimpleNamespace(
            qo_indptr=(torch.arange(len(seq) + 1, dtype=torch.int32) * q).to(dev), kv_indptr=kv_indptr.to(dev),
            kv_indices=kv_indices.to(dev), custom_mask=getattr(fb.spec_info, "custom_mask", None),
            mask_indptr=mask_indptr.to(dev), max_extend_len=q)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None):
        o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        if save_kv_cache:
            self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        if self.enable_deterministic:
            self.unified_calls += 1   # SGLang's unified kernel: not extend_attention_fwd
            return o
        m = self.forward_metadata
        window = layer.sliding_window_size if layer.sliding_window_size is not None and \
            layer.sliding_window_size > -1 else -1
        scales = (layer.k_scale, layer.v_scale) if layer.k_scale is not None and layer.v_scale is not None \
            else (1.0, 1.0)
        self.extend_attention_fwd(
            q.view(-1, layer.tp_q_head_num, layer.qk_head_dim), k.contiguous(), v.contiguous(),
            o.view(-1, layer.tp_q_head_num, layer.v_head_dim), self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id), m.qo_indptr, m.kv_indptr, m.kv_indices,
            m.custom_mask, True, m.mask_indptr, m.max_extend_len, scales[0], scales[1], layer.scaling,
            logit_cap=layer.logit_cap, sliding_window_size=window, sinks=sinks, window_kv_offsets=None,
            xai_temperature_len=layer.xai_temperature_len)
        return o


def random_visibility(bs: int, q: int, g) -> torch.Tensor:
    """Each request a random tree over its q slots (parents before children), each slot
    seeing its ancestors and itself."""
    vis = torch.zeros(bs, q, q, dtype=torch.bool)
    for i in range(q):
        if i:
            par = torch.randint(0, i, (bs,), generator=g)
            vis[:, i] = vis[torch.arange(bs), par]
        vis[:, i, i] = True
    return vis


def verify_forward(bs: int, q: int, H: int, prefixes, layers: int, device, seed=0, mask_dtype=torch.bool,
                   max_reqs=None, width=None):
    """One target-verify forward's inputs: the pool (verify slots poisoned with NaN until a
    layer writes them), req_to_token (prefix slots, then the verify slots, then unrelated
    slots), the batch (req_pool_indices, seq_lens = prefixes, out_cache_loc), the custom mask,
    and per layer q [bs * q, H * 576] and k [bs * q, 1, 576] (v = k's first 512)."""
    g = torch.Generator().manual_seed(seed)
    prefixes = [int(p) for p in prefixes]
    assert len(prefixes) == bs
    max_reqs = max_reqs or bs + 3
    width = width or max(prefixes) + q + 5
    slots = sum(prefixes) + bs * q + width + 8
    pool = Pool(layers, slots, device)
    perm = torch.randperm(slots, generator=g)
    rows = torch.randperm(max_reqs, generator=g)[:bs]
    req_to_token = torch.randint(0, slots, (max_reqs, width), generator=g, dtype=torch.int32)
    at, out_loc = 0, []
    for i, p in enumerate(prefixes):
        req_to_token[rows[i], :p] = perm[at:at + p].int()
        req_to_token[rows[i], p:p + q] = perm[at + p:at + p + q].int()
        out_loc.append(perm[at + p:at + p + q])
        at += p + q
    out_loc = torch.cat(out_loc)
    for kv in pool.kv:
        kv[out_loc.to(device)] = float("nan")   # a verify slot read before its layer writes it: NaN
    vis = random_visibility(bs, q, g)
    mask, indptr = sglang_ref.custom_mask(vis.numpy(), np.asarray(prefixes))
    mask = torch.from_numpy(mask).to(mask_dtype)
    fb = types.SimpleNamespace(
        forward_mode=ForwardMode(True), req_pool_indices=rows.to(device),
        seq_lens=torch.tensor(prefixes, dtype=torch.int64, device=device), out_cache_loc=out_loc.to(device),
        spec_info=types.SimpleNamespace(custom_mask=mask.to(device)), batch_size=bs)
    qs = [torch.randn(bs * q, H * 576, generator=g).bfloat16().to(device) for _ in range(layers)]
    ks = [torch.randn(bs * q, 1, 576, generator=g).bfloat16().to(device) for _ in range(layers)]
    return types.SimpleNamespace(pool=pool, req_to_token=req_to_token.to(device), fb=fb, vis=vis, qs=qs, ks=ks,
                                 prefixes=prefixes, rows=rows)


def run_layers(backend: TritonAttnBackend, case, H: int):
    """The forward's attention layers in order; their outputs [bs * q, H * 512]."""
    outs = []
    for i, (qq, kk) in enumerate(zip(case.qs, case.ks)):
        outs.append(backend.forward_extend(qq, kk, kk[..., :512], layer(i, H), case.fb))
    return outs


def reference_outputs(case, q: int, H: int, scale=0.130861):
    """kdtree's float64 reference over the same forward (verify slots holding each layer's k)."""
    bs = len(case.prefixes)
    table = case.req_to_token.cpu()[case.rows.long()]
    seq = torch.tensor([p + q for p in case.prefixes], dtype=torch.int32)
    outs = []
    for i, (qq, kk) in enumerate(zip(case.qs, case.ks)):
        kv = case.pool.kv[i].cpu().clone()
        kv[case.fb.out_cache_loc.cpu()] = kk.cpu()
        o, _ = verify_attention_ref(qq.cpu().view(bs, q, H, 576), kv, table, seq, case.vis, scale)
        outs.append(o.reshape(bs * q, H * 512))
    return outs
