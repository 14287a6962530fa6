// Host entry points of the wgmma verify kernel's copy paths (sm_90a builds only). Each
// path is instantiated in its own source file (verify_wgmma_*.cu) so they build in parallel;
// verify_attention_wgmma.cu picks one per launch.
#pragma once
#include <cuda.h>  // CUtensorMap (the type only)

#include "../verify_common.cuh"

namespace kd {

// Key-tile copy paths (the plan's `copy` codes): cp.async by warpgroup 1 (any page size),
// TMA issued by one thread (page sizes that are multiples of 64: a tile is one page slab),
// or RUNS (page sizes off 64): a tile whose 64 keys sit in 64 consecutive cache rows goes
// by TMA, any other by cp.async, decided tile by tile (SGLang's page size 1 keeps a
// prefill's keys in one run of rows, so most of a long request's tiles are runs). Code 2
// (TMA multicast to pairs of row tiles) was removed after v16.
constexpr int COPY_CP_ASYNC = 0;
constexpr int COPY_TMA = 1;
constexpr int COPY_RUNS = 3;

// Shared memory of a CTA: Q and two key tiles of 576 columns x 64 rows (bf16, 128-byte
// swizzled), P (64 x 64 bf16), four float rows (rescale, sums, maxima, and the mbarriers of
// the TMA path), plus 1 KB to align the tiles: 231,424 of Hopper's 232,448.
constexpr int WGMMA_TILE_BYTES = QK_DIM / 64 * 64 * 128;
constexpr size_t WGMMA_SMEM_BYTES = 1024 + 3 * WGMMA_TILE_BYTES + 64 * 64 * 2 + 4 * 64 * sizeof(float);

// When key splits merge in one cluster (MERGE): 2 splits a row tile, 16 or more row tiles
// in the launch. Against the combine kernel the merge gains only there: with more splits
// each CTA reads most of its O from the others over slow distributed shared memory
// (docs/kernels/verify_attention.md, v6 and v7).
constexpr int WGMMA_MERGE_MAX_SPLITS = 2;
constexpr int WGMMA_MERGE_MIN_ROW_TILES = 16;

// Launches path (COPY, MERGE) over the grid (row tiles, splits, B); a TMA path reads the
// cache through `kv_map` (tiles of 64 x 64, 128-byte swizzle).
// MERGE (COPY_TMA or COPY_RUNS): the splits of a row tile merge in their cluster, writing out and
// lse themselves (no combine kernel follows).
template <int COPY, bool MERGE>
int launch_verify_wgmma_path(const VerifyParams& p, const CUtensorMap& kv_map, int B, cudaStream_t st);
// Clusters of `splits` CTAs (a row tile's splits) of the merging path COPY resident at once
// on the current device. Unclustered launches need no such query: one CTA an SM.
template <int COPY>
int verify_wgmma_merge_clusters(int splits, int* clusters);

}  // namespace kd
