"""kdtree.sglang.patch_attention on the CPU: SGLang's Triton backend (a stand-in with the same
method and metadata, tests/sglang_backend.py) switched to kdtree's tree verify where it
applies, and left to SGLang's kernel, saying why, everywhere else. kdtree's kernel needs a
GPU: here VerifyAttention is replaced by the float64 reference with the same contract, so
what is checked is the patch's own work (which calls it takes, the per-forward metadata, the
mask's tree part, the KV write, the output layout); tests/test_sglang_gpu.py runs the kernel."""
import sys
import types

import numpy as np
import pytest
import torch

from kdtree.reference.attention import verify_attention_ref
from kdtree.sglang import backend, reference as sglang_ref
from kdtree.sglang.patch import PatchError
import sglang_backend as sb  # tests/sglang_backend.py

H = 2


class RefVerifyAttention:
    """VerifyAttention's contract (prepare once a forward, run a layer) in float64; it reads
    the rows and lengths at run time, as the kernel does, so a stale prepare shows."""
    made = []

    def __init__(self, bs, q, num_heads, max_seq_len, device=None):
        self.bs, self.q, self.H, self.max_seq_len = bs, q, num_heads, max_seq_len
        self.prepares = 0
        RefVerifyAttention.made.append(self)

    def prepare(self, req_pool_indices, prefix_lens):
        self.rows, self.seq = req_pool_indices, prefix_lens + self.q
        self.prepares += 1

    def run(self, q, kv_buffer, req_to_token, req_pool_indices, prefix_lens, visibility, scale, out=None):
        assert req_pool_indices is None and prefix_lens is None and req_to_token.shape[1] >= self.max_seq_len
        table = req_to_token[self.rows.long()]
        o, lse = verify_attention_ref(q.view(self.bs, self.q, self.H, 576), kv_buffer, table, self.seq.int(),
                                      visibility, scale)
        out[0].copy_(o.reshape(out[0].shape))
        out[1].copy_(lse.reshape(out[1].shape))
        return out


@pytest.fixture
def ref_kernel(monkeypatch):
    RefVerifyAttention.made = []
    monkeypatch.setattr(backend, "VerifyAttention", RefVerifyAttention)
    return RefVerifyAttention


@pytest.fixture
def patched():
    p = backend.patch_attention(sb.TritonAttnBackend, verbose=True)
    yield p
    p.undo()


def outputs(case, q):
    be = sb.TritonAttnBackend(case.pool, case.req_to_token, q)
    be.init_forward_metadata(case.fb)
    return be, sb.run_layers(be, case, H)


@pytest.mark.parametrize("bs,q,prefixes", [(1, 5, [7]), (3, 4, [0, 9, 2]), (2, 9, [33, 1])])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.uint8])
def test_patched_backend_gives_the_triton_kernels_attention(ref_kernel, patched, capsys, bs, q, prefixes,
                                                            mask_dtype):
    """The patched target verify against SGLang's own (the stand-in's float64 Triton contract),
    three layers: the same outputs, the same pool, SGLang's kernel never called, the rows and
    the mask prepared once for the forward."""
    case = sb.verify_forward(bs, q, H, prefixes, 3, "cpu", seed=bs * 10 + q, mask_dtype=mask_dtype)
    want = sb.verify_forward(bs, q, H, prefixes, 3, "cpu", seed=bs * 10 + q, mask_dtype=mask_dtype)
    be, got = outputs(case, q)
    patched.undo()
    _, ref = outputs(want, q)
    for g, w, r in zip(got, ref, sb.reference_outputs(want, q, H)):
        assert g.shape == (bs * q, H * 512) and g.dtype == torch.bfloat16
        assert torch.allclose(g.double(), r, atol=2e-2), float((g.double() - r).abs().max())
        assert torch.allclose(g.double(), w.double(), atol=3e-2)
    for a, b in zip(case.pool.kv, want.pool.kv):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))   # the same KV written, NaN-free
    assert patched.taken == 3 and not patched.left and be.kernel_calls == 0
    err = capsys.readouterr().err
    assert err.count("ran on kdtree's kernel") == 1 and f"({bs * q} query rows, {H} heads)" in err
    (va,) = ref_kernel.made
    assert va.prepares == 1 and (va.bs, va.q, va.H, va.max_seq_len) == (bs, q, H, case.req_to_token.shape[1])


