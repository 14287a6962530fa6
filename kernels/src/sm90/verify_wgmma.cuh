// Tree-verify attention on Hopper tensor cores (wgmma; included only by sm_90a sources).
//
// Same contract as the mma.sync kernel in ../verify_attention.cu (one CTA = 64 query rows
// of one request x one split of its keys, online softmax in float32, partials for the
// combine kernel), but the operands stay in shared memory: wgmma reads Q, the key tile
// and P straight from 128-byte-swizzled tiles, so no ldmatrix traffic through registers
// (the mma.sync kernel's limit, docs/kernels/verify_attention.md). The two warpgroups have roles:
//   warpgroup 0: S = Q K^T for all 64 keys of the tile (m64n64k16 x 36) and the softmax
//                (whole rows in its registers: no max exchange), P and the rescale
//                factors to shared memory;
//   warpgroup 1: streams the next key tile in meanwhile: by cp.async (COPY = COPY_CP_ASYNC,
//                any page size), or one of its threads issues TMA boxes (COPY_TMA, page
//                sizes that are multiples of 64: a tile is one 64-row slab of one page;
//                COPY_RUNS: each tile whose keys are 64 consecutive cache rows, the
//                others by cp.async);
//   both:        O += P V, warpgroup w owning value columns 256w..256w+255 (m64n256k16 x 4,
//                P from shared memory, V = the key tile read MN-major: no copy, no transpose).
// PV of a tile overlaps S of the next (named barriers hand the buffers over). Tiles:
// [9 column blocks][rows][64 bf16] with 128-byte rows, the 16-byte chunk index XOR-ed with
// row % 8 (the canonical SW128 layout; 1024-byte bases), which is also what a TMA box of
// 64 x 64 with 128-byte swizzle writes.
//
// Split merge (MERGE): with 2 key splits (the host's rule; the kernel takes up to 8), the
// splits of a row tile form one cluster (along grid y) and merge their O through
// distributed shared memory: each CTA stages its unnormalised float32 O in its free key
// slots, then merges every S-th row over the S CTAs by the rows' (max, sum) and writes out
// and lse. No partials go through global memory and no combine kernel runs
// (docs/kernels/verify_attention.md, v6).
#pragma once
#include <cuda.h>  // CUtensorMap (the type only: nothing links libcuda)

#include "../mma.cuh"
#include "../verify_common.cuh"
#include "tma.cuh"
#include "verify_wgmma_paths.cuh"
#include "wgmma.cuh"

