// Tree-verify attention: the dispatch heuristics (one table) and the C entry points.
//
// kd_verify_plan_make decides everything about a launch once per shape; kd_verify_run
// only checks pointers and launches the plan. The rules, in the order they apply:
//
// | choice  | rule                                                                      |
// |---------|---------------------------------------------------------------------------|
// | small   | 2 * B * ceil(max_seq / 64) < SMs: too few 32-key tiles to reach every SM  |
// | kernel  | wgmma where the build has sm_90a, the device is 9.0, its shared memory    |
// |         | holds the tile, and not (R <= 64 rows in a small launch); else mma.sync   |
// | rows    | wgmma 64; mma.sync the fewest of 16/32/64 that cover R and fit            |
// | copy    | wgmma: TMA where page_size % 64 == 0 and the encoder exists, one CTA a    |
// |         | tile; other page sizes: TMA for each tile of 64 consecutive cache rows,   |
// |         | cp.async otherwise                                                        |
// | ahead   | wgmma page-slab TMA, R > 64: the next tile's table entry read a tile      |
// |         | ahead (in the kernel: the producer's loop)                                |
// | splits  | from the count that fills one wave (wave / (B * row tiles), 1 past it)   |
// |         | up to 16, the one whose waves, CTA turnarounds and combine cost least; at |
// |         | most tiles / (1 if <= 2 row tiles else 2), 1..128; then only those that   |
// |         | hold keys at max_seq. per_request plans past the fill: each request takes |
// |         | the rule's count for its own length in the kernel (fill up to the plan's) |
// | tail    | per_request plans whose last row tile is part full, after at least 8      |
// |         | others whose CTAs leave at most a sixth of their last wave idle: those    |
// |         | take one split each and the last row tile alone per-request counts, up to |
// |         | its count for max_seq (2..16), by the tail rule (tail_split_cost)         |
// | merge   | 2 splits on a TMA path, >= 16 row tiles, clusters all resident: in the    |
// |         | kernel; other splits: bf16 partials and the combine kernel                |
// | combine | on 9.x a programmatic dependent: after mma.sync always; after wgmma where  |
// |         | it launches at most 4 CTAs an SM, held to ceil(CTAs / SMs) an SM; else a   |
// |         | plain launch                                                              |
//
// Why each threshold holds (H200 same-run measurements) is in docs/kernels/verify_attention.md.
#include "verify_common.cuh"

#include <climits>

// How the combine follows the wgmma kernel where the table's rule holds (A/B builds: 0
// plain, 1 a dependent without the hold, 2 as planned).
#ifndef KD_WGMMA_COMBINE
#define KD_WGMMA_COMBINE 2
#endif

