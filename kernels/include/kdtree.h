// C ABI of libkdtree: the host API, apart from the kernels (kernels/src/*.cu).
// Every entry point only launches on the given stream: no allocation, no host
// synchronisation, so calls can be captured in CUDA graphs. Pointers are device
// pointers to contiguous row-major arrays; the Python bindings (kdtree/ops.py)
// check shapes, dtypes and devices before calling. Return: a cudaError_t value
// (0 = launched) or one of the KD_ERR_* codes below for a bad argument.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KD_ERR_ARGUMENT 1001   // a size or pointer is out of the supported range

// Tree-build status bits written to `status[b]` (0 = request built normally).
#define KD_STATUS_BUDGET_CLAMPED 1   // budget > D-1: built with D-1 nodes
#define KD_STATUS_NAN_INPUT 2        // NaN or +inf in top_logprobs: tree left root-only
#define KD_STATUS_WARP_LOOP 4        // information only: selected by the heap-exact warp loop
                                     // (rows not certified for threshold selection)


int kd_version(void);

// Best-first DDTree build (spec ddtree.md), byte-identical to kdtree.tree.build_trees.
// top_lp f32 [B, L, K], top_ids i64 [B, L, K], budgets i32 [B], prefix_lens i32 [B] (may be
// NULL: zeros), root_tokens i64 [B] (may be NULL: PAD token). Outputs, padded to D slots:
// node_counts i32 [B], tokens/depths/positions/next_token/next_sibling i64 [B, D],
// parents i32 [B, D], visibility u8 [B, D, D] (may be NULL), visibility_bits i32 [B, D, W]
// with W = ceil(D/32) (may be NULL), status i32 [B].
int kd_build_trees(const float* top_lp, const int64_t* top_ids, const int32_t* budgets,
                   const int32_t* prefix_lens, const int64_t* root_tokens, int B, int L, int K,
                   int D, int32_t* node_counts, int64_t* tokens, int64_t* depths,
                   int32_t* parents, int64_t* positions, int64_t* next_token,
                   int64_t* next_sibling, uint8_t* visibility, int32_t* visibility_bits,
                   int32_t* status, void* stream);

// Caps the build's dynamic shared memory per block (0: the device's own limit) so that a
// large GPU runs the paths a smaller one takes; returns the previous cap. For tests.
int kd_build_set_smem_limit(int bytes);

// Greedy accept (spec ddtree.md section 5). candidates/next_token/next_sibling/target
// i64 [B, D]; accept_index i32 [B, max_depth+1] (global slot ids b*D+i, -1 padded),
// accept_len i32 [B] (root excluded), bonus i64 [B].
int kd_tree_accept(const int64_t* candidates, const int64_t* next_token,
                   const int64_t* next_sibling, const int64_t* target, int B, int D,
                   int max_depth, int32_t* accept_index, int32_t* accept_len, int64_t* bonus,
                   void* stream);

// Greedy accept from parent indices: the same outputs as kd_tree_accept on a tree whose
// lists give each node's children in ascending slot order (the build's). parents i32
// [B, D] (parents[i] < i), node_counts i32 [B] (nodes are slots 1..n; n clamped to
// [0, D-1]); a slot outside 1..n or with a parent outside [0, i) is not in the tree.
// D <= 4096 (KD_ERR_ARGUMENT above).
int kd_tree_accept_parents(const int64_t* candidates, const int32_t* parents,
                           const int32_t* node_counts, const int64_t* target, int B, int D,
                           int max_depth, int32_t* accept_index, int32_t* accept_len,
                           int64_t* bonus, void* stream);

// Tree-verify attention, MLA absorbed form (spec verify_attention.md).
// q bf16 [B, D, H, 576]; kv_cache bf16 [num_pages, page_size, 576]; block_table i32
// [B, max_pages]; seq_lens i32 [B] (= P_b + D); visibility: u8 [B, D, D] (vis_bits == 0)
// or i32 [B, D, ceil(D/32)] bit-packed (vis_bits == 1). out bf16 [B, D, H, 512],
// lse f32 [B, D, H] (natural log). num_splits (1..128) > 1 splits each request's keys; then
// partial_out bf16 [B, num_splits, D*H, 512] (each split's normalised output) and
// partial_lse f32 [B, num_splits, D*H] are the caller's workspace (left unused where
// kd_verify_merges says the launch merges its splits in the kernel). q, kv_cache, out and
// partial_out are copied in 16-byte vectors, so they must be 16-byte aligned
// (KD_ERR_ARGUMENT otherwise; every CUDA allocation is, a view at an offset may not be).
int kd_verify_attention(const void* q, const void* kv_cache, const int32_t* block_table,
                        const int32_t* seq_lens, const void* visibility, int vis_bits,
                        int B, int D, int H, int page_size, int num_pages, int max_pages, float scale,
                        int num_splits, void* out, float* lse, void* partial_out,
                        float* partial_lse, void* stream);

// Whether a launch of B requests over block tables of max_seq keys (max_pages * page_size)
// is small: 2 * B * ceil(max_seq / 64) < the device's SM count. kd_verify_attention decides
// this itself; the host asks here to size splits for the same tile.
int kd_verify_small_launch(int B, int max_seq, int* small);

// The tile the current device gets for R = D*H query rows, this page size and launch size
// (small: kd_verify_small_launch's answer; chosen by R, the kernel path below, the device's
// compute capability and shared memory per block): query rows per CTA, keys per
// shared-memory tile (64 only for the wgmma kernel), CTAs resident at once (one wave, for
// sizing splits on the host) and the wgmma kernel's key copy (0: cp.async or not the wgmma
// kernel; 1: TMA; 2: TMA multicast to pairs of row tiles).
int kd_verify_tile(int R, int page_size, int small, int* rows_per_cta, int* keys_per_tile, int* wave_ctas,
                   int* copy_path);

// Whether a launch of B requests, R rows each, with these splits merges the splits inside
// the attention kernel (*merges = 1: Hopper's TMA path with 2 splits, 16 or more row tiles
// of 64 rows, and clusters that all fit on the GPU at once; no partials are written and no
// combine kernel runs) or, with
// several splits, through partial_out/partial_lse and the combine kernel (*merges = 0).
// small: as for kd_verify_tile.
int kd_verify_merges(int B, int R, int page_size, int num_splits, int small, int* merges);

// Which verify kernel runs: 0 = the device's best (wgmma on Hopper when the library has
// sm_90a, mma.sync elsewhere), 1 = the mma.sync kernel everywhere (so a Hopper GPU tests
// the path other GPUs take), 2 = as 0 but the wgmma kernel copies keys by cp.async, not
// TMA (the path of page sizes that are not multiples of 64), 3 = as 0 but key splits
// always merge through the partials and the combine kernel. Returns the previous setting,
// -1 for another value.
int kd_verify_set_path(int path);

#ifdef __cplusplus
}
#endif
