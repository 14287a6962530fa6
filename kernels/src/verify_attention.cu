// Tree-verify attention in MLA absorbed form (spec verify_attention.md).
//
// All H heads share one latent KV head, so a request's D*H query rows (slot-major,
// row = i*H + h) are one matrix against one key matrix. A CTA takes a tile of ROWS
// query rows of one request and one split of its keys, streams the keys through
// shared memory in tiles of 32 (cp.async, STAGES-deep ring) and keeps an online
// softmax in float32. Warps come in pairs per 16-row block (SW pairs):
//   S = Q K^T:    warp half h of a pair takes keys 16h..16h+15 of the tile, with four
//                 independent accumulator sets (k-steps mod 4) so the tensor pipe is not
//                 waiting on one dependent chain (v1 was latency-bound: ncu "wait" stalls);
//   softmax:      the pair swaps row maxima through shared memory (64-thread named
//                 barrier), each warp keeps the row sum of its own keys;
//   O += P V:     warp half h owns output columns 256h..256h+255 of the pair's rows,
//                 so the rescale factors stay in registers.
// One __syncthreads per key tile. With one split the CTA writes out/lse; with several
// it writes bf16 partials that the combine kernel (verify_combine.cu) merges.
#include "mma.cuh"
#include "verify_common.cuh"

namespace kd {
namespace {

constexpr int LD = QK_DIM + 8;      // padded row stride (elements): conflict-free ldmatrix
constexpr int CHUNKS = QK_DIM / 8;  // 16-byte chunks per cache row (72)
constexpr int KEYS = 32;            // keys per shared-memory tile (16 per warp in S = QK^T)
constexpr int PLD = KEYS + 8;       // P row stride

// SW warp pairs (16 query rows each), a ring of STAGES key tiles.
template <int SW_, int STAGES_>
struct Tile {
  static constexpr int SW = SW_;
  static constexpr int STAGES = STAGES_;
  static constexpr int ROWS = 16 * SW;
  static constexpr int THREADS = 64 * SW;
  static constexpr size_t SMEM_Q = (size_t)ROWS * LD * 2;
  static constexpr size_t SMEM_KV = (size_t)KEYS * LD * 2;
  static constexpr size_t SMEM_P = (size_t)ROWS * PLD * 2;
  static constexpr size_t SMEM_BYTES = SMEM_Q + STAGES * SMEM_KV + SMEM_P + 4 * ROWS * sizeof(float);
};
// Hopper (227 KB per block): 64 or 32 rows with a 3-deep ring (193 / 153 KB).
// 16 rows (small trees; all of sm_120, 99 KB per block): double buffered, 95 KB, so
// two CTAs share a Hopper SM.
using Tile64 = Tile<4, 3>;
using Tile32 = Tile<2, 3>;
using Tile16 = Tile<1, 2>;

using Params = VerifyParams;

// The two warps of a pair meet here (ids 1..SW; 0 is __syncthreads).
__device__ __forceinline__ void pair_barrier(int pair) {
  asm volatile("bar.sync %0, 64;\n" ::"r"(pair + 1) : "memory");
}

// Async load of key rows [k0, k0 + KEYS) of request b into a tile; rows at or past
// `end` are zero-filled so no NaN from unused pages can reach P*V. Warp w takes rows
// [w*RW, w*RW + RW): its first RW lanes look their row's page up at once (one round
// trip, not one per row), then the warp walks the RW*72 16-byte chunks in whole
// 32-lane steps (no divergence; ncu showed v1/v2's per-chunk and per-row lookups and
// their branches as the memory-bound kernel's top stalls).
template <class T>
__device__ __forceinline__ void load_kv_tile(const Params& p, const int32_t* table, int k0, int end,
                                             __nv_bfloat16* tile) {
  constexpr int WARPS = T::THREADS / 32;
  constexpr int RW = KEYS / WARPS;  // rows per warp: 16, 8 or 4
  static_assert(RW * CHUNKS % 32 == 0, "whole 32-lane steps");
  const int lane = threadIdx.x & 31, r0 = (threadIdx.x >> 5) * RW;
  size_t row_off = 0;  // element offset of this lane's row in the cache
  int row_ok = 0;
  if (lane < RW) {
    const int pos = k0 + r0 + lane;
    if (pos < end) {
      row_off = cache_row(p, table, pos);
      row_ok = 1;
    }
  }
#pragma unroll
  for (int q = lane; q < RW * CHUNKS; q += 32) {
    const int r = q / CHUNKS, c = q - r * CHUNKS;
    const size_t off = __shfl_sync(0xffffffffu, row_off, r);
    const int ok = __shfl_sync(0xffffffffu, row_ok, r);
    cp_async16(tile + (r0 + r) * LD + c * 8, ok ? p.kv + off + c * 8 : p.kv, ok ? 16 : 0);
  }
}

template <class T>
__global__ void __launch_bounds__(T::THREADS, T::SW == 1 ? 2 : 1) verify_attention_kernel(Params p) {
  constexpr int ROWS = T::ROWS, THREADS = T::THREADS, SW = T::SW, STAGES = T::STAGES;
  extern __shared__ __align__(128) unsigned char smem[];
  __nv_bfloat16* sQ = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* sKV0 = reinterpret_cast<__nv_bfloat16*>(smem + T::SMEM_Q);
  __nv_bfloat16* sP = reinterpret_cast<__nv_bfloat16*>(smem + T::SMEM_Q + STAGES * T::SMEM_KV);
  float* sMax = reinterpret_cast<float*>(smem + T::SMEM_Q + STAGES * T::SMEM_KV + T::SMEM_P);
  float* sSum = sMax + 2 * ROWS;  // [half][row], exchanged once at the end

  const int m0 = blockIdx.x * ROWS, split = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int pair = warp % SW, half = warp / SW;
  const int qrow = pair * 16;          // the pair's 16 rows within the tile
  const int col0 = half * 256;         // this warp's output columns
  const int key0 = half * 16;          // this warp's keys within a tile, for S
  const int32_t* table = p.block_table + (size_t)b * p.max_pages;
  const SplitKeys ks = split_keys(p, b, split, KEYS);  // this split's keys, in whole tiles
  const int P = ks.P, k_begin = ks.begin, k_end = ks.end, ntiles = ks.ntiles;

  // Q tile (rows past R zero-filled) rides in the first group with key tile 0.
  for (int c = tid; c < ROWS * CHUNKS; c += THREADS) {
    const int r = c / CHUNKS, col = (c % CHUNKS) * 8;
    const bool ok = m0 + r < p.R;
    const __nv_bfloat16* src = ok ? p.q + ((size_t)b * p.R + m0 + r) * QK_DIM + col : p.q;
    cp_async16(sQ + r * LD + col, src, ok ? 16 : 0);
  }
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (st < ntiles) load_kv_tile<T>(p, table, k_begin + st * KEYS, k_end, sKV0 + st * KEYS * LD);
    cp_async_commit();
  }