def test_each_forward_prepares_its_own_metadata(ref_kernel, patched):
    """A second forward at the same batch size (other prefixes, rows and tree) starts again at
    its first layer: its outputs are its own, not the first forward's."""
    q = 4
    first = sb.verify_forward(2, q, H, [5, 3], 2, "cpu", seed=1, width=20)
    second = sb.verify_forward(2, q, H, [2, 11], 2, "cpu", seed=2, width=20)
    be = sb.TritonAttnBackend(first.pool, first.req_to_token, q)
    for case in (first, second):
        be.token_to_kv_pool, be.req_to_token = case.pool, case.req_to_token
        be.init_forward_metadata(case.fb)
        got = sb.run_layers(be, case, H)
        for g, r in zip(got, sb.reference_outputs(case, q, H)):
            assert torch.allclose(g.double(), r, atol=2e-2)
    (va,) = ref_kernel.made
    assert va.prepares == 2 and patched.taken == 4 and be.kernel_calls == 0


def test_tree_visibility_is_the_masks_tree_part():
    """The custom mask's last q columns a row, per request, for bool and uint8 masks, ragged
    prefixes (0 included), into a caller's buffer."""
    g = torch.Generator().manual_seed(3)
    for bs, q, prefixes in [(1, 1, [0]), (3, 5, [0, 17, 4]), (4, 9, [1, 0, 30, 2])]:
        vis = torch.rand(bs, q, q, generator=g) < 0.5
        mask, indptr = sglang_ref.custom_mask(vis.numpy(), np.asarray(prefixes))
        for dt in (torch.bool, torch.uint8):
            out = torch.ones(bs, q, q, dtype=torch.bool)
            backend.tree_visibility(torch.from_numpy(mask).to(dt), torch.from_numpy(indptr),
                                    torch.tensor(prefixes), bs, q, out=out)
            assert torch.equal(out, vis)
        # a padded batch's metadata (more entries than bs) is read for the first bs
        got = backend.tree_visibility(torch.from_numpy(mask), torch.from_numpy(np.r_[indptr, [0, 0]]),
                                      torch.tensor(prefixes + [3, 3], dtype=torch.int32), bs, q)
        assert torch.equal(got, vis)


def each(**attrs):
    return lambda layers, be: [setattr(x, a, v) for x in layers for a, v in attrs.items()]


@pytest.mark.parametrize("change,why,kernel_calls", [
    (each(k_scale=0.5, v_scale=0.5), "scaled K/V", 2),
    (each(logit_cap=30.0), "logit cap", 2),
    (each(sliding_window_size=128), "sliding window", 2),
    (each(xai_temperature_len=8), "attention temperature", 2),
    (each(qk_head_dim=192), "head dims 192/512", 2),
    (lambda layers, be: setattr(be, "use_mla", False), "not an MLA backend", 2),
    (lambda layers, be: setattr(be.forward_metadata, "custom_mask", None), "no custom mask", 2),
    (lambda layers, be: setattr(be, "num_draft_tokens", 3), "query rows for 2 requests", 2),
    (lambda layers, be: setattr(be, "enable_deterministic", True), "a path without extend_attention_fwd", 0),
])
def test_calls_it_does_not_compute_go_to_sglang_and_say_why_once(ref_kernel, patched, capsys, change, why,
                                                                 kernel_calls):
    """SGLang's kernel (here a stand-in that only counts) gets the call, with its own
    arguments, wherever the layer, the backend or the arguments ask for what kdtree does
    not compute; the reason is counted a call and said once."""
    q = 4
    case = sb.verify_forward(2, q, H, [6, 2], 2, "cpu", seed=5)
    be = sb.TritonAttnBackend(case.pool, case.req_to_token, q)
    be.init_forward_metadata(case.fb)
    be.extend_attention_fwd = be._count(lambda *a, **k: None)
    L = [sb.layer(i, H) for i in range(2)]
    change(L, be)
    for i, x in enumerate(L):
        be.forward_extend(case.qs[i], case.ks[i], case.ks[i][..., :512], x, case.fb)
    assert be.kernel_calls == kernel_calls and patched.taken == 0 and not ref_kernel.made
    (reason,) = patched.left
    assert why in reason and patched.left[reason] == 2
    assert capsys.readouterr().err.count("left to SGLang's Triton kernel") == 1
    assert "_TreeVerify" not in repr(be.extend_attention_fwd)   # SGLang's kernel back in place