namespace kd {
namespace {

bool small_launch(const DeviceFacts& d, int B, long long max_seq) {
  return 2LL * B * ((max_seq + 63) / 64) < d.sms;
}

// How a combine follows the attention kernel (CombineLaunch). After wgmma it is held where
// it launches at most HELD_MAX CTAs an SM: the measured range (the half-row layout's
// registers allow no more than 4 an SM anyway). Not measured on sm_120: a plain launch there.
constexpr int HELD_MAX = 4;
int combine_launch(const DeviceFacts& d, int kernel, int B, int R, int num_splits) {
  if (d.major != 9) return COMBINE_PLAIN;
  if (kernel == 0) return COMBINE_PROGRAMMATIC;
  return combine_ctas(B, R, num_splits) <= (long long)HELD_MAX * d.sms ? KD_WGMMA_COMBINE : COMBINE_PLAIN;
}

bool takes_wgmma(const DeviceFacts& d, int R, bool small, int path) {
#ifdef KD_HAS_SM90A
  return path != KD_VERIFY_MMA_SYNC && d.major == 9 && d.minor == 0 && (R > WGMMA_ROWS || !small) &&
         (size_t)d.smem_optin >= verify_wgmma_smem_bytes();
#else
  (void)d; (void)R; (void)small; (void)path;
  return false;
#endif
}

// The split count (split_cost in verify_common.cuh is the rule's cost): from the count that
// fills one wave (wave / (B x row tiles), or 1 past one wave) up to 16, the least costly for
// max_seq's tiles. The fill alone can leave SMs idle for a whole wave: a request's last row
// tile holds only H rows where D = budget + 1 (B 16, H 8, D 65: 144 CTAs in two waves; B 8:
// 72 CTAs on 132 SMs). A split keeps one key tile where the launch has one or two row tiles
// a request (re-reading Q is cheap there), else two. A per_request plan whose count passes
// the fill has the kernels take it again for each request's own length (request_splits).
struct SplitChoice {
  int count, base;  // base: the fill where count passes it, else 0
};
SplitChoice choose_splits(int B, int R, int row_tiles, long long max_seq, int keys, int wave) {
  const long long ctas = (long long)B * row_tiles > 0 ? (long long)B * row_tiles : 1;
  const long long tiles = (max_seq + keys - 1) / keys;
  const long long per = row_tiles <= 2 ? 1 : 2;
  long long cap = tiles / per;
  if (cap > MAX_SPLITS) cap = MAX_SPLITS;
  if (cap < 1) return {1, 0};
  long long s = ctas > wave ? 1 : wave / ctas;
  if (s > cap) s = cap;
  const long long fill = s;
  // The rule's integers hold while ctas * 16 fits an int; past 2^26 CTAs (half a million
  // waves) one more wave is nothing to split for.
  if (ctas <= (1 << 26) && tiles <= (1 << 30)) {
    const long long rows = (long long)B * R;
    long long best = split_cost((int)ctas, wave, rows, (int)tiles, (int)s);
    for (long long more = s + 1; more <= cap && more <= MAX_SPLITS_PAST_FILL; ++more) {
      const long long c = split_cost((int)ctas, wave, rows, (int)tiles, (int)more);
      if (c < best) best = c, s = more;
    }
  }
  // A split takes ceil(tiles / s) tiles (split_keys): launch only the splits that then hold
  // keys at max_seq, so no CTA and no combine read is spent on an empty one.
  const long long each = (tiles + s - 1) / s;
  const int count = (int)((tiles + each - 1) / each);
  return {count, count > fill ? (int)fill : 0};
}

// The tail rule (the table's `tail` row): where the last of several row tiles holds a
// remainder of rows and the main tiles, one split each, leave at most a sixth of their last
// wave idle, the tail's count for max_seq's tiles (lane rule in the kernel: split_keys);
// 0 where no tail split pays (count 1) or the rule does not apply. Elsewhere the uniform rule
// balances the waves better: a main tile that must wait for an SM runs a whole request late.
// A request's last row tile reads its keys apart from its main tiles, which share theirs in
// L2 as they run together: with fewer than TAIL_MIN_MAIN_TILES main tiles that extra traffic
// cost more than the balance bought at long requests (H100, B 32, H 8, D 33, P 32k: 1.045x).
constexpr int TAIL_MIN_MAIN_TILES = 8;
int choose_tail_splits(int B, int R, int rows, int row_tiles, long long max_seq, int keys, int wave) {
  const long long main_ctas = (long long)(row_tiles - 1) * B;
  const int tail_rows = R - last_tile_row(R, rows);
  if (row_tiles - 1 < TAIL_MIN_MAIN_TILES || tail_rows >= rows || B < 1 ||
      main_ctas + (long long)B * MAX_SPLITS_PAST_FILL > (1 << 26))
    return 0;
  const long long idle = (main_ctas + wave - 1) / wave * wave - main_ctas;
  if (idle * 6 > wave) return 0;
  const long long tiles = (max_seq + keys - 1) / keys;
  if (tiles > (1 << 30)) return 0;
  int best_s = 1;
  long long best = LLONG_MAX;
  for (int s = 1; s <= MAX_SPLITS_PAST_FILL && s <= tiles; ++s) {
    const long long c = tail_split_cost((int)main_ctas, B, s, wave, (long long)B * tail_rows, (int)tiles);
    if (c < best) best = c, best_s = s;
  }
  return best_s > 1 ? best_s : 0;
}

}  // namespace
}  // namespace kd