namespace kd {
namespace {

constexpr int ROWS = WGMMA_ROWS;           // one wgmma M
constexpr int KEYS = WGMMA_KEYS;
constexpr int THREADS = 256;               // two warpgroups
constexpr int CHUNKS = QK_DIM / 8;         // 16-byte chunks per cache row (72)
constexpr int BLOCK_BYTES = 128;           // one swizzled row: 64 bf16
constexpr int Q_BYTES = QK_DIM / 64 * ROWS * BLOCK_BYTES;   // 73,728
constexpr int KV_BYTES = QK_DIM / 64 * KEYS * BLOCK_BYTES;  // 73,728
constexpr int P_BYTES = ROWS * KEYS * 2;                    // 8,192
constexpr int STAGES = 2;
constexpr size_t SMEM_BYTES = 1024 /* alignment slack */ + Q_BYTES + STAGES * KV_BYTES + P_BYTES +
                              4 * ROWS * sizeof(float);
static_assert(SMEM_BYTES == WGMMA_SMEM_BYTES && Q_BYTES == WGMMA_TILE_BYTES, "layout as the host sizes it");
// The merge's staged O: 64 rows of 512 floats, padded by 8 so that the accumulator's
// float2 stores (8 rows x 4 lanes a warp) hit distinct banks per half warp.
constexpr int O_STRIDE = V_DIM + 8;
static_assert(ROWS * O_STRIDE * sizeof(float) <= STAGES * KV_BYTES, "staged O fits the key slots");
static_assert(WGMMA_MERGE_MAX_SPLITS <= 8, "a portable cluster");  // (the kernel takes up to 8)

// Byte offset of 16-byte chunk `chunk` (0..71) of row `row` in a swizzled tile of `rows`.
__device__ __forceinline__ uint32_t sw128_offset(int rows, int row, int chunk) {
  return (chunk >> 3) * rows * BLOCK_BYTES + row * BLOCK_BYTES + (((chunk & 7) ^ (row & 7)) << 4);
}

// Keys [k0, k0 + 64) of request b into a swizzled tile, by warpgroup 1; rows at or past
// `end` zero-filled (no NaN from unused pages can reach P*V). Its warp w takes rows
// 16w..16w+15: the first 16 lanes look their pages up at once, then per row lane l copies
// chunks l, l + 32 and (l < 8) l + 64, so the swizzle is a compile-time XOR per row.
__device__ __forceinline__ void load_keys(const VerifyParams& p, const int32_t* table, int k0, int end,
                                          uint32_t tile, int w) {
  const int lane = threadIdx.x & 31, r0 = w * 16;
  size_t row_off = 0;
  int row_ok = 0;
  if (lane < 16 && k0 + r0 + lane < end) {
    row_off = cache_row(p, table, k0 + r0 + lane);
    row_ok = 1;
  }
#pragma unroll
  for (int r = 0; r < 16; ++r) {
    const size_t off = __shfl_sync(0xffffffffu, row_off, r);
    const int bytes = __shfl_sync(0xffffffffu, row_ok, r) ? 16 : 0;
    const __nv_bfloat16* src = p.kv + off + lane * 8;
    const uint32_t dst = tile + (r0 + r) * BLOCK_BYTES;
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      const int c = lane + 32 * i;  // (r0 + r) % 8 == r % 8
      if (i < 2 || lane < 8)
        cp_async16_s(dst + (c >> 3) * KEYS * BLOCK_BYTES + (((c & 7) ^ (r & 7)) << 4), src + 32 * 8 * i, bytes);
    }
  }
}

// TMA paths, one thread of warpgroup 1: the key tile whose 64 keys are cache rows
// y..y+63 (one slab of one page, or a run of rows) into slot `slot`, 9 boxes of 64 x 64
// completing the FULL barrier `full` by their bytes. Keys go with an L2 evict-first hint:
// each is read once a CTA (docs/kernels/verify_attention.md, v12).
__device__ __forceinline__ void issue_tile(const CUtensorMap* tmap, int y, uint32_t slot, uint32_t full) {
  const uint64_t policy = l2_evict_first();
  mbar_arrive_expect_tx(full, KV_BYTES);
#pragma unroll
  for (int c = 0; c < QK_DIM / 64; ++c) tma_load_2d(slot + c * KEYS * BLOCK_BYTES, tmap, c * 64, y, full, policy);
}

// The cache row (page * page_size + offset) of key `pos`; TMA paths only (rows < 2^31).
__device__ __forceinline__ int key_row(const VerifyParams& p, const int32_t* table, int pos) {
  const int page = p.page_shift >= 0 ? table[pos >> p.page_shift] : table[pos / p.page_size];
  return page * p.page_size + (p.page_shift >= 0 ? pos & (p.page_size - 1) : pos % p.page_size);
}

// COPY_RUNS: every warp of warpgroup 1 looks up the cache rows of a tile's keys (lane l:
// keys k0 + l and k0 + 32 + l; -1 at or past `end`) one tile ahead, so neither the
// choice between TMA and cp.async nor the cp.async addresses wait on a table load.
__device__ __forceinline__ void fetch_rows(const VerifyParams& p, const int32_t* table, int k0, int end,
                                           int (&row)[2]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int k = k0 + lane + 32 * h;
    row[h] = k < end ? key_row(p, table, k) : -1;
  }
}

// Whether the tile's keys (below `end`) are consecutive rows from the first key's, `y`: then
// one TMA slab of 64 rows copies it (rows past `end` are masked, and zeroed after S, as on
// the page-slab path). The same answer in every warp.
__device__ __forceinline__ bool rows_are_run(const int (&row)[2], int& y) {
  const int lane = threadIdx.x & 31;
  y = __shfl_sync(0xffffffffu, row[0], 0);  // the tile's first key is below `end`
  bool run = true;
#pragma unroll
  for (int h = 0; h < 2; ++h) run &= row[h] < 0 || row[h] == y + lane + 32 * h;
  return __all_sync(0xffffffffu, run);
}