  float o[32][4];
#pragma unroll
  for (int j = 0; j < 32; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  const auto o_at = [&](int j, int e) -> float& { return o[j][e]; };
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};  // l: this warp's keys
  // Tree slot of this thread's two rows (g, g+8), for the mask.
  const int slot0 = (m0 + qrow + g) / p.H, slot1 = (m0 + qrow + g + 8) / p.H;

  for (int it = 0; it < ntiles; ++it) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile `it` landed everywhere; every warp is done with tile it-1
    {
      const int nx = it + STAGES - 1;  // refill the slot tile it-1 used
      if (nx < ntiles) load_kv_tile<T>(p, table, k_begin + nx * KEYS, k_end, sKV0 + (nx % STAGES) * KEYS * LD);
      cp_async_commit();
    }
    const int k0 = k_begin + it * KEYS;
    const __nv_bfloat16* sK = sKV0 + (it % STAGES) * KEYS * LD;

    // S = Q K^T for 16 rows x this warp's 16 keys; 4 accumulator sets break the chain.
    float acc[4][2][4];
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int j = 0; j < 2; ++j) acc[u][j][0] = acc[u][j][1] = acc[u][j][2] = acc[u][j][3] = 0.f;
#pragma unroll
    for (int kq = 0; kq < QK_DIM / 16; kq += 4) {  // fully unrolled: immediate smem offsets
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int kk = kq + u;
        uint32_t a[4], bb[4];
        ldmatrix_x4(a, sQ + (qrow + (lane & 7) + 8 * ((lane >> 3) & 1)) * LD + kk * 16 + 8 * (lane >> 4));
        const int mi = lane >> 3;
        ldmatrix_x4(bb, sK + (key0 + (lane & 7) + 8 * (mi >> 1)) * LD + kk * 16 + 8 * (mi & 1));
        mma_bf16(acc[u][0], a, bb[0], bb[1]);
        mma_bf16(acc[u][1], a, bb[2], bb[3]);
      }
    }
    float s[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = (acc[0][j][e] + acc[1][j][e]) + (acc[2][j][e] + acc[3][j][e]);

    // Scale into the log2 domain and mask: keys past the range, and tree keys the
    // slot does not see (ancestors and itself only; prefix tiles skip the lookups).
    float mx[2] = {-INFINITY, -INFINITY};
    const auto scale_keep = [&](auto keep) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[j][e] = keep(k0 + key0 + j * 8 + 2 * t + (e & 1), e < 2 ? slot0 : slot1) ? s[j][e] * p.scale_log2
                                                                                     : -INFINITY;
          mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
        }
      }
    };
    if (k0 + KEYS <= min(P, k_end)) {
      scale_keep([](int, int) { return true; });
    } else {
      with_vis_format(p, [&](auto bits) {
        scale_keep([&](int key, int slot) { return attends<decltype(bits)::value>(p, b, slot, key, P, k_end); });
      });
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
    }
    if (t == 0) { sMax[half * ROWS + qrow + g] = mx[0]; sMax[half * ROWS + qrow + g + 8] = mx[1]; }
    pair_barrier(pair);
    float alpha[2], msafe[2], sum[2] = {0.f, 0.f};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float other = sMax[(half ^ 1) * ROWS + qrow + g + 8 * h];
      const float m_new = fmaxf(m_run[h], fmaxf(mx[h], other));  // the same in both warps
      msafe[h] = m_new == -INFINITY ? 0.f : m_new;  // fully masked so far: keep zeros
      alpha[h] = exp2f(m_run[h] - msafe[h]);
      m_run[h] = m_new;
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float p0 = exp2f(s[j][0] - msafe[0]), p1 = exp2f(s[j][1] - msafe[0]);
      const float p2 = exp2f(s[j][2] - msafe[1]), p3 = exp2f(s[j][3] - msafe[1]);
      sum[0] += p0 + p1;
      sum[1] += p2 + p3;
      const int c = key0 + j * 8 + 2 * t;
      *reinterpret_cast<uint32_t*>(sP + (qrow + g) * PLD + c) = pack_bf16(p0, p1);
      *reinterpret_cast<uint32_t*>(sP + (qrow + g + 8) * PLD + c) = pack_bf16(p2, p3);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 1);
      sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 2);
      l_run[h] = l_run[h] * alpha[h] + sum[h];
    }
    rescale_rows(alpha, o_at);
    pair_barrier(pair);  // both halves of P are in shared memory

    // O += P V over this warp's 256 columns (all 32 keys of the tile).
