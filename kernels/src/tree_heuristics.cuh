// The tree build's dispatch rules in one place: the kernel a batch takes, the node buffer,
// the first tau (the batch gate, the bounds' pivots), the deep-tree gate and its layout, the
// narrow levels, the raises and the ranks. Each rule says why in a line or two; the
// measurements behind them are in docs/kernels/tree_build.md. KD_* macros are A/B switches
// (scripts/ab.sh builds a side with -DKD_...=...); their defaults are the kept program.
#pragma once

#include "tree_views.cuh"

namespace kd {

// ---- The kernel ------------------------------------------------------------------------
// The wide kernel (one CTA an SM, no spills) wherever the two-CTA kernel could not hold two
// an SM: the batch fits the SMs (every request has one to itself), or a CTA's shared memory
// (cta_smem, its fixed part included) is more than half an SM's. Elsewhere two CTAs an SM
// run the batch in half the waves.
inline bool takes_wide_kernel(int B, int sms, size_t cta_smem, size_t sm_smem) {
  return B <= sms || 2 * cta_smem > sm_smem;
}

// ---- The node buffer -------------------------------------------------------------------
// Node buffer size for a budget: twice the next power of two (the sort pads to one), four
// times from batches of 16 (`batched`) up to WIDE_BUFFER_BUDGET: there ranking up to 4x the
// budget costs less than the raise an overflow takes; at budget 256 the larger candidate
// sets cost more than that at batch 256 (docs/kernels/tree_build.md). At budgets <= 16 both
// give the TS_MIN_NODES minimum.
constexpr int WIDE_BUFFER_BUDGET = 128;
KD_HD int ts_capacity(int budget, bool batched) {
  const int mult = batched && budget <= WIDE_BUFFER_BUDGET ? 4 : 2;
  int c = TS_MIN_NODES;
  while (c < mult * budget && c < TS_MAX_NODES) c <<= 1;
  return c;
}

// ---- The first tau ---------------------------------------------------------------------
// The batch gate's answer for a request's start bound (tree_build.cu): none, only for a deep
// tree (a batch where one request's raise sets the batch's time), or always.
enum StartBound { START_NONE = 0, START_DEEP = 1, START_ALWAYS = 2 };
// A tighter first tau (threshold_select: deviation_bound where K < budget, chain_bound
// otherwise) where the plain start lies far below the budget-th score (K < budget: it is
// then a sum of each depth's K-th log-prob) or some request of the batch would likely
// raise tau: from batch 64, from batch 16 at budget >= 64, from batch 4 at budget 1024
// (docs/kernels/tree_build.md, v3e, v3f and session 21). From batch 16 a deep tree's raise
// would set the batch's time at any budget: START_DEEP.
#ifndef KD_CHAIN_GATE
#define KD_CHAIN_GATE 1  // A/B builds: 0 never, 2 always
#endif
__host__ __device__ __forceinline__ int start_bound(int batch, int budget, int keff) {
  const bool chain_start = KD_CHAIN_GATE == 2 ||
                           (KD_CHAIN_GATE == 1 && (keff < budget || batch >= 64 || (batch >= 16 && budget >= 64) ||
                                                   (batch >= 4 && budget >= 1024)));
  return chain_start ? START_ALWAYS : KD_CHAIN_GATE == 1 && batch >= 16 ? START_DEEP : START_NONE;
}

constexpr int START_PIVOTS = 16;  // pivots a round (the deviation bound: a warp each)
#ifndef KD_START_ROUNDS
#define KD_START_ROUNDS 2  // a third round's searches cost more than the raises it saved
#endif
constexpr int START_ONE_ROUND_BUDGET = 16;  // up to this budget one round left no raise (sweep inputs)

// Pivot rounds of the start and level bounds for `budget`: one round's bound is loose by a
// 17th of the range, which small budgets absorb (budget 64 then raises: docs/kernels/tree_build.md,
// session 26).
KD_HD int start_rounds(int budget) { return budget <= START_ONE_ROUND_BUDGET ? 1 : KD_START_ROUNDS; }

// How the pivots of a bound's rounds lie: `pivots` (<= 32) a round over [lo, hi], evenly,
// or (`squared`) at the squares of the even fractions, dense near lo: the budget-th score
// of the chain's nodes lies in the lowest quarter of [tau, lp[0][0]] for 90% of the sweep's
// requests (both drafters, budgets 64-256: session 28), so there one round of squared
// pivots comes close to what two even rounds reach.
// `step` is 1 / (count + 1), made by make_pivots from the constant counts its callers
// pass: no division on the latency-bound start path.
struct Pivots {
  int count, rounds;
  bool squared;
  double step;
};
KD_HD constexpr Pivots make_pivots(int count, int rounds, bool squared) {
  return Pivots{count, rounds, squared, 1.0 / (count + 1)};
}
KD_HD Pivots even_pivots(int budget) { return make_pivots(START_PIVOTS, start_rounds(budget), false); }
// Past START_ONE_ROUND_BUDGET and up to this budget the chain bound, and the one-deviation
// bound up to batch DEV_ONE_ROUND_MAX_BATCH, take one round of squared pivots (dev_pivots,
// chain_pivots).
constexpr int SQUARED_ROUND_BUDGET = 64;

// The one-deviation bound's pivots: one squared round at batches up to DEV_ONE_ROUND_MAX_BATCH
// (one ~2k-cycle round less for up to ~40% more candidates, which the one-deviation layout
// and its one-word ranks take for less than the round in a batch's slowest request; weighed
// up to batch 64: tree_build.md, v17).
#ifndef KD_DEV_ONE_ROUND_MAX_BATCH
#define KD_DEV_ONE_ROUND_MAX_BATCH 64  // A/B builds: other batch edges
#endif
constexpr int DEV_ONE_ROUND_MAX_BATCH = KD_DEV_ONE_ROUND_MAX_BATCH;
KD_HD Pivots dev_pivots(int budget, int batch) {
  return budget > START_ONE_ROUND_BUDGET && budget <= SQUARED_ROUND_BUDGET && batch <= DEV_ONE_ROUND_MAX_BATCH
             ? make_pivots(START_PIVOTS, 1, true)
             : even_pivots(budget);
}

// The one-deviation bound's row searches without bounds checks (Shar's first step), their
// steps unrolled: its rounds are bound by issue, not latency (3.7-4.9k -> 2.0-2.4k cycles).
#ifndef KD_DEV_LEAN
#define KD_DEV_LEAN 1  // A/B builds: 0, the bounded search
#endif
constexpr bool DEV_LEAN = KD_DEV_LEAN;

// Pivot rounds over the chain's own nodes 0^d r only (the heap's exact sums, one binary
// search per depth): ~4k cycles against deviation_bound's ~20k, and as good where K >=
// budget (no raises at the sweep's shapes), so it serves there. Past START_ONE_ROUND_BUDGET
// and up to SQUARED_ROUND_BUDGET one round of 32 squared pivots at any batch (a round costs
// its latency, ~1.3k cycles at 16 or 32 pivots), the node buffer made 4x the budget for the
// looser tau (see ts_capacity); elsewhere the even pivots (budget 16: one round of 16 was
// 2-4% faster than 32 squared ones at batch 16-256).
KD_HD Pivots chain_pivots(int budget) {
  return budget > START_ONE_ROUND_BUDGET && budget <= SQUARED_ROUND_BUDGET ? make_pivots(32, 1, true)
                                                                          : even_pivots(budget);
}

// ---- The deep-tree gate and the one-deviation layout -----------------------------------
#ifndef KD_DEEP_GATE
#define KD_DEEP_GATE 1  // A/B builds: 0, a deep tree takes the start bound the batch gate gives any tree
#endif
constexpr int DEEP_CHAIN = 8;      // the chain depth that marks a deep tree
constexpr int DEEP_KEFF_MIN = 32;  // narrower rows: the chain bound leaves no raise to save
#ifndef KD_DEEP_KEFF_MAX
#define KD_DEEP_KEFF_MAX 256  // A/B builds: other widths (64 before the one-deviation layout)
#endif
constexpr int DEEP_KEFF_MAX = KD_DEEP_KEFF_MAX;  // the widest rows whose deep trees skip the chain bound
#ifndef KD_ONE_DEV_LAYOUT
#define KD_ONE_DEV_LAYOUT 1  // A/B builds: 0 never
#endif
#ifndef KD_ONE_DEV_KEYS
#define KD_ONE_DEV_KEYS 1  // A/B builds: 0 walks up for every key, laid out or not
#endif
#ifndef KD_ONE_DEV_DEAL_MIN
#define KD_ONE_DEV_DEAL_MIN 128  // A/B builds: 1 deals at every width, 1 << 30 never
#endif
// The narrowest rows whose layout deals the deviations over all threads; narrower rows give
// a warp few enough that one warp a depth costs less than the block scan.
constexpr int ONE_DEV_DEAL_MIN = KD_ONE_DEV_DEAL_MIN;

// ---- Narrow levels (warp 0) ------------------------------------------------------------
constexpr int NARROW_BALLOT_STEPS = 4;  // ballot steps (small rows, grouped ranks) or parents (wider) a narrow level may take
#ifndef KD_NARROW_LEAD_MAX
#define KD_NARROW_LEAD_MAX 2
#endif
constexpr int NARROW_LEAD_MAX = KD_NARROW_LEAD_MAX;  // parents of 16 children or more a grouped narrow level takes first (lead parents)

// ---- Raises ----------------------------------------------------------------------------
constexpr int TS_MAX_RAISES = 16;  // then refuse: ties that no threshold separates
// level_bound's raise only where the level has at most LEVEL_RAISE_MAX parents (a warp's
// searches a pivot) and holds more than LEVEL_RAISE_OVER times the room: a level that
// nearly fits is nearly all materialised, and raise_tau's pick from it is as high for less.
#ifndef KD_LEVEL_RAISE
#define KD_LEVEL_RAISE 1
#endif
constexpr int LEVEL_RAISE_MAX = 512, LEVEL_RAISE_OVER = 2;

// ---- Ranks -----------------------------------------------------------------------------
// rank_count's m^2 compares up to this many candidates; above, bucket_rank's m x (mean bin)
// cost less (docs/kernels/tree_build.md, session 52).
constexpr int RANK_COUNT_MAX = 128;
// bucket_rank declines a bin of more than BUCKET_MAX exact ties (the merge sort takes the set).
#ifndef KD_BUCKET_MAX
#define KD_BUCKET_MAX 128
#endif
#ifndef KD_BUCKET_SORT
#define KD_BUCKET_SORT 1  // A/B builds: 0 merge-sorts every candidate set past RANK_COUNT_MAX
#endif
constexpr int BUCKET_MAX = KD_BUCKET_MAX;

}  // namespace kd
