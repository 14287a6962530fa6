// Tree-verify attention in MLA absorbed form (spec verify_attention.md).
//
// All H heads share one latent KV head, so a request's D*H query rows (slot-major,
// row = i*H + h) are one matrix against one key matrix. A CTA takes a tile of ROWS
// query rows of one request and one split of its keys, streams the keys through
// shared memory in tiles of KEYS (32; 16 in sm_120's 32-row tile) by cp.async into a
// STAGES-deep ring, and keeps an online softmax in float32. Warps come in groups of WPR
// (2 or 4) per 16-row block (SW groups):
//   S = Q K^T:    warp part h of a group takes keys h KEYS / WPR.. of the tile (16 or 8), with
//                 four independent accumulator sets (k-steps mod 4) so the tensor pipe is
//                 not waiting on one dependent chain (v1 was latency-bound: ncu "wait");
//   softmax:      the group swaps row maxima through shared memory (a named barrier of
//                 its warps), each warp keeps the row sum of its own keys;
//   O += P V:     warp part h owns output columns 512h/WPR.. of the group's rows (256 or
//                 128), so the rescale factors stay in registers.
// One __syncthreads per key tile. With one split the CTA writes out/lse; with several
// it writes bf16 partials that the combine kernel (verify_combine.cu) merges.
#include <algorithm>

#include "mma.cuh"
#include "verify_common.cuh"