#pragma unroll
    for (int kk = 0; kk < KEYS / 16; ++kk) {
      uint32_t a[4];
      ldmatrix_x4(a, sP + (qrow + (lane & 7) + 8 * ((lane >> 3) & 1)) * PLD + kk * 16 + 8 * (lane >> 4));
#pragma unroll
      for (int jp = 0; jp < 16; ++jp) {
        uint32_t bb[4];
        const int mi = lane >> 3;
        ldmatrix_x4_trans(bb, sK + (kk * 16 + (lane & 7) + 8 * (mi & 1)) * LD + col0 + jp * 16 +
                                  8 * (mi >> 1));
        mma_bf16(o[2 * jp], a, bb[0], bb[1]);
        mma_bf16(o[2 * jp + 1], a, bb[2], bb[3]);
      }
    }
  }
  cp_async_wait<0>();
  pdl_launch_dependents();  // the combine (if any) may be scheduled: it waits for our stores

  // Row sums: this warp's keys plus the partner's.
  if (t == 0) { sSum[half * ROWS + qrow + g] = l_run[0]; sSum[half * ROWS + qrow + g + 8] = l_run[1]; }
  pair_barrier(pair);

  const float l[2] = {sSum[qrow + g] + sSum[ROWS + qrow + g], sSum[qrow + g + 8] + sSum[ROWS + qrow + g + 8]};
  write_rows(p, b, split, m0 + qrow + g, col0, t, l, m_run, half == 0 && t == 0, o_at);
}

}  // namespace
}  // namespace kd