extern "C" int kd_verify_plan_make(int B, int D, int H, int page_size, int max_pages, int path, int num_splits,
                                   int per_request, kd_verify_plan* plan) {
  if (!plan || B < 0 || D < 1 || H < 1 || page_size < 1 || max_pages < 1 || path < KD_VERIFY_AUTO ||
      path > KD_VERIFY_WGMMA_COMBINE || num_splits < 0 || num_splits > kd::MAX_SPLITS ||
      (per_request != 0 && (per_request != 1 || num_splits != 0)) ||
      (long long)D * H > (1 << 30))
    return KD_ERR_ARGUMENT;
  const kd::DeviceFacts* d = nullptr;
  int rc = kd::device_facts(&d);
  if (rc) return rc;
  kd_verify_plan pl = {};
  pl.B = B; pl.D = D; pl.H = H; pl.page_size = page_size; pl.max_pages = max_pages; pl.path = path;
  pl.device = d->device;
  const int R = D * H;
  const long long max_seq = (long long)max_pages * page_size;
  pl.small_launch = kd::small_launch(*d, B, max_seq);
  int wave = 0;
  if (kd::takes_wgmma(*d, R, pl.small_launch, path)) {
#ifdef KD_HAS_SM90A
    pl.kernel = 1;
    pl.rows_per_cta = kd::WGMMA_ROWS;
    pl.keys_per_tile = kd::WGMMA_KEYS;
    pl.copy = kd::verify_wgmma_copy_path(page_size, path);
    wave = d->sms;  // one CTA an SM on every path (its shared memory); clusters only merge
#endif
  } else {
    pl.kernel = 0;
    const kd::MmaTile tile = kd::verify_mma_tile(*d, R);
    pl.rows_per_cta = tile.rows;
    pl.keys_per_tile = tile.keys;
    pl.copy = 0;
    rc = kd::verify_mma_wave(*d, tile, &wave);
  }
  if (rc) return rc;
  const int row_tiles = kd::ceil_div(R, pl.rows_per_cta);
  pl.wave = wave > 0 ? wave : 1;
  const kd::SplitChoice split = kd::choose_splits(B, R, row_tiles, max_seq, pl.keys_per_tile, pl.wave);
  pl.num_splits = num_splits > 0 ? num_splits : split.count;
  // Per-request counts where the rule's integers hold in the kernel (VerifyParams: 16 bits).
  pl.split_base = per_request && pl.wave <= SHRT_MAX ? split.base : 0;
  const int tail = per_request && pl.wave <= SHRT_MAX
      ? kd::choose_tail_splits(B, R, pl.rows_per_cta, row_tiles, max_seq, pl.keys_per_tile, pl.wave) : 0;
  if (tail > 0) {
    pl.tail = 1;
    pl.num_splits = tail;
    pl.split_base = 0;
  }
  pl.merge = 0;
  if (pl.num_splits > 1) {
    pl.merge = 2;
#ifdef KD_HAS_SM90A
    // Clusters merge every split of a row tile, full or empty: per-request counts take the combine.
    if (pl.kernel == 1 && pl.split_base == 0 && !pl.tail &&
        kd::verify_wgmma_merges(d->device, B, R, pl.copy, pl.num_splits, path))
      pl.merge = 1;
#endif
    // Set where the splits merge in clusters too: a launch that cannot encode its tensor
    // map falls back to the combine.
    pl.combine = kd::combine_launch(*d, pl.kernel, B, pl.tail ? R - kd::last_tile_row(R, pl.rows_per_cta) : R,
                                    pl.num_splits);
  }
  *plan = pl;
  return 0;
}

