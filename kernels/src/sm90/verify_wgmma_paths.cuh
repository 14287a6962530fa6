// Host entry points of the wgmma verify kernel's copy paths (sm_90a builds only). Each
// path is instantiated in its own source file (verify_wgmma_*.cu) so they build in parallel;
// verify_attention_wgmma.cu picks one per launch.
#pragma once
#include <cuda.h>  // CUtensorMap (the type only)

#include "../verify_common.cuh"

namespace kd {

// Key-tile copy paths: cp.async by warpgroup 1 (any page size), or TMA issued by one
// thread, in clusters of 1 or 2 CTAs (pairs share each tile by multicast).
constexpr int COPY_CP_ASYNC = 0;

// Shared memory of a CTA: Q and two key tiles of 576 columns x 64 rows (bf16, 128-byte
// swizzled), P (64 x 64 bf16), four float rows (rescale, sums, maxima, and the mbarriers of
// the TMA path), plus 1 KB to align the tiles: 231,424 of Hopper's 232,448.
constexpr int WGMMA_TILE_BYTES = QK_DIM / 64 * 64 * 128;
constexpr size_t WGMMA_SMEM_BYTES = 1024 + 3 * WGMMA_TILE_BYTES + 64 * 64 * 2 + 4 * 64 * sizeof(float);

// When key splits merge in one cluster (MERGE): 2 splits a row tile, 16 or more row tiles
// in the launch. H200, same-run graph times against the combine kernel (bf16 partials, a
// warp per half row; three rounds, kernels/NOTES.md v7): 2 splits gain 1-4 us at 64 row
// tiles (B 1, H 64, D 64: P 1k 29.6 -> 26.7 us, P 32k 475 -> 465), tie at 32 and lose
// ~1 us at 8; 3 splits lose 1.4-2.5 us at 8 and 32 row tiles; 4 or more lost to the float32
// combine already (v6: each CTA reads 3/4 or more of its 128 KB from the others, at about
// 30 GB/s an SM).
constexpr int WGMMA_MERGE_MAX_SPLITS = 2;
constexpr int WGMMA_MERGE_MIN_ROW_TILES = 16;

// Launches path (COPY, MERGE) over the grid (row tiles, splits, B); a TMA path reads the
// cache through `kv_map` (tiles of 64 x 64, 128-byte swizzle), grid.x a multiple of COPY.
// MERGE (COPY 1 only): the splits of a row tile merge in their cluster, writing out and
// lse themselves (no combine kernel follows).
template <int COPY, bool MERGE>
int launch_verify_wgmma_path(const VerifyParams& p, const CUtensorMap& kv_map, int B, cudaStream_t st);
// CTAs of path (COPY, MERGE) resident at once on the current device, with `splits` a row
// tile (MERGE's cluster size).
template <int COPY, bool MERGE>
int verify_wgmma_path_wave(int splits, int* ctas);

}  // namespace kd
