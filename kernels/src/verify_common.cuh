// What the two tree-verify attention kernels share: their parameters, the tree mask
// lookup and the epilogue's LSE convention (spec verify_attention.md). The mma.sync
// kernel (verify_attention.cu, every arch) and the wgmma kernel (sm90/, Hopper only)
// both take a tile of query rows of one request and one split of its keys.
#pragma once
#include <cuda_runtime.h>

#include <type_traits>

#include "common.cuh"

namespace kd {

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
constexpr int MAX_SPLITS = 128;  // key splits a request (the combine keeps their weights in shared memory)

struct VerifyParams {
  const __nv_bfloat16* q;
  const __nv_bfloat16* kv;
  const int32_t* block_table;  // rows of table_stride entries
  const int32_t* req_rows;     // request b's row of block_table (NULL: row b)
  int table_stride;
  // split_base > 0: a request takes request_splits' count of the num_splits (the plan's rule,
  // split_wave CTAs a wave); TAIL_SPLITS (the plan's `tail`): the last row tile alone takes
  // per-request counts, up to num_splits (VerifyGrid). 16 bits each, in table_stride's
  // padding: past 128 bytes the struct changed the default kernels' code
  // (docs/kernels/verify_attention.md, v22).
  short split_base, split_wave;
  const int32_t* seq_lens;
  const void* vis;
  int vis_bits;
  int D, H, R, page_size, page_shift, max_pages, num_splits;  // page_shift: log2 or -1
  int num_pages;  // pages in the cache (the TMA path's tensor map)
  float scale_log2;  // softmax scale * log2(e)
  __nv_bfloat16* out;
  float* lse;
  __nv_bfloat16* part_out;  // a split's normalised O, bf16 like out (see write_rows)
  float* part_lse;
#ifdef KD_VERIFY_PROFILE
  long long* stamps;  // profile builds: [64 splits][48] clock stamps of row tile 0, request 0
#endif
};
// Profile builds (-DKD_VERIFY_PROFILE, kd_verify_profile_buffer): the wgmma kernel's CTAs of
// row tile 0 of request 0 stamp clock64() at its phases (docs/kernels/verify_attention.md, v10);
// in per-request launches (VerifyGrid) split 0 of each request does.
#ifdef KD_VERIFY_PROFILE
#define VSTAMP(i, v)                                                                   \
  do {                                                                                 \
    if (p.stamps && blockIdx.x == 0 && blockIdx.z == 0 && blockIdx.y < 64 && (i) < 48) \
      p.stamps[blockIdx.y * 48 + (i)] = (v);                                           \
  } while (0)
__device__ __forceinline__ long long gtimer() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#else
#define VSTAMP(i, v) do {} while (0)
#endif

// Whether tree slot `slot` (>= D: a row past the tree) may attend key `key` of a request
// with prefix P and keys below `end`: prefix keys always, tree keys where the slot's
// visibility row (BITS: bit-packed, else bytes) marks an ancestor or itself. The row is
// read at a clamped index whatever the key, and the result combined without branches, so
// an unrolled mask loop issues all its loads before the first use; with the load behind
// `key >= P`, the tile holding the tree took thousands of cycles more than a prefix tile,
// and that CTA sets the launch's time (docs/kernels/verify_attention.md, v10).
template <bool BITS>
__device__ __forceinline__ bool attends(const VerifyParams& p, int b, int slot, int key, int P, int end) {
  const int j = key - P;
  const size_t row = (size_t)b * p.D + min(slot, p.D - 1);
  const int jc = min(max(j, 0), p.D - 1);
  int v;
  if constexpr (BITS) {
    const int32_t* w = static_cast<const int32_t*>(p.vis) + row * ((p.D + 31) >> 5);
    v = (w[jc >> 5] >> (jc & 31)) & 1;
  } else {
    v = static_cast<const uint8_t*>(p.vis)[row * p.D + jc] != 0;
  }
  return (key < end) & ((j < 0) | ((slot < p.D) & v));
}

// Calls f(std::true_type) for a bit-packed visibility, f(std::false_type) for bytes: the
// mask loops are compiled once per format, with no format branch inside them.
template <class F>
__device__ __forceinline__ void with_vis_format(const VerifyParams& p, F f) {
  if (p.vis_bits) f(std::true_type{});
  else f(std::false_type{});
}

// Request b's row of the block table (SGLang's req_to_token[req_pool_indices[b]]).
__device__ __forceinline__ const int32_t* request_table(const VerifyParams& p, int b) {
  return p.block_table + (size_t)(p.req_rows ? p.req_rows[b] : b) * p.table_stride;
}

// Request b's key count, clamped to its block table so a bad length cannot read past it
// (the host cannot check device-side lengths without a sync; the Python reference
// rejects them).
__device__ __forceinline__ int clamped_seq_len(const VerifyParams& p, int b) {
  return min(max(p.seq_lens[b], 0), p.max_pages * p.page_size);
}

// The split rule's cost (verify_plan.cu's table, `splits`): s splits of a request's `tiles`
// key tiles, in key-tile times x COMBINE_ROWS_A_TILE: waves(s) x (a split's tiles + a CTA's
// turnaround) + s x the partial rows the combine merges. Integers, so that the plan and the
// kernels reach the same count. ctas * 16 must fit an int (the plan's guard).
constexpr int TURNAROUND_TILES = 3;        // a CTA's Q copy, first tile and stores
constexpr int COMBINE_ROWS_A_TILE = 2400;  // partial rows written and merged in a tile's time
constexpr int MAX_SPLITS_PAST_FILL = 16;   // the rule's largest count past the one-wave fill
static_assert(MAX_SPLITS_PAST_FILL <= 32, "request_splits weighs a count a lane");
__host__ __device__ inline long long split_cost(int ctas, int wave, long long rows, int tiles, int s) {
  const int waves = (ctas * s + wave - 1) / wave;
  return (long long)waves * ((tiles + s - 1) / s + TURNAROUND_TILES) * COMBINE_ROWS_A_TILE +
         (s > 1 ? s * rows : 0);
}

// The count s of least cost c over the warp's lanes, ties to fewer splits (a lane without a
// count passes the largest cost). Call with the whole warp.
__device__ __forceinline__ int warp_least_splits(int s, long long c) {
  for (int o = 16; o > 0; o >>= 1) {
    const long long oc = __shfl_xor_sync(0xffffffffu, c, o);
    const int os = __shfl_xor_sync(0xffffffffu, s, o);
    if (oc < c || (oc == c && os < s)) c = oc, s = os;
  }
  return s;
}

// The splits a request of `tiles` key tiles takes where the plan's count was chosen for its
// longest request (split_base > 0): the least costly count from split_base up to the plan's
// for this request's own length; a short request leaves the later splits empty. Lane i
// weighs split_base + i (past the fill at most MAX_SPLITS_PAST_FILL counts, one a lane) and
// the warp takes the least, ties to fewer splits: a loop over the counts cost every warp of
// every CTA a few hundred instructions. Not inlined, and scalars only: inlined, its 64-bit
// costs made the wgmma kernel spill. Call with the whole warp.
static __device__ __noinline__ int request_splits(int split_base, int num_splits, int ctas, int wave, long long rows,
                                                  int tiles) {
  const int s = split_base + (int)(threadIdx.x & 31);
  return warp_least_splits(s, s <= num_splits ? split_cost(ctas, wave, rows, tiles, s) : 0x7fffffffffffffffLL);
}

// The cost of s splits for the last row tiles of a TAIL_SPLITS launch (each request's rows
// past the last whole tile), its main row tiles taking one split each. A last row tile costs
// what a whole one costs, so split finer it fills the SMs the main tiles' last wave leaves
// idle. In split_cost's units: the main tiles' waves, the rounds of pieces left after those
// that fit beside that wave, and the rows the combine merges.
__host__ __device__ inline long long tail_split_cost(int main_ctas, int tail_ctas, int s, int wave,
                                                     long long tail_rows, int tiles) {
  const long long t_main = tiles + TURNAROUND_TILES;
  const long long waves = ((long long)main_ctas + wave - 1) / wave;
  const long long t_tail = (tiles + s - 1) / s + TURNAROUND_TILES;
  const long long beside = (waves * wave - main_ctas) * (t_main / t_tail);
  const long long pieces = (long long)tail_ctas * s;
  const long long rest = pieces > beside ? pieces - beside : 0;
  return (waves * t_main + (rest + wave - 1) / wave * t_tail) * COMBINE_ROWS_A_TILE + (s > 1 ? s * tail_rows : 0);
}

// The last row tile's count for a request of `tiles` key tiles: lane i weighs 1 + i, the warp
// takes the least, ties to fewer. As request_splits: not inlined, scalars only; call with the
// whole warp.
static __device__ __noinline__ int request_tail_splits(int num_splits, int main_ctas, int tail_ctas, int wave,
                                                       long long tail_rows, int tiles) {
  const int s = 1 + (int)(threadIdx.x & 31);
  return warp_least_splits(
      s, s <= num_splits ? tail_split_cost(main_ctas, tail_ctas, s, wave, tail_rows, tiles) : 0x7fffffffffffffffLL);
}

// Request b's keys for one split: whole tiles of `keys`, the prefix length P (tree slots sit
// at positions P .. seq-1) and [begin, end) with its tile count. `alone`: split 0 holds every
// key of the request, though the plan launched more splits, or (TAIL_SPLITS) the CTA is a
// main row tile's only one (PER_REQUEST only).
struct SplitKeys {
  int P, begin, end, ntiles;
  bool alone;
};

// split_base of a plan whose last row tile alone takes per-request counts (the plan's `tail`).
constexpr short TAIL_SPLITS = -1;

// The first row of a request's last row tile (R rows a request, `rows` a CTA): a TAIL_SPLITS
// plan's main row tiles hold the rows before it.
__host__ __device__ inline int last_tile_row(int R, int rows) { return (ceil_div(R, rows) - 1) * rows; }

// A CTA's coordinates: its row tile, split and request, and the launch's requests.
struct VerifyCta {
  int tile, split, b, B;
};

// A launch's grid. Per-request launches order theirs (row tiles, B, splits): every request's
// first split is scheduled before any later one, so the short requests' empty splits run
// beside the last real CTAs, not between them. A TAIL_SPLITS launch is one line: every
// request's main row tiles (all but the last; one split each) first, so that they start
// together, then the last row tiles' splits (split-major): those fill the SMs the main tiles
// leave idle and then the last round, and no main tile waits behind them.
template <bool PER_REQUEST>
struct VerifyGrid {
  static dim3 dims(int row_tiles, int splits, int B, bool tail) {
    if (tail) return dim3((row_tiles - 1 + splits) * B);
    return PER_REQUEST ? dim3(row_tiles, B, splits) : dim3(row_tiles, splits, B);
  }
  static __device__ __forceinline__ VerifyCta at(const VerifyParams& p, int rows) {
    if constexpr (PER_REQUEST) {
      if (p.split_base == TAIL_SPLITS) {
        const int main_tiles = ceil_div(p.R, rows) - 1;
        const int B = gridDim.x / (main_tiles + p.num_splits), i = blockIdx.x, main_ctas = main_tiles * B;
        if (i < main_ctas) return {i % main_tiles, 0, i / main_tiles, B};
        return {main_tiles, (i - main_ctas) / B, (i - main_ctas) % B, B};
      }
      return {(int)blockIdx.x, (int)blockIdx.z, (int)blockIdx.y, (int)gridDim.y};
    }
    return {(int)blockIdx.x, (int)blockIdx.y, (int)blockIdx.z, (int)gridDim.z};
  }
};

// PER_REQUEST (plans with split_base != 0, kernels built for them): request_splits' count for
// the request's length; TAIL_SPLITS: one split for a main row tile, request_tail_splits' count
// for the last. `rows`: a CTA's rows.
template <bool PER_REQUEST>
__device__ __forceinline__ SplitKeys split_keys(const VerifyParams& p, const VerifyCta& c, int keys, int rows) {
  const int seq = clamped_seq_len(p, c.b);
  const int tiles = ceil_div(seq, keys);
  int splits = p.num_splits;
  bool main_tile = false;
  if constexpr (PER_REQUEST) {
    const int row_tiles = ceil_div(p.R, rows);
    if (p.split_base == TAIL_SPLITS) {
      const int main_ctas = (row_tiles - 1) * c.B, tail_rows = p.R - (row_tiles - 1) * rows;
      main_tile = c.tile < row_tiles - 1;
      splits = main_tile ? 1
                         : request_tail_splits(p.num_splits, main_ctas, c.B, p.split_wave, (long long)c.B * tail_rows,
                                               tiles);
    } else {
      // The plan's CTAs (row tiles x B) and rows are the grid's.
      splits = request_splits(p.split_base, p.num_splits, row_tiles * c.B, p.split_wave, (long long)c.B * p.R,
                              tiles);
    }
  }
  const int tiles_per = ceil_div(tiles, splits);
  SplitKeys r;
  r.P = seq - p.D;
  r.begin = c.split * tiles_per * keys;
  r.end = min(seq, r.begin + tiles_per * keys);
  r.ntiles = r.end > r.begin ? ceil_div(r.end - r.begin, keys) : 0;
  r.alone = PER_REQUEST && ((tiles > 0 && tiles_per >= tiles) || main_tile);
  return r;
}

// Whether a PER_REQUEST CTA holds no keys to work on: it writes only its LSEs
// (write_empty_split) and leaves. A main row tile's only split runs whatever its keys, so
// its rows are written (no combine reads them).
__device__ __forceinline__ bool empty_split(const VerifyCta& c, const SplitKeys& ks) {
  return ks.ntiles == 0 && !(ks.alone && c.split == 0);
}

// Element offset of key `pos` of a request in the paged cache.
__device__ __forceinline__ size_t cache_row(const VerifyParams& p, const int32_t* table, int pos) {
  const int page = p.page_shift >= 0 ? table[pos >> p.page_shift] : table[pos / p.page_size];
  const int off = p.page_shift >= 0 ? pos & (p.page_size - 1) : pos % p.page_size;
  return ((size_t)page * p.page_size + off) * QK_DIM;
}

// The reference a row's P is taken against (log2 domain): raised to the tile's maximum mx
// only when mx passes it by more than RESCALE_SLACK, so most tiles keep alpha = 1 and skip
// the O rescale (with the exact maximum, some row of a warp's 16 moves in most of the first
// ~100 tiles). P <= 2^RESCALE_SLACK then: exact enough in bf16, far from overflow in l and O.
constexpr float RESCALE_SLACK = 8.f;
__device__ __forceinline__ float running_max(float m_run, float mx) {
  return mx > m_run + RESCALE_SLACK ? mx : m_run;  // -inf + slack = -inf: the first keys raise it
}

// O rows g and g + 8 of a thread (o(j, 0..1) and o(j, 2..3), j < J column blocks of 8) times
// their factors, only when a row maximum moved somewhere in the warp (x1.0 is exact, so
// skipping changes nothing; once the maxima settle this saves 4J FMULs a tile).
template <int J = 32, class O>
__device__ __forceinline__ void rescale_rows(const float (&alpha)[2], O o) {
  if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
    for (int j = 0; j < J; ++j) {
      o(j, 0) *= alpha[0]; o(j, 1) *= alpha[0]; o(j, 2) *= alpha[1]; o(j, 3) *= alpha[1];
    }
  }
}