namespace kd {
namespace {

// The tile for R query rows on this device: the wgmma kernel on Hopper (sm_90a in the
// build), except for a small launch of one 64-row tile; otherwise the fewest mma.sync rows
// that cover R (no idle warps on small trees), as far as the device's shared memory per
// block allows.
enum class TileKind { WGMMA, T64, T32, T16 };

int g_verify_path = 0;  // kd_verify_set_path: 0 auto; 1 mma.sync only; 2 wgmma by cp.async;
                        // 3 splits through the combine kernel

// A launch too small for every SM to get one of the mma.sync kernel's 32-key tiles:
// 2 * B * ceil(max_seq / 64) < SMs. There, for one row tile (R <= 64), mma.sync splits of a
// single 32-key tile finish sooner than the wgmma kernel's 64-key ones; from there on the
// wgmma kernel wins at any R, small trees included (H200, same run, H 8, D 1: B 1, P 1k
// 8.2 us mma.sync vs 11.2 wgmma; B 1, P 8k 15.0 vs 12.5; B 1, P 32k 28.1 vs 20.0; B 16, P 8k
// 53.3 vs 46.2; kernels/NOTES.md v8).
bool small_launch(const DeviceFacts& d, int B, long long max_seq) {
  return 2LL * B * ((max_seq + 63) / 64) < d.sms;
}

TileKind pick_tile(const DeviceFacts& d, int R, bool small) {
  const size_t room = (size_t)d.smem_optin;
  bool wgmma = false;
#ifdef KD_HAS_SM90A
  wgmma = g_verify_path != 1 && d.major == 9 && d.minor == 0 && (R > WGMMA_ROWS || !small) &&
          room >= verify_wgmma_smem_bytes();
#else
  (void)small;
#endif
  if (wgmma) return TileKind::WGMMA;
  if (R > 32 && room >= Tile64::SMEM_BYTES) return TileKind::T64;
  if (R > 16 && room >= Tile32::SMEM_BYTES) return TileKind::T32;
  return TileKind::T16;
}

// Calls f with a value of the mma.sync tile type of `k` (not WGMMA: that kernel is apart).
template <class F>
int with_tile(TileKind k, F f) {
  switch (k) {
    case TileKind::T64: return f(Tile64{});
    case TileKind::T32: return f(Tile32{});
    default: return f(Tile16{});
  }
}

int tile_rows(TileKind k) {
  if (k == TileKind::WGMMA) return WGMMA_ROWS;
  return with_tile(k, [](auto tile) { return decltype(tile)::ROWS; });
}

template <class T>
int ctas_per_sm(int* n) {
  cudaError_t e = cudaFuncSetAttribute(verify_attention_kernel<T>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)T::SMEM_BYTES);
  if (e == cudaSuccess)
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, verify_attention_kernel<T>, T::THREADS,
                                                      T::SMEM_BYTES);
  return (int)e;
}

template <class T>
int launch(const Params& p, int B, cudaStream_t st) {
  cudaError_t e = cudaFuncSetAttribute(verify_attention_kernel<T>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)T::SMEM_BYTES);
  if (e != cudaSuccess) return (int)e;
  dim3 grid(ceil_div(p.R, T::ROWS), p.num_splits, B);
  verify_attention_kernel<T><<<grid, T::THREADS, T::SMEM_BYTES, st>>>(p);
  KD_LAUNCH_CHECK();
  return 0;
}

}  // namespace
}  // namespace kd

#ifdef KD_VERIFY_PROFILE
namespace kd { long long* g_stamps = nullptr; }
extern "C" void kd_verify_profile_buffer(void* buf) { kd::g_stamps = static_cast<long long*>(buf); }
#endif

extern "C" int kd_verify_small_launch(int B, int max_seq, int* small) {
  if (B < 0 || max_seq < 0) return KD_ERR_ARGUMENT;
  const kd::DeviceFacts* d = nullptr;
  const int err = kd::device_facts(&d);
  if (err) return err;
  *small = kd::small_launch(*d, B, max_seq);
  return 0;
}

extern "C" int kd_verify_tile(int R, int page_size, int small, int* rows_per_cta, int* keys_per_tile,
                              int* wave_ctas, int* copy_path) {
  if (R < 1 || page_size < 1) return KD_ERR_ARGUMENT;
  const kd::DeviceFacts* d = nullptr;
  int err = kd::device_facts(&d);
  if (err) return err;
  const kd::TileKind kind = kd::pick_tile(*d, R, small != 0);
  *rows_per_cta = kd::tile_rows(kind);
  *keys_per_tile = kind == kd::TileKind::WGMMA ? kd::WGMMA_KEYS : kd::KEYS;
  *copy_path = 0;
#ifdef KD_HAS_SM90A
  if (kind == kd::TileKind::WGMMA) {
    *copy_path = kd::verify_wgmma_copy_path(R, page_size);
    return kd::verify_wgmma_wave(R, page_size, wave_ctas);
  }
#endif
  int per_sm = 0;
  err = kd::with_tile(kind, [&](auto tile) { return kd::ctas_per_sm<decltype(tile)>(&per_sm); });
  if (err) return err;
  *wave_ctas = d->sms * (per_sm > 0 ? per_sm : 1);
  return 0;
}