// A tile that is not a run, by cp.async from its looked-up rows: warp w of warpgroup 1
// copies rows 16w..16w+15 as load_keys does (rows past `end` zero-filled).
__device__ __forceinline__ void copy_rows(const VerifyParams& p, const int (&row)[2], uint32_t tile, int w) {
  const int lane = threadIdx.x & 31;
  const int mine = (w >> 1) ? row[1] : row[0];  // rows 16w.. lie in half w / 2
#pragma unroll
  for (int r = 0; r < 16; ++r) {
    const int src_row = __shfl_sync(0xffffffffu, mine, (16 * w + r) & 31);
    const __nv_bfloat16* src = p.kv + (size_t)max(src_row, 0) * QK_DIM + lane * 8;
    const uint32_t dst = tile + (16 * w + r) * BLOCK_BYTES;
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      const int c = lane + 32 * i;  // (16w + r) % 8 == r % 8
      if (i < 2 || lane < 8)
        cp_async16_s(dst + (c >> 3) * KEYS * BLOCK_BYTES + (((c & 7) ^ (r & 7)) << 4), src + 32 * 8 * i,
                     src_row >= 0 ? 16 : 0);
    }
  }
}

// COPY_RUNS, every thread of warpgroup 1: requests a tile into `slot`. A run: one thread
// issues the TMA slab, which completes the FULL barrier by its bytes. Otherwise each
// thread copies its rows by cp.async; the barrier completes at the end of the iteration,
// when they have landed (the loop's RUNS epilogue).
__device__ __forceinline__ void request_tile(const VerifyParams& p, const CUtensorMap* tmap, const int (&row)[2],
                                             bool run, int y, uint32_t slot, uint32_t full, bool producer, int w) {
  if (!run) copy_rows(p, row, slot, w);
  else if (producer) issue_tile(tmap, y, slot, full);
}

// The merge of a cluster's S splits (the MERGE epilogue): this CTA (split = cluster rank
// `rank`) takes rows rank, rank + S, ... of the tile, a warp a row at a time, lane l
// columns 4l + 128i. The weights are exp2(m_s - M) / L with M the rows' largest max and
// L = sum exp2(m_s - M) l_s (log2 domain); splits without keys (m = -inf, l = 0) weigh 0.
__device__ __forceinline__ void merge_rows(const VerifyParams& p, int b, int m0, int S, int rank,
                                           uint32_t sO, uint32_t sL, uint32_t sM) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int r = rank + S * warp; r < ROWS; r += S * (THREADS / 32)) {
    const int row = m0 + r;
    if (row >= p.R) break;  // rows grow with r
    float m = -INFINITY, l = 0.f;
    if (lane < S) {
      m = ld_cluster_f32(sM + 4 * r, lane);
      l = ld_cluster_f32(sL + 4 * r, lane);
    }
    const float M = warp_max(m);
    const float w = m == -INFINITY ? 0.f : exp2f(m - M);
    const float L = warp_sum(w * l);
    const float inv = L > 0.f ? 1.f / L : 0.f;
    float4 acc[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < S; ++s) {
      const float ws = __shfl_sync(0xffffffffu, w, s) * inv;
      if (ws == 0.f) continue;  // the whole warp: one row
      float4 v[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = ld_cluster_f32x4(sO + 4 * (r * O_STRIDE + 4 * lane + 128 * i), s);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        acc[i].x += ws * v[i].x; acc[i].y += ws * v[i].y; acc[i].z += ws * v[i].z; acc[i].w += ws * v[i].w;
      }
    }
    __nv_bfloat16* dst = p.out + ((size_t)b * p.R + row) * V_DIM + 4 * lane;
#pragma unroll
    for (int i = 0; i < 4; ++i)
      *reinterpret_cast<uint2*>(dst + 128 * i) =
          make_uint2(pack_bf16(acc[i].x, acc[i].y), pack_bf16(acc[i].z, acc[i].w));
    if (lane == 0) p.lse[(size_t)b * p.R + row] = L > 0.f ? (M + log2f(L)) * LN2 : -INFINITY;
  }
}