// A split that holds none of request b's keys (a short request under a plan's count, or a
// ragged batch): the combine weighs its rows 0 by their LSE and never uses their O, so the
// CTA writes only the LSEs of its `rows` rows from m0 and leaves. `alone` (split 0 holds the
// whole request and wrote out and lse itself): +inf, which tells the combine to leave the
// rows alone (a split's own LSE is finite or -inf).
__device__ __forceinline__ void write_empty_split(const VerifyParams& p, int b, int split, int m0, int rows,
                                                  bool alone) {
  for (int r = threadIdx.x; r < rows && m0 + r < p.R; r += blockDim.x)
    p.part_lse[((size_t)b * p.num_splits + split) * p.R + m0 + r] = alone ? INFINITY : -INFINITY;
}

// Whether a split with keys writes the request's output (out, lse) rather than partials: one
// split in the plan, or (PER_REQUEST) the split holding every key of its request (ks.alone;
// empty splits left before this, so only split 0 can).
__device__ __forceinline__ bool writes_output(const VerifyParams& p, const SplitKeys& ks) {
  return p.num_splits == 1 || ks.alone;
}

// A thread's share of the epilogue: rows row0 and row0 + 8 (h = 0, 1) of the tile, value
// columns col0 + 8j + 2t (+1) for j < J, read as o(j, 2h) and o(j, 2h + 1) (the mma.sync
// C-fragment order both kernels keep); l and m (log2 domain) per row. One split writes the
// bf16 output and the LSE (lse_writer; `whole`: writes_output); several write their
// normalised O as bf16 partials and their LSEs for the combine. Partials in bf16 (vLLM's paged attention v2 keeps its
// split outputs in the output dtype too): the combine's weights are convex, so a merged
// element carries at most one more bf16 rounding of the partials it mixes, the size of the
// rounding P already takes before PV; half the bytes of float32 for the stores and the
// combine's reads (docs/kernels/verify_attention.md, v7).
// Stores: a quad's bf16 pairs of column blocks j, j + 1 (16 bytes a block) are regrouped by
// two shuffles so each thread stores 8 contiguous bytes and a warp instruction writes whole
// 32-byte sectors: half sectors cost an epilogue dearly (ECC memory merges partial sectors).
template <int J = 32, class O>
__device__ __forceinline__ void write_rows(const VerifyParams& p, int b, int split, int row0, int col0,
                                           int t, const float (&l)[2], const float (&m)[2],
                                           bool lse_writer, bool whole, O o) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + 8 * h;
    const bool live = row < p.R;
    // The shuffles below need the whole warp, so only a warp with no live row skips
    // (the mma.sync kernel's upper 8 rows when R = 8).
    if (!__any_sync(0xffffffffu, live)) continue;
    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
    const size_t orow = whole ? (size_t)b * p.R + row : ((size_t)b * p.num_splits + split) * p.R + row;
    __nv_bfloat16* dst = (whole ? p.out : p.part_out) + orow * V_DIM + col0 + 4 * t;
    static_assert(J % 2 == 0, "column blocks go in pairs");