def test_other_forward_modes_and_sinks_pass_through(ref_kernel, patched, capsys):
    q = 3
    case = sb.verify_forward(1, q, H, [4], 1, "cpu", seed=6)
    be = sb.TritonAttnBackend(case.pool, case.req_to_token, q)
    be.init_forward_metadata(case.fb)
    be.extend_attention_fwd = be._count(lambda *a, **k: None)
    case.fb.forward_mode = sb.ForwardMode(False)
    be.forward_extend(case.qs[0], case.ks[0], case.ks[0][..., :512], sb.layer(0, H), case.fb)
    assert be.kernel_calls == 1 and not patched.left and capsys.readouterr().err == ""   # prefill: not ours
    case.fb.forward_mode = sb.ForwardMode(True)
    be.forward_extend(case.qs[0], case.ks[0], case.ks[0][..., :512], sb.layer(0, H), case.fb, True,
                      torch.zeros(H))
    assert be.kernel_calls == 2 and list(patched.left) == ["attention sinks"] and not ref_kernel.made


def test_without_a_gpu_kdtree_refuses_and_sglang_computes(patched, capsys):
    """The real VerifyAttention on CPU tensors: kdtree's InputError, the call SGLang's kernel's
    with its own arguments (the float64 stand-in computes it)."""
    q = 3
    case = sb.verify_forward(1, q, H, [4], 1, "cpu", seed=8)
    be = sb.TritonAttnBackend(case.pool, case.req_to_token, q)
    be.init_forward_metadata(case.fb)
    q_in = case.qs[0].clone()
    out = be.forward_extend(q_in, case.ks[0], case.ks[0][..., :512], sb.layer(0, H), case.fb)
    assert be.kernel_calls == 1 and not torch.isnan(out).any()
    (reason,) = patched.left
    assert reason.startswith("kdtree refused the inputs:") and "CUDA" in reason


def test_a_library_that_cannot_load_leaves_the_call_to_sglang(monkeypatch, patched):
    """kdtree's library missing (or built for no arch of this GPU) is a reason, not a crash."""
    class NoLibrary:
        def __init__(self, *a, **k):
            raise RuntimeError("libkdtree is not built and could not be compiled here: no nvcc")

    monkeypatch.setattr(backend, "VerifyAttention", NoLibrary)
    q = 3
    case = sb.verify_forward(1, q, H, [4], 1, "cpu", seed=9)
    be = sb.TritonAttnBackend(case.pool, case.req_to_token, q)
    be.init_forward_metadata(case.fb)
    out = be.forward_extend(case.qs[0], case.ks[0], case.ks[0][..., :512], sb.layer(0, H), case.fb)
    assert be.kernel_calls == 1 and not torch.isnan(out).any()
    assert list(patched.left) == ["kdtree could not run: libkdtree is not built and could not be compiled here: "
                                  "no nvcc"]


def test_patch_names_what_it_replaced_and_undoes(capsys):
    original = sb.TritonAttnBackend.forward_extend
    mod = types.ModuleType(sb.BACKEND_MODULE)
    mod.TritonAttnBackend = sb.TritonAttnBackend
    with backend.patch_attention(mod) as p:
        assert sb.TritonAttnBackend.forward_extend is not original
        assert "replaced sglang_backend.TritonAttnBackend.forward_extend" in capsys.readouterr().err
        with pytest.raises(PatchError, match="already kdtree's"):
            backend.patch_attention(sb.TritonAttnBackend)
    assert sb.TritonAttnBackend.forward_extend is original and "undone" in repr(p)
    with backend.patch_attention(sb.TritonAttnBackend, verbose=False):
        assert backend.unpatch_attention() is True
    assert sb.TritonAttnBackend.forward_extend is original and backend.unpatch_attention() is False