// COPY: COPY_CP_ASYNC, COPY_TMA (page slabs) or COPY_RUNS (TMA or cp.async tile by tile).
// MERGE (COPY_TMA or COPY_RUNS): the splits of a row tile are one cluster (1 x num_splits)
// and merge in it; no other launch has clusters. PER_REQUEST (not MERGE): each request takes
// its own split count (plans with split_base != 0: split_keys); a separate build so that
// other plans run the kernel without it.
template <int COPY, bool MERGE, bool PER_REQUEST>
__global__ void __launch_bounds__(THREADS, 1)
verify_attention_wgmma_kernel(VerifyParams p, const __grid_constant__ CUtensorMap tmap) {
  static_assert(!MERGE || COPY != COPY_CP_ASYNC, "the merge runs on the TMA paths");
  static_assert(!(MERGE && PER_REQUEST), "clusters merge every split, full or empty");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool TMA = COPY != COPY_CP_ASYNC;  // the mbarrier pipeline (RUNS included)
  constexpr bool RUNS = COPY == COPY_RUNS;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t sQ = (raw + 1023) & ~1023u;  // swizzle atoms repeat every 1024 bytes
  const uint32_t sKV = sQ + Q_BYTES, sP = sKV + STAGES * KV_BYTES;
  unsigned char* gP = smem_raw + (sP - raw);
  float* sAlpha = reinterpret_cast<float*>(gP + P_BYTES);  // per row, this tile's rescale
  float* sL = sAlpha + ROWS;                                // per row, at the end: sum, max
  float* sM = sL + ROWS;
  // TMA paths: FULL(s) completes when slot s holds its tile (in the 4th float row's room).
  // No EMPTY barrier: warpgroup 1 refills a slot only after KV_FREE and its own PV wait.
  const uint32_t bar_full = smem_addr(sM + ROWS);

  const VerifyCta cta = VerifyGrid<PER_REQUEST>::at(p, ROWS);
  const int m0 = cta.tile * ROWS, split = cta.split, b = cta.b;
  SplitKeys ks_early{};  // PER_REQUEST: this split's keys, known before the prologue
  if constexpr (PER_REQUEST) {
    ks_early = split_keys<true>(p, cta, KEYS, ROWS);
    if (empty_split(cta, ks_early)) {  // a short request's later split: only its LSEs
      write_empty_split(p, b, split, m0, ROWS, ks_early.alone);
      return;
    }
  }
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) { VSTAMP(0, gtimer()); VSTAMP(1, clock64()); }
  const int wg = warp >> 2;
  const int g = lane >> 2, t = lane & 3;
  const int rbase = (warp & 3) * 16;      // this warp's 16 rows of the 64
  const int32_t* table = request_table(p, b);
  // This split's keys, in whole tiles.
  const SplitKeys ks = PER_REQUEST ? ks_early : split_keys<false>(p, cta, KEYS, ROWS);
  const int P = ks.P, k_begin = ks.begin, k_end = ks.end, ntiles = ks.ntiles;
  const int unmasked_end = min(P, k_end);  // keys below this need no mask
  // PER_REQUEST: whether this split writes the request's output, kept to the epilogue in the
  // last word of the barriers' float row (in a register it spilled).
  int* const s_whole = reinterpret_cast<int*>(sM + 2 * ROWS) - 1;
  if (PER_REQUEST && tid == 0) *s_whole = writes_output(p, ks);
  const bool producer = TMA && tid == 4 * 32;  // warpgroup 1's first thread issues the TMA
  // Page slabs: the producer looks the next tile's row up a tile ahead (next[0]), so the
  // table's round trip leaves the request's path (the `ahead` row of verify_plan.cu's table).
  const bool ahead = p.R > ROWS;
  int next[2] = {-1, -1};  // warpgroup 1: the rows of the next tile to request
  bool run = false;        // RUNS, warpgroup 1: the tile last requested goes by TMA

  if constexpr (TMA) {
    if (tid == 0) {
      for (int s = 0; s < STAGES; ++s) mbar_init(bar_full + 8 * s, 1);
      mbar_init_fence();
    }
    __syncthreads();  // no copy or arrival before the barriers' init
    if constexpr (RUNS) {
      if (wg == 1 && ntiles > 0) {
        int rows[2], y;
        fetch_rows(p, table, k_begin, k_end, rows);
        if (ntiles > 1) fetch_rows(p, table, k_begin + KEYS, k_end, next);
        run = rows_are_run(rows, y);
        request_tile(p, &tmap, rows, run, y, sKV, bar_full, producer, warp - 4);
      }
    } else if (producer && ntiles > 0) {
      const int y = key_row(p, table, k_begin);
      if (ahead && ntiles > 1) next[0] = key_row(p, table, k_begin + KEYS);
      issue_tile(&tmap, y, sKV, bar_full);
    }
  }
  // Q (rows past R zero-filled) by all threads, key tile 0 by warpgroup 1: one group.
  for (int c = tid; c < ROWS * CHUNKS; c += THREADS) {
    const int r = c / CHUNKS, ch = c - r * CHUNKS;
    const bool ok = m0 + r < p.R;
    const __nv_bfloat16* src = ok ? p.q + ((size_t)b * p.R + m0 + r) * QK_DIM + ch * 8 : p.q;
    cp_async16_s(sQ + sw128_offset(ROWS, r, ch), src, ok ? 16 : 0);
  }
  if (!TMA && wg == 1 && ntiles > 0) load_keys(p, table, k_begin, k_end, sKV, warp - 4);
  cp_async_commit();
  if constexpr (TMA) {  // Q by cp.async: waited for once, here
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    if (RUNS && producer && ntiles > 0 && !run) mbar_arrive(bar_full);  // tile 0 by cp.async: landed
  }

  if (tid == 0) VSTAMP(2, clock64());
  float o[128];  // wgmma's accumulator order: o[4j + e] is element e of 8-column block j
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  const auto o_at = [&](int j, int e) -> float& { return o[4 * j + e]; };
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};  // warpgroup 0's rows
  const int slot0 = (m0 + rbase + g) / p.H, slot1 = (m0 + rbase + g + 8) / p.H;

  // The tiles flow through a pipeline: PV of tile i is issued without waiting, so the
  // tensor cores go on from warpgroup 1's PV(i) to S(i+1). PV(i) is issued in two halves,
  // keys 0-31 as soon as their P is stored and 32-63 after, so the tensor cores have work
  // while warpgroup 0 exponentiates the second half. Named barriers (ids 1-3 and 5, both
  // warpgroups) hand the shared buffers over:
  //   P_HALF  (5): warpgroup 0 wrote P(i) of keys 0-31 and the rescale factors;
  //   P_READY (1): warpgroup 0 wrote the rest of P(i);
  //   KV_FREE (2): warpgroup 0's PV(i-1) finished, so tile i-1's slot may be refilled
  //                (warpgroup 0 arrives for tile i+1 only after P_FREE(i), which
  //                warpgroup 1 arrives after its KV_FREE(i) sync: no generation is
  //                counted twice);
  //   P_FREE  (3): warpgroup 1's PV(i-1) finished, so P may be overwritten.
  // On the TMA path no barrier starts a tile: warpgroup 0 waits on FULL(i % 2) after it
  // has released tile i-1's slot (KV_FREE), so tile i+1 is requested while tile i may
  // still be landing; warpgroup 1 reads the tile only after P_HALF. The named barriers
  // alone keep the warpgroups within one tile.
  constexpr int P_READY = 1, KV_FREE = 2, P_FREE = 3, P_HALF = 5;
  for (int it = 0; it < ntiles; ++it) {
    const uint32_t parity = (it >> 1) & 1;
    if constexpr (!TMA) {
      cp_async_wait<0>();
      fence_proxy_async();
      __syncthreads();  // tile `it` landed (and both PVs of tile it-1 are issued)
    }
    const uint32_t sK = sKV + (it & 1) * KV_BYTES;
    const int k0 = k_begin + it * KEYS;
    float alpha[2];
    float s[32] = {}, msafe[2] = {}, sum0[8], sum1[8];  // warpgroup 0's (S, zeroed a tile; maxima; row sums)
    // P = exp2(s * scale - m) (bf16) into its swizzled tile: row r, keys 8j + 2t (+1)
    // -> chunk j; the row sums' terms into sum0 / sum1.
    const auto exp_chunk = [&](int j) {
      const float p0 = exp2f(fmaf(s[4 * j], p.scale_log2, -msafe[0]));
      const float p1 = exp2f(fmaf(s[4 * j + 1], p.scale_log2, -msafe[0]));
      const float p2 = exp2f(fmaf(s[4 * j + 2], p.scale_log2, -msafe[1]));
      const float p3 = exp2f(fmaf(s[4 * j + 3], p.scale_log2, -msafe[1]));
      sum0[j] = p0 + p1;
      sum1[j] = p2 + p3;
      const int r = rbase + g;  // r % 8 == g, (r + 8) % 8 == g
      *reinterpret_cast<uint32_t*>(gP + r * BLOCK_BYTES + ((j ^ g) << 4) + 4 * t) = pack_bf16(p0, p1);
      *reinterpret_cast<uint32_t*>(gP + (r + 8) * BLOCK_BYTES + ((j ^ g) << 4) + 4 * t) = pack_bf16(p2, p3);
    };
    // The row sums as trees, into l_run.
    const auto add_row_sums = [&]() {
#pragma unroll
      for (int w = 4; w > 0; w >>= 1)
#pragma unroll
        for (int j = 0; j < w; ++j) { sum0[j] += sum0[j + w]; sum1[j] += sum1[j + w]; }
      float sum[2] = {sum0[0], sum1[0]};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        sum[h] = quad_sum(sum[h]);
        l_run[h] = l_run[h] * alpha[h] + sum[h];
      }
    };
    if (wg == 0) {
      // S = Q K^T: 36 k-steps of 16 columns; within a 128-byte row a step is +32 bytes.
      // PV(it-1) must finish before its key slot is refilled; waiting for it here, not
      // after S(it), starts the next tile's copy sooner. wait_group 1 after S would overlap
      // more, but ptxas then serialises every wgmma.
      wgmma_wait<0>();
      named_arrive(KV_FREE, THREADS);
      if constexpr (TMA) mbar_wait(bar_full + 8 * (it & 1), parity);
      if (tid == 0 && it < 10) VSTAMP(3 + 4 * it, clock64());
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < QK_DIM / 16; ++kk) {
        const uint32_t col = kk >> 2, step = (kk & 3) * 32;
        wgmma_m64n64k16(s, sw128_desc(sQ + col * ROWS * BLOCK_BYTES + step, 16, 1024),
                        sw128_desc(sK + col * KEYS * BLOCK_BYTES + step, 16, 1024), kk > 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
      if (tid == 0 && it < 10) VSTAMP(4 + 4 * it, clock64());
      reg_fence(s);
      reg_fence(o);

      // Mask keys past the range and tree keys the slot does not see (prefix tiles skip
      // the lookups). Raw scores: the scale (> 0) is folded into the exponent's FFMA.
      if (k0 + KEYS > unmasked_end) {
        with_vis_format(p, [&](auto bits) {
#pragma unroll
          for (int i = 0; i < 32; ++i) {
            const int key = k0 + (i >> 2) * 8 + 2 * t + (i & 1);
            if (!attends<decltype(bits)::value>(p, b, (i & 2) ? slot1 : slot0, key, P, k_end)) s[i] = -INFINITY;
          }
        });
      }
      // A TMA tile is a whole page slab: its rows past the split's end hold whatever
      // the page holds (NaN in the tests) and P = 0 does not cancel NaN in PV, so they
      // are zeroed once S has read them (the last tile only; fenced before P_READY).
      if (TMA && k0 + KEYS > k_end) {
        const int first = k_end - k0;
        for (int q = tid; q < (KEYS - first) * CHUNKS; q += 128) {
          const int r = first + q / CHUNKS, c = q % CHUNKS;
          asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n"
                       ::"r"(sK + (c >> 3) * KEYS * BLOCK_BYTES + r * BLOCK_BYTES + ((c & 7) << 4)), "r"(0)
                       : "memory");
        }
      }
      // Row maxima: rows g (h = 0) and g + 8.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float mx = quad_max(thread_row_max(s, h)) * p.scale_log2;
        const float m_new = running_max(m_run[h], mx);
        msafe[h] = m_new == -INFINITY ? 0.f : m_new;  // fully masked so far: keep zeros
        alpha[h] = exp2f(m_run[h] - msafe[h]);
        m_run[h] = m_new;
      }
      named_sync(P_FREE, THREADS);  // warpgroup 1 has read P(it-1)
      // Keys 0-31's P, the factors and O's rescale first; keys 32-63 under their PV, below.
      if (t == 0) { sAlpha[rbase + g] = alpha[0]; sAlpha[rbase + g + 8] = alpha[1]; }
      rescale_rows(alpha, o_at);