#pragma unroll
    for (int j = 0; j < J; j += 2) {
      const uint32_t a = pack_bf16(o(j, 2 * h) * inv, o(j, 2 * h + 1) * inv);          // block j
      const uint32_t c = pack_bf16(o(j + 1, 2 * h) * inv, o(j + 1, 2 * h + 1) * inv);  // block j + 1
      // Pairs 0..3 of block j then 0..3 of block j + 1; thread t ends with pairs 2t, 2t + 1.
      const uint32_t x = __shfl_xor_sync(0xffffffffu, t < 2 ? c : a, 2);
      const uint32_t lo = t < 2 ? a : x, hi = t < 2 ? x : c;
      const uint32_t y = __shfl_xor_sync(0xffffffffu, (t & 1) ? lo : hi, 1);
      if (live) *reinterpret_cast<uint2*>(dst + j * 8) = (t & 1) ? make_uint2(y, hi) : make_uint2(lo, y);
    }
    if (live && lse_writer) {
      const float lse = l[h] > 0.f ? (m[h] + log2f(l[h])) * LN2 : -INFINITY;
      (whole ? p.lse : p.part_lse)[orow] = lse;
    }
  }
}

// The combine of a split launch (verify_combine.cu), launched after the attention kernel:
// plainly, as its programmatic dependent (the attention kernel triggers it), or as a
// dependent held to ceil(CTAs / SMs) CTAs an SM (the plan's rule, verify_plan.cu).
// combine_ctas: the CTAs it launches.
enum CombineLaunch {
  COMBINE_PLAIN = 0,
  COMBINE_PROGRAMMATIC = 1,
  COMBINE_PROGRAMMATIC_HELD = 2,
};
// row0: the first row of each request it merges (TAIL_SPLITS plans: the last row tile's).
int launch_verify_combine(const VerifyParams& p, int B, int row0, cudaStream_t st, int how, const DeviceFacts& d);
long long combine_ctas(int B, int R, int num_splits);