namespace kd {
namespace {

constexpr int LD = QK_DIM + 8;      // padded row stride (elements): conflict-free ldmatrix
constexpr int CHUNKS = QK_DIM / 8;  // 16-byte chunks per cache row (72)

// SW groups of WPR warps (16 query rows a group), a ring of STAGES tiles of KEYS keys.
template <int SW_, int STAGES_, int WPR_, int KEYS_ = MMA_KEYS>
struct Tile {
  static constexpr int SW = SW_;
  static constexpr int STAGES = STAGES_;
  static constexpr int WPR = WPR_;
  static constexpr int KEYS = KEYS_;     // keys a shared-memory tile (KEYS / WPR a warp in S)
  static constexpr int PLD = KEYS + 8;   // P row stride
  static constexpr int ROWS = 16 * SW;
  static constexpr int THREADS = 32 * WPR * SW;
  static constexpr size_t SMEM_Q = (size_t)ROWS * LD * 2;
  static constexpr size_t SMEM_KV = (size_t)KEYS * LD * 2;
  static constexpr size_t SMEM_P = (size_t)ROWS * PLD * 2;
  static constexpr size_t SMEM_BYTES = SMEM_Q + STAGES * SMEM_KV + SMEM_P + 2 * WPR * ROWS * sizeof(float);
};
// Hopper (227 KB per block): 64 or 32 rows with a 3-deep ring (193 / 153 KB).
// 16 rows (trees of at most 16 rows; sm_120's 99 KB a block holds no larger tile of 32-key
// slots): double buffered, 95 KB, on four warps: sm_120 holds one such CTA an SM, whose four
// sub-partitions each need a warp to issue to their tensor core (two CTAs share a Hopper SM).
using Tile64 = Tile<4, 3, 2>;
using Tile32 = Tile<2, 3, 2>;
using Tile16 = Tile<1, 2, 4>;
// sm_120's 32-row tile: tiles of 16 keys, so Q and three of them fit 99 KB (95 KB).
using Tile32k16 = Tile<2, 3, 2, 16>;

// Probe builds that hold Hopper to sm_120's tiles (docs/kernels/verify_attention.md, session
// 83): KD_MMA_SMEM_OPTIN caps the shared memory a block may take (sm_120: 101,376 bytes), and
// KD_MMA_SMEM_PAD adds dynamic shared memory to every CTA so an SM holds one 16-row CTA.
#ifndef KD_MMA_SMEM_OPTIN
#define KD_MMA_SMEM_OPTIN (1 << 30)
#endif
#ifndef KD_MMA_SMEM_PAD
#define KD_MMA_SMEM_PAD 0
#endif
template <class T>
constexpr int launch_smem() { return (int)T::SMEM_BYTES + KD_MMA_SMEM_PAD; }

using Params = VerifyParams;

// The WPR warps of a group meet here (ids 1..SW; 0 is __syncthreads).
template <int WPR>
__device__ __forceinline__ void group_barrier(int group) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(group + 1), "n"(32 * WPR) : "memory");
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
  constexpr int WARPS = T::THREADS / 32, KEYS = T::KEYS;
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

// PER_REQUEST: each request takes its own split count (plans with split_base != 0:
// split_keys); a separate build so that other plans run the kernel without it.
template <class T, bool PER_REQUEST>
__global__ void __launch_bounds__(T::THREADS, T::SW == 1 ? 2 : 1) verify_attention_kernel(Params p) {
  constexpr int ROWS = T::ROWS, THREADS = T::THREADS, SW = T::SW, STAGES = T::STAGES, WPR = T::WPR;
  constexpr int KEYS = T::KEYS, PLD = T::PLD;
  constexpr int KW = KEYS / WPR;     // a warp's keys in S: 16 or 8
  constexpr int NB = KW / 8;         // its 8-key blocks
  constexpr int OJ = V_DIM / WPR / 8;  // its 8-column blocks of O: 32 or 16
  extern __shared__ __align__(128) unsigned char smem[];
  __nv_bfloat16* sQ = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* sKV0 = reinterpret_cast<__nv_bfloat16*>(smem + T::SMEM_Q);
  __nv_bfloat16* sP = reinterpret_cast<__nv_bfloat16*>(smem + T::SMEM_Q + STAGES * T::SMEM_KV);
  float* sMax = reinterpret_cast<float*>(smem + T::SMEM_Q + STAGES * T::SMEM_KV + T::SMEM_P);
  float* sSum = sMax + WPR * ROWS;  // [part][row], exchanged once at the end

  const VerifyCta cta = VerifyGrid<PER_REQUEST>::at(p, ROWS);
  const int m0 = cta.tile * ROWS, split = cta.split, b = cta.b;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int group = warp % SW, part = warp / SW;
  const int qrow = group * 16;         // the group's 16 rows within the tile
  const int col0 = part * (8 * OJ);    // this warp's output columns
  const int key0 = part * KW;          // this warp's keys within a tile, for S
  const int32_t* table = request_table(p, b);
  const SplitKeys ks = split_keys<PER_REQUEST>(p, cta, KEYS, ROWS);  // this split's keys, in whole tiles
  const int P = ks.P, k_begin = ks.begin, k_end = ks.end, ntiles = ks.ntiles;
  if constexpr (PER_REQUEST) {
    if (empty_split(cta, ks)) {  // a short request's later split: only its LSEs
      write_empty_split(p, b, split, m0, ROWS, ks.alone);
      return;
    }
  }

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

  float o[OJ][4];
#pragma unroll
  for (int j = 0; j < OJ; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
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

    // S = Q K^T for 16 rows x this warp's KW keys; 4 accumulator sets break the chain.
    float acc[4][NB][4];
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int j = 0; j < NB; ++j) acc[u][j][0] = acc[u][j][1] = acc[u][j][2] = acc[u][j][3] = 0.f;
#pragma unroll
    for (int kq = 0; kq < QK_DIM / 16; kq += 4) {  // fully unrolled: immediate smem offsets
      uint32_t bb[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int kk = kq + u;
        uint32_t a[4];
        ldmatrix_x4(a, sQ + (qrow + (lane & 7) + 8 * ((lane >> 3) & 1)) * LD + kk * 16 + 8 * (lane >> 4));
        const int mi = lane >> 3;
        if constexpr (NB == 2) {  // keys 0-7 and 8-15 of this k-step
          ldmatrix_x4(bb, sK + (key0 + (lane & 7) + 8 * (mi >> 1)) * LD + kk * 16 + 8 * (mi & 1));
          mma_bf16(acc[u][0], a, bb[0], bb[1]);
          mma_bf16(acc[u][1], a, bb[2], bb[3]);
        } else {  // 8 keys: one load brings this k-step and the next
          if ((u & 1) == 0) ldmatrix_x4(bb, sK + (key0 + (lane & 7)) * LD + kk * 16 + 8 * mi);
          mma_bf16(acc[u][0], a, bb[2 * (u & 1)], bb[2 * (u & 1) + 1]);
        }
      }
    }
    float s[NB][4];
#pragma unroll
    for (int j = 0; j < NB; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = (acc[0][j][e] + acc[1][j][e]) + (acc[2][j][e] + acc[3][j][e]);

    // Scale into the log2 domain and mask: keys past the range, and tree keys the
    // slot does not see (ancestors and itself only; prefix tiles skip the lookups).
    float mx[2] = {-INFINITY, -INFINITY};
    const auto scale_keep = [&](auto keep) {
#pragma unroll
      for (int j = 0; j < NB; ++j) {
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
      mx[h] = quad_max(mx[h]);
    }
    if (t == 0) { sMax[part * ROWS + qrow + g] = mx[0]; sMax[part * ROWS + qrow + g + 8] = mx[1]; }
    group_barrier<WPR>(group);
    float alpha[2], msafe[2], sum[2] = {0.f, 0.f};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float row_max = sMax[qrow + g + 8 * h];
#pragma unroll
      for (int q = 1; q < WPR; ++q) row_max = fmaxf(row_max, sMax[q * ROWS + qrow + g + 8 * h]);
      const float m_new = running_max(m_run[h], row_max);  // the same in every warp of the group
      msafe[h] = m_new == -INFINITY ? 0.f : m_new;  // fully masked so far: keep zeros
      alpha[h] = exp2f(m_run[h] - msafe[h]);
      m_run[h] = m_new;
    }
#pragma unroll
    for (int j = 0; j < NB; ++j) {
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
      l_run[h] = l_run[h] * alpha[h] + quad_sum(sum[h]);
    }
    rescale_rows<OJ>(alpha, o_at);
    group_barrier<WPR>(group);  // every part of P is in shared memory

    // O += P V over this warp's 8 * OJ columns (all KEYS keys of the tile).
#pragma unroll
    for (int kk = 0; kk < KEYS / 16; ++kk) {
      uint32_t a[4];
      ldmatrix_x4(a, sP + (qrow + (lane & 7) + 8 * ((lane >> 3) & 1)) * PLD + kk * 16 + 8 * (lane >> 4));
#pragma unroll
      for (int jp = 0; jp < OJ / 2; ++jp) {
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

  // Row sums: this warp's keys plus the rest of the group's.
  if (t == 0) { sSum[part * ROWS + qrow + g] = l_run[0]; sSum[part * ROWS + qrow + g + 8] = l_run[1]; }
  group_barrier<WPR>(group);

  float l[2] = {0.f, 0.f};
#pragma unroll
  for (int q = 0; q < WPR; ++q) { l[0] += sSum[q * ROWS + qrow + g]; l[1] += sSum[q * ROWS + qrow + g + 8]; }
  write_rows<OJ>(p, b, split, m0 + qrow + g, col0, t, l, m_run, part == 0 && t == 0,
                 writes_output(p, ks), o_at);
}

}  // namespace
}  // namespace kd

namespace kd {
namespace {

// Calls f with a value of the mma.sync tile type that `tile` names.
template <class F>
int with_tile(MmaTile tile, F f) {
  switch (tile.rows) {
    case Tile64::ROWS: return f(Tile64{});
    case Tile32::ROWS: return tile.keys == Tile32k16::KEYS ? f(Tile32k16{}) : f(Tile32{});
    default: return f(Tile16{});
  }
}

template <class T>
int ctas_per_sm(int* n) {
  cudaError_t e = configure_once<verify_attention_kernel<T, false>>(launch_smem<T>());
  if (e == cudaSuccess)
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, verify_attention_kernel<T, false>, T::THREADS,
                                                      launch_smem<T>());
  return (int)e;
}

template <class T, bool PER_REQUEST>
int launch_as(const Params& p, int B, cudaStream_t st) {
  const cudaError_t e = configure_once<verify_attention_kernel<T, PER_REQUEST>>(launch_smem<T>());
  if (e != cudaSuccess) return (int)e;
  const dim3 grid = VerifyGrid<PER_REQUEST>::dims(ceil_div(p.R, T::ROWS), p.num_splits, B,
                                                  p.split_base == TAIL_SPLITS);
  verify_attention_kernel<T, PER_REQUEST><<<grid, T::THREADS, launch_smem<T>(), st>>>(p);
  KD_LAUNCH_CHECK();
  return 0;
}

template <class T>
int launch(const Params& p, int B, cudaStream_t st) {
  return p.split_base != 0 ? launch_as<T, true>(p, B, st) : launch_as<T, false>(p, B, st);
}

}  // namespace

// The fewest mma.sync rows that cover R (no idle warps on small trees), as far as the
// device's shared memory per block allows, with their key slots (16 keys where 32 do not fit).
MmaTile verify_mma_tile(const DeviceFacts& d, int R) {
  const size_t room = std::min((size_t)d.smem_optin, (size_t)KD_MMA_SMEM_OPTIN);
  if (R > 32 && room >= Tile64::SMEM_BYTES) return {Tile64::ROWS, Tile64::KEYS};
  if (R > 16 && room >= Tile32::SMEM_BYTES) return {Tile32::ROWS, Tile32::KEYS};
  if (R > 16 && room >= Tile32k16::SMEM_BYTES) return {Tile32k16::ROWS, Tile32k16::KEYS};
  return {Tile16::ROWS, Tile16::KEYS};
}

int verify_mma_wave(const DeviceFacts& d, MmaTile tile, int* ctas) {
  int per_sm = 0;
  const int err = with_tile(tile, [&](auto t) { return ctas_per_sm<decltype(t)>(&per_sm); });
  if (err) return err;
  *ctas = d.sms * (per_sm > 0 ? per_sm : 1);
  return 0;
}

int launch_verify_mma(const VerifyParams& p, MmaTile tile, int B, cudaStream_t st) {
  return with_tile(tile, [&](auto t) { return launch<decltype(t)>(p, B, st); });
}

}  // namespace kd

#ifdef KD_VERIFY_PROFILE
namespace kd { long long* g_stamps = nullptr; }
extern "C" void kd_verify_profile_buffer(void* buf) { kd::g_stamps = static_cast<long long*>(buf); }
#endif