#pragma unroll
      for (int j = 0; j < 4; ++j) exp_chunk(j);
      fence_proxy_async();
      named_arrive(P_HALF, THREADS);
    } else {
      wgmma_wait<0>();  // this warpgroup's PV(it-1)
      reg_fence(o);
      // KV_FREE before P_FREE: warpgroup 0 cannot then pass P_FREE and arrive on KV_FREE
      // for the next tile before this warpgroup has synced on it for this one (no
      // __syncthreads separates tiles on the TMA path).
      named_sync(KV_FREE, THREADS);
      named_arrive(P_FREE, THREADS);
      // The next tile streams in while warpgroup 0 works (its slot held tile it-1).
      const int nx = it + 1;
      if constexpr (RUNS) {  // the slot is free: KV_FREE above, this warpgroup's PV waited
        if (nx < ntiles) {
          const uint32_t s = nx & 1;
          int y;
          run = rows_are_run(next, y);
          request_tile(p, &tmap, next, run, y, sKV + s * KV_BYTES, bar_full + 8 * s, producer, warp - 4);
          cp_async_commit();
          if (nx + 1 < ntiles) fetch_rows(p, table, k_begin + (nx + 1) * KEYS, k_end, next);
        }
      } else if constexpr (TMA) {
        if (producer && nx < ntiles) {  // the slot is free, as above
          const uint32_t s = nx & 1;
          const int y = ahead ? next[0] : key_row(p, table, k_begin + nx * KEYS);
          issue_tile(&tmap, y, sKV + s * KV_BYTES, bar_full + 8 * s);
          if (ahead && nx + 1 < ntiles) next[0] = key_row(p, table, k_begin + (nx + 1) * KEYS);
        }
      } else {
        if (nx < ntiles) load_keys(p, table, k_begin + nx * KEYS, k_end, sKV + (nx & 1) * KV_BYTES, warp - 4);
        cp_async_commit();
      }
      if (tid == 128 && it < 10) VSTAMP(6 + 4 * it, clock64());
      named_sync(P_HALF, THREADS);
      // S(it) has read the tile, so this passes at once; it makes the copy visible to
      // this warpgroup's PV as well.
      if constexpr (TMA) mbar_wait(bar_full + 8 * (it & 1), parity);
      alpha[0] = sAlpha[rbase + g];
      alpha[1] = sAlpha[rbase + g + 8];
      rescale_rows(alpha, o_at);
    }
    // O += P V: k-steps [first, last) of 16 keys. V is the key tile read MN-major: 64-column
    // blocks 8 KB apart (leading offset), 8-key groups 1 KB apart (stride offset). Not
    // waited for here (see above). Both halves are issued where both warpgroups run: an
    // accumulator in flight across their branches serialises every wgmma (ptxas C7520).
    const auto pv_steps = [&](int first, int last) {
      wgmma_fence();
#pragma unroll
      for (int kk = first; kk < last; ++kk) {
        wgmma_m64n256k16_bt(o, sw128_desc(sP + kk * 32, 16, 1024),
                            sw128_desc(sK + wg * 4 * KEYS * BLOCK_BYTES + kk * 16 * BLOCK_BYTES,
                                       KEYS * BLOCK_BYTES, 1024));
      }
      wgmma_commit();
    };
    pv_steps(0, 2);  // keys 0-31
    if (wg == 0) {
#pragma unroll
      for (int j = 4; j < 8; ++j) exp_chunk(j);
      add_row_sums();
      fence_proxy_async();
      if (tid == 0 && it < 10) VSTAMP(5 + 4 * it, clock64());
      named_arrive(P_READY, THREADS);
    } else {
      named_sync(P_READY, THREADS);
    }
    pv_steps(2, KEYS / 16);  // keys 32-63
    // RUNS: a next tile copied by cp.async completes its FULL barrier here, once every
    // thread's copies have landed and are fenced for wgmma (barrier 4: warpgroup 1 alone),
    // while this warpgroup's PV runs; a TMA tile completes it by its bytes.
    if constexpr (RUNS) {
      if (wg == 1 && it + 1 < ntiles && !run) {
        cp_async_wait<0>();
        fence_proxy_async();
        named_sync(4, 128);
        if (producer) mbar_arrive(bar_full + 8 * ((it + 1) & 1));
      }
    }
  }
  wgmma_wait<0>();
  reg_fence(o);
  if (tid == 0) VSTAMP(43, clock64());
  cp_async_wait<0>();
  // The combine (if any) may be scheduled now: it waits for our stores (pdl_wait).
  if constexpr (!MERGE) pdl_launch_dependents();

  if (wg == 0 && t == 0) {
    sL[rbase + g] = l_run[0]; sL[rbase + g + 8] = l_run[1];
    sM[rbase + g] = m_run[0]; sM[rbase + g + 8] = m_run[1];
  }
  if constexpr (MERGE) {
    // Every tile was consumed and both warpgroups' PVs are done, so once all threads are
    // here the key slots are free: O goes there unnormalised, float32.
    __syncthreads();
    float* sO = reinterpret_cast<float*>(smem_raw + (sKV - raw));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float* dst = sO + (rbase + g + 8 * h) * O_STRIDE + wg * 256 + 2 * t;
#pragma unroll
      for (int j = 0; j < 32; ++j)
        *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(o_at(j, 2 * h), o_at(j, 2 * h + 1));
    }
    cluster_sync();  // every split's O, sums and maxima are staged
    merge_rows(p, b, m0, p.num_splits, split, sKV, smem_addr(sL), smem_addr(sM));
    cluster_sync();  // no CTA leaves while another still reads its shared memory
    return;
  }
  __syncthreads();

  const int r = rbase + g;
  const float l[2] = {sL[r], sL[r + 8]}, m[2] = {sM[r], sM[r + 8]};
  const bool whole = PER_REQUEST ? *s_whole != 0 : writes_output(p, ks);
  write_rows(p, b, split, m0 + r, wg * 256, t, l, m, wg == 0 && t == 0, whole, o_at);
  if (tid == 0) { VSTAMP(46, clock64()); VSTAMP(47, gtimer()); }