extern "C" int kd_verify_run(const kd_verify_plan* plan, const void* q, const void* kv_cache, int num_pages,
                             const int32_t* block_table, int table_stride, const int32_t* req_rows,
                             const int32_t* seq_lens, const void* visibility, int vis_bits, float scale,
                             void* out, float* lse, void* partial_out, float* partial_lse, void* stream) {
  if (!plan || num_pages < 1 || table_stride < plan->max_pages || plan->num_splits < 1 ||
      plan->num_splits > kd::MAX_SPLITS || plan->combine < kd::COMBINE_PLAIN ||
      plan->combine > kd::COMBINE_PROGRAMMATIC_HELD)
    return KD_ERR_ARGUMENT;
  if (plan->num_splits > 1 && (!partial_out || !partial_lse)) return KD_ERR_ARGUMENT;
  const long long cta_rows = plan->rows_per_cta > 0 ? plan->rows_per_cta : 1;
  const long long split_ctas = plan->B * (((long long)plan->D * plan->H + cta_rows - 1) / cta_rows);
  const bool per_request = plan->split_base > 0 || plan->tail == 1;
  if (plan->split_base < 0 || plan->split_base > plan->num_splits || plan->tail < 0 || plan->tail > 1 ||
      (plan->tail == 1 && plan->split_base != 0) ||
      (per_request && (plan->num_splits > kd::MAX_SPLITS_PAST_FILL || plan->wave < 1 || plan->wave > SHRT_MAX ||
                       plan->merge != 2 || split_ctas > (1 << 26))))
    return KD_ERR_ARGUMENT;  // not a plan kd_verify_plan_make made
  const auto misaligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 != 0; };
  if (misaligned(q) || misaligned(kv_cache) || misaligned(out) || misaligned(partial_out)) return KD_ERR_ARGUMENT;
  const kd::DeviceFacts* d = nullptr;
  int rc = kd::device_facts(&d);
  if (rc) return rc;
  if (d->device != plan->device) return KD_ERR_ARGUMENT;  // a plan is made for one device
  if (plan->B == 0) return 0;
  kd::VerifyParams p;
  p.q = static_cast<const __nv_bfloat16*>(q);
  p.kv = static_cast<const __nv_bfloat16*>(kv_cache);
  p.block_table = block_table;
  p.req_rows = req_rows;
  p.table_stride = table_stride;
  p.seq_lens = seq_lens;
  p.vis = visibility;
  p.vis_bits = vis_bits;
  p.D = plan->D; p.H = plan->H; p.R = plan->D * plan->H;
  p.page_size = plan->page_size; p.num_pages = num_pages; p.max_pages = plan->max_pages;
  p.num_splits = plan->num_splits;
  p.split_base = plan->tail ? kd::TAIL_SPLITS : (short)plan->split_base;
  p.split_wave = (short)plan->wave;
  p.page_shift = (p.page_size & (p.page_size - 1)) == 0 ? __builtin_ctz((unsigned)p.page_size) : -1;
  p.scale_log2 = scale * kd::LOG2E;
  p.out = static_cast<__nv_bfloat16*>(out);
  p.lse = lse;
  p.part_out = static_cast<__nv_bfloat16*>(partial_out);
  p.part_lse = partial_lse;
#ifdef KD_VERIFY_PROFILE
  p.stamps = kd::g_stamps;
#endif
  cudaStream_t st = (cudaStream_t)stream;
  bool merged = false;  // the splits merged in the attention kernel (clusters on Hopper)
#ifdef KD_HAS_SM90A
  if (plan->kernel == 1) rc = kd::launch_verify_wgmma(p, plan->B, st, plan->copy, plan->merge == 1, &merged);
  else
#endif
    rc = kd::launch_verify_mma(p, {plan->rows_per_cta, plan->keys_per_tile}, plan->B, st);
  if (rc) return rc;
  if (plan->num_splits == 1 || merged) return 0;
  // A tail plan's main row tiles wrote their own rows: the combine takes the last row tile's.
  const int row0 = plan->tail ? kd::last_tile_row(p.R, plan->rows_per_cta) : 0;
  return kd::launch_verify_combine(p, plan->B, row0, st, plan->combine, *d);
}