def test_patch_refuses_what_it_does_not_know():
    class Other:
        def forward_extend(self, q, k, v, forward_batch, layer):
            pass

    mod = types.ModuleType("m")
    with pytest.raises(PatchError, match="no TritonAttnBackend class"):
        backend.patch_attention(mod)
    mod.TritonAttnBackend = Other
    with pytest.raises(PatchError, match="expected parameters"):
        backend.patch_attention(mod)
    mod.TritonAttnBackend = type("TritonAttnBackend", (), {})
    with pytest.raises(PatchError, match="not found on the class"):
        backend.patch_attention(mod)
    with pytest.raises(PatchError, match="no SGLang Triton attention backend found"):
        backend.patch_attention("kdtree_no_such_backend_module")


def test_patch_attention_from_env(monkeypatch, capsys):
    mod = types.ModuleType(sb.BACKEND_MODULE)
    mod.TritonAttnBackend = sb.TritonAttnBackend
    for name in ("sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.attention"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, sb.BACKEND_MODULE, mod)
    monkeypatch.delenv("KDTREE_SGLANG_ATTENTION", raising=False)
    assert backend.patch_attention_from_env() is None
    monkeypatch.setenv("KDTREE_SGLANG_ATTENTION", "yes")
    assert backend.patch_attention_from_env() is None and "ignored (expected 1 or 0)" in capsys.readouterr().err
    monkeypatch.setenv("KDTREE_SGLANG_ATTENTION", "1")
    p = backend.patch_attention_from_env()
    try:
        assert p is not None and p.cls is sb.TritonAttnBackend
        assert backend.patch_attention_from_env() is None   # a second time: refused aloud, not raised
        assert "KDTREE_SGLANG_ATTENTION=1 but not patched" in capsys.readouterr().err
    finally:
        p.undo()


def test_kernel_arguments_it_does_not_know_go_to_sglang():
    """extend_attention_fwd's arguments decide: an lse output, a score mod, a prefix skip, an
    unknown keyword or another positional count leave the call to SGLang's kernel; the page
    size and the CPU lengths change nothing kdtree computes."""
    q, o, kv = torch.zeros(6, 2, 576), torch.zeros(6, 2, 512), torch.zeros(9, 1, 576, dtype=torch.bfloat16)
    args = (q, None, None, o, kv, None, None, None, None, torch.ones(3), True, torch.zeros(3), 3, 1.0, 1.0, 0.13)
    assert backend._why_not_kernel(args, dict(page_size=64, extend_seq_lens_cpu=[3, 3], logit_cap=0.0)) is None
    for kw, why in [(dict(lse_extend=torch.zeros(6, 2)), "lse_extend set"), (dict(score_mod=abs), "score_mod set"),
                    (dict(skip_prefix=True), "skip_prefix set"),
                    (dict(skip_prefix_custom_mask=False), "skip_prefix_custom_mask set"),
                    (dict(new_option=1), "an argument kdtree does not know: new_option")]:
        assert backend._why_not_kernel(args, kw) == why
    assert "15 positional" in backend._why_not_kernel(args[:15], {})
    assert "not bf16" in backend._why_not_kernel(args[:4] + (kv.float(),) + args[5:], {})
    assert "not [tokens, H, 576]" in backend._why_not_kernel((o,) + args[1:], {})


def sglang_triton_backend():
    """SGLang's own TritonAttnBackend class and RadixAttention, where SGLang imports (not on CI)."""
    try:
        from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
        from sglang.srt.layers.radix_attention import RadixAttention
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
    except Exception as e:  # noqa: BLE001 - any failure to import SGLang is a skip
        pytest.skip(f"SGLang's Triton backend does not import here: {type(e).__name__}: {e}")
    return TritonAttnBackend, RadixAttention, ForwardMode