#else
  __trap();  // built without sm_90a: the host never launches this (KD_HAS_SM90A)
#endif
}

// The launch of path (COPY, MERGE) over `grid`: clusters of all splits of a row tile
// (MERGE), else none. `attr` holds the cluster shape.
template <int COPY, bool MERGE, bool PER_REQUEST>
cudaError_t path_config(dim3 grid, cudaStream_t st, cudaLaunchAttribute* attr, cudaLaunchConfig_t* cfg) {
  const cudaError_t e = configure_once<verify_attention_wgmma_kernel<COPY, MERGE, PER_REQUEST>>((int)SMEM_BYTES);
  *cfg = {};
  cfg->gridDim = grid;
  cfg->blockDim = dim3(THREADS);
  cfg->dynamicSmemBytes = SMEM_BYTES;
  cfg->stream = st;
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = 1;
  attr->val.clusterDim.y = grid.y;
  attr->val.clusterDim.z = 1;
  cfg->attrs = attr;
  cfg->numAttrs = MERGE ? 1 : 0;
  return e;
}

// Launches path (COPY, MERGE), with per-request splits where the plan has them.
template <int COPY, bool MERGE, bool PER_REQUEST>
int launch_wgmma_as(const VerifyParams& p, const CUtensorMap& tmap, int B, cudaStream_t st) {
  cudaLaunchAttribute attr;
  cudaLaunchConfig_t cfg;
  cudaError_t e =
      path_config<COPY, MERGE, PER_REQUEST>(VerifyGrid<PER_REQUEST>::dims(ceil_div(p.R, ROWS), p.num_splits, B,
                                                                          p.split_base == TAIL_SPLITS),
                                            st, &attr, &cfg);
  if (e == cudaSuccess)
    e = cudaLaunchKernelEx(&cfg, verify_attention_wgmma_kernel<COPY, MERGE, PER_REQUEST>, p, tmap);
  return (int)e;
}