// The wgmma kernel's host side (sm90/verify_attention_wgmma.cu; built only with sm_90a):
// its launcher (copy and merge as planned; `merged`: the splits merged in the kernel, so
// no combine follows), shared memory a CTA (one CTA an SM), the copy path this page size
// takes (the plan's copy code: 0 cp.async, 1 TMA page slabs, 3 runs), and whether a launch
// of B requests with these splits on that copy path merges them in clusters on `device`.
// `path`: KD_VERIFY_*.
int launch_verify_wgmma(const VerifyParams& p, int B, cudaStream_t st, int copy, bool merge, bool* merged);
size_t verify_wgmma_smem_bytes();
int verify_wgmma_copy_path(int page_size, int path);
bool verify_wgmma_merges(int device, int B, int R, int copy, int num_splits, int path);
// The mma.sync kernel's host side (verify_attention.cu): the tile (rows a CTA, keys a slot)
// for R query rows on this device, CTAs resident at once with that tile, and its launcher.
struct MmaTile {
  int rows, keys;  // query rows a CTA, keys a shared-memory tile
};
MmaTile verify_mma_tile(const DeviceFacts& d, int R);
int verify_mma_wave(const DeviceFacts& d, MmaTile tile, int* ctas);
int launch_verify_mma(const VerifyParams& p, MmaTile tile, int B, cudaStream_t st);
// Keys a shared-memory slot of the mma.sync kernel (16 in sm_120's 32-row tile: verify_attention.cu).
constexpr int MMA_KEYS = 32;
#ifdef KD_VERIFY_PROFILE
extern long long* g_stamps;  // kd_verify_profile_buffer
#endif
// The wgmma kernel's tile: query rows per CTA and keys per shared-memory tile.
constexpr int WGMMA_ROWS = 64;
constexpr int WGMMA_KEYS = 64;

}  // namespace kd