extern "C" int kd_verify_set_path(int path) {
  if (path < 0 || path > 3) return -1;
  const int old = kd::g_verify_path;
  kd::g_verify_path = path;
#ifdef KD_HAS_SM90A
  kd::verify_wgmma_set_path(path);
#endif
  return old;
}

extern "C" int kd_verify_merges(int B, int R, int page_size, int num_splits, int small, int* merges) {
  if (B < 0 || R < 1 || page_size < 1 || num_splits < 1) return KD_ERR_ARGUMENT;
  const kd::DeviceFacts* d = nullptr;
  const int err = kd::device_facts(&d);
  if (err) return err;
  const kd::TileKind kind = kd::pick_tile(*d, R, small != 0);
  *merges = 0;
#ifdef KD_HAS_SM90A
  if (kind == kd::TileKind::WGMMA) *merges = kd::verify_wgmma_merges(B, R, page_size, num_splits);
#endif
  return 0;
}

extern "C" int kd_verify_attention(const void* q, const void* kv_cache, const int32_t* block_table,
                                   const int32_t* seq_lens, const void* visibility, int vis_bits,
                                   int B, int D, int H, int page_size, int num_pages, int max_pages,
                                   float scale,
                                   int num_splits, void* out, float* lse, void* partial_out,
                                   float* partial_lse, void* stream) {
  if (B < 0 || D < 1 || H < 1 || page_size < 1 || num_pages < 1 || max_pages < 1 || num_splits < 1)
    return KD_ERR_ARGUMENT;
  if (num_splits > 1 && (!partial_out || !partial_lse)) return KD_ERR_ARGUMENT;
  if (num_splits > kd::MAX_SPLITS) return KD_ERR_ARGUMENT;
  const auto misaligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 != 0; };
  if (misaligned(q) || misaligned(kv_cache) || misaligned(out) || misaligned(partial_out)) return KD_ERR_ARGUMENT;
  if (B == 0) return 0;
  kd::Params p;
  p.q = static_cast<const __nv_bfloat16*>(q);
  p.kv = static_cast<const __nv_bfloat16*>(kv_cache);
  p.block_table = block_table;
  p.seq_lens = seq_lens;
  p.vis = visibility;
  p.vis_bits = vis_bits;
  p.D = D; p.H = H; p.R = D * H;
  p.page_size = page_size; p.num_pages = num_pages; p.max_pages = max_pages; p.num_splits = num_splits;
  p.page_shift = (page_size & (page_size - 1)) == 0 ? __builtin_ctz((unsigned)page_size) : -1;
  p.scale_log2 = scale * kd::LOG2E;
  p.out = static_cast<__nv_bfloat16*>(out);
  p.lse = lse;
  p.part_out = static_cast<__nv_bfloat16*>(partial_out);
  p.part_lse = partial_lse;
#ifdef KD_VERIFY_PROFILE
  p.stamps = kd::g_stamps;
#endif
  cudaStream_t st = (cudaStream_t)stream;
  const kd::DeviceFacts* d = nullptr;
  int rc = kd::device_facts(&d);
  if (rc) return rc;
  const bool small = kd::small_launch(*d, B, (long long)max_pages * page_size);
  const kd::TileKind kind = kd::pick_tile(*d, p.R, small);
  bool merged = false;  // the splits merged in the attention kernel (clusters on Hopper)
#ifdef KD_HAS_SM90A
  if (kind == kd::TileKind::WGMMA) rc = kd::launch_verify_wgmma(p, B, st, &merged);
  else
#endif
    rc = kd::with_tile(kind, [&](auto tile) { return kd::launch<decltype(tile)>(p, B, st); });
  if (rc) return rc;
  // The combine as a programmatic dependent after the mma.sync kernel on Hopper only: a
  // same-run A/B on the H200 (kernels/NOTES.md, session 15) measured it 0.5-1 us faster
  // there, and mixed after the wgmma kernel (up to 1.7 us slower at batch 1). sm_120 is
  // not measured, so it keeps the plain launch.
  if (num_splits == 1 || merged) return 0;
  return kd::launch_verify_combine(p, B, st, kind != kd::TileKind::WGMMA && d->major == 9);
}