// Each instantiation sits in its own source file. The plan never merges per-request splits.
template <int COPY, bool MERGE>
int launch_wgmma_path(const VerifyParams& p, const CUtensorMap& tmap, int B, cudaStream_t st) {
  if constexpr (!MERGE) {
    if (p.split_base != 0) return launch_wgmma_as<COPY, false, true>(p, tmap, B, st);
  }
  return launch_wgmma_as<COPY, MERGE, false>(p, tmap, B, st);
}

// Clusters of `splits` CTAs of the merging path COPY resident at once on this device: they
// must fit the GPCs, so fewer than SMs / splits may be.
template <int COPY>
int merge_clusters_resident(int splits, int* clusters) {
  cudaLaunchAttribute attr;
  cudaLaunchConfig_t cfg;
  cudaError_t e = path_config<COPY, true, false>(dim3(1, splits, 1), nullptr, &attr, &cfg);
  if (e == cudaSuccess)
    e = cudaOccupancyMaxActiveClusters(clusters, verify_attention_wgmma_kernel<COPY, true, false>, &cfg);
  return (int)e;
}

}  // namespace
}  // namespace kd

// The per-path entry points (verify_wgmma_paths.cuh), defined by each instantiation file;
// a merging path also answers how many of its clusters fit.
#define KD_DEFINE_WGMMA_PATH(COPY, MERGE)                                                        \
  namespace kd {                                                                                 \
  template <>                                                                                    \
  int launch_verify_wgmma_path<COPY, MERGE>(const VerifyParams& p, const CUtensorMap& m, int B,  \
                                            cudaStream_t st) {                                   \
    return launch_wgmma_path<COPY, MERGE>(p, m, B, st);                                          \
  }                                                                                              \
  }
#define KD_DEFINE_WGMMA_MERGE_PATH(COPY)                                                         \
  KD_DEFINE_WGMMA_PATH(COPY, true)                                                               \
  namespace kd {                                                                                 \
  template <>                                                                                    \
  int verify_wgmma_merge_clusters<COPY>(int splits, int* clusters) {                             \
    return merge_clusters_resident<COPY>(splits, clusters);                                      \
  }                                                                                              \
  }