def test_patch_on_sglangs_own_backend(ref_kernel):
    """SGLang's own forward_extend (its KV write through KVWriteLoc, its paths), on an instance
    holding only what a target-verify forward reads, with the float64 Triton contract as its
    kernel: patched, the same outputs and pool, the kernel never called."""
    cls, RadixAttention, ForwardMode = sglang_triton_backend()
    bs, q = 2, 5
    case = sb.verify_forward(bs, q, H, [9, 0], 2, "cpu", seed=31)

    class Pool(sb.Pool):   # the pool of SGLang >= 0.5.23 takes a KVWriteLoc
        def set_kv_buffer(self, layer, loc, cache_k, cache_v):
            super().set_kv_buffer(layer, getattr(loc, "loc", loc), cache_k, cache_v)

    pool = Pool.__new__(Pool)
    pool.kv = case.pool.kv
    stand_in = sb.TritonAttnBackend(pool, case.req_to_token, q)
    stand_in.init_forward_metadata(case.fb)
    be = object.__new__(cls)
    for name, value in dict(token_to_kv_pool=pool, req_to_token=case.req_to_token, num_draft_tokens=q, use_mla=True,
                            enable_deterministic=False, use_dense_fp8_chunked_prefill=False, dcp_size=1,
                            use_verify_shared_kv=False, use_verify_splitkv=False, dllm_attention=None, page_size=1,
                            allow_bidirectional_attention_in_extend=False,
                            forward_metadata=types.SimpleNamespace(**vars(stand_in.forward_metadata),
                                                                   swa_out_cache_loc=None),
                            extend_attention_fwd=stand_in.extend_attention_fwd).items():
        setattr(be, name, value)
    fb = case.fb
    fb.forward_mode = ForwardMode.TARGET_VERIFY
    for name, value in dict(out_cache_loc_is_physical=False, mha_one_shot=False, attn_attend_prefix_cache=None,
                            extend_seq_lens_cpu=None).items():
        setattr(fb, name, value)
    layers = [RadixAttention(H, 576, 0.130861, 1, i, v_head_dim=512) for i in range(2)]
    with backend.patch_attention(cls, verbose=False) as p:
        got = [be.forward_extend(case.qs[i], case.ks[i], case.ks[i][..., :512], layers[i], fb) for i in range(2)]
    assert p.taken == 2 and not p.left and stand_in.kernel_calls == 0
    for g, r in zip(got, sb.reference_outputs(case, q, H)):
        assert torch.allclose(g.double(), r, atol=2e-2), float((g.double() - r).abs().max())
    want = [be.forward_extend(case.qs[i], case.ks[i], case.ks[i][..., :512], layers[i], fb) for i in range(2)]
    assert stand_in.kernel_calls == 2   # unpatched: SGLang's method calls its kernel
    for g, w in zip(got, want):
        assert torch.allclose(g.double(), w.double(), atol=3e-2)


def test_micro_batches_interleaving_layers_on_one_backend(ref_kernel, patched):
    """A batch of four run as two micro-batches of two whose layers interleave on one backend
    (A 0, B 0, A 1, B 1): each layer attends with its own micro-batch's requests and tree."""
    q = 4
    case = sb.verify_forward(4, q, H, [5, 3, 7, 1], 2, "cpu", seed=41)
    be = sb.TritonAttnBackend(case.pool, case.req_to_token, q)
    halves, meta = [], []
    for part in (slice(0, 2), slice(2, 4)):
        rows = slice(part.start * q, part.stop * q)
        mask, _ = sglang_ref.custom_mask(case.vis[part].numpy(), np.asarray(case.prefixes[part]))
        fb = types.SimpleNamespace(
            forward_mode=sb.ForwardMode(True), req_pool_indices=case.fb.req_pool_indices[part].clone(),
            seq_lens=case.fb.seq_lens[part].clone(), out_cache_loc=case.fb.out_cache_loc[rows].clone(),
            spec_info=types.SimpleNamespace(custom_mask=torch.from_numpy(mask)), batch_size=2)
        be.init_forward_metadata(fb)
        halves.append((fb, rows))
        meta.append(be.forward_metadata)
    got = [[], []]
    for i in range(2):
        for h, (fb, rows) in enumerate(halves):
            be.forward_metadata = meta[h]
            k = case.ks[i][rows]
            got[h].append(be.forward_extend(case.qs[i][rows], k, k[..., :512], sb.layer(i, H), fb))
    for i, r in enumerate(sb.reference_outputs(case, q, H)):
        g = torch.cat([got[0][i], got[1][i]])
        assert torch.allclose(g.double(), r, atol=2e-2), float((g.double() - r).abs().max())
    assert patched.taken == 4 and be.kernel_calls == 0 and ref_kernel.made[0].prepares == 4
