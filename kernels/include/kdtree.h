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


// The C ABI's version: the Python bindings refuse a library whose number differs.
#define KD_ABI_VERSION 13
int kd_version(void);
// A sentence for a code an entry point returned: CUDA's for a cudaError_t, kdtree's for a
// KD_ERR_* code; never NULL, and callable without a GPU.
const char* kd_error_string(int code);
// The archs the library was compiled for, as kdtree.build names them, joined by "__"
// ("sm_90a__sm_120__compute_90"; "unknown" for a build by other means).
const char* kd_build_archs(void);

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

// Every launch choice kd_build_trees makes for one shape on the current device (visibility:
// whether either visibility output is asked for). For tests and tools; kd_build_trees makes
// its own.
typedef struct kd_build_plan {
  int B, L, K, D, visibility;  // the shape, as passed
  int wide;         // 1: one CTA an SM (no spills, the linear raise); 0: two CTAs an SM
  int node_buffer;  // the threshold selection's node buffer (0: the warp loop only)
  int staged_ld;    // log-probs staged in shared memory with this row length (0: not staged)
  int path_keys;    // the warp loop's path keys in shared memory
  int vis_smem;     // visibility from bit rows in shared memory
  int smem_bytes;   // dynamic shared memory a CTA
} kd_build_plan;
int kd_build_plan_make(int B, int L, int K, int D, int visibility, kd_build_plan* plan);

// Caps the build's dynamic shared memory per block (0: the device's own limit) so that a
// large GPU runs the paths a smaller one takes; returns the previous cap. For tests.
int kd_build_set_smem_limit(int bytes);

// Greedy accept (spec ddtree.md section 5). candidates/target i64 [B, D]; next_token and
// next_sibling [B, D], i64 (links_i64 = 1) or i32 (links_i64 = 0, SGLang's retrieve links);
// accept_index i32 [B, max_depth+1] (global slot ids b*D+i, -1 padded), accept_len i32 [B]
// (root excluded), bonus i64 [B].
int kd_tree_accept(const int64_t* candidates, const void* next_token, const void* next_sibling,
                   int links_i64, const int64_t* target, int B, int D, int max_depth,
                   int32_t* accept_index, int32_t* accept_len, int64_t* bonus, void* stream);

// Greedy accept from parent indices: the same outputs as kd_tree_accept on a tree whose
// lists give each node's children in ascending slot order (the build's). parents i32
// [B, D] (parents[i] < i), node_counts i32 [B] (nodes are slots 1..n; n clamped to
// [0, D-1]); a slot outside 1..n or with a parent outside [0, i) is not in the tree.
// D <= 4096 (KD_ERR_ARGUMENT above).
int kd_tree_accept_parents(const int64_t* candidates, const int32_t* parents,
                           const int32_t* node_counts, const int64_t* target, int B, int D,
                           int max_depth, int32_t* accept_index, int32_t* accept_len,
                           int64_t* bonus, void* stream);

// Tree-verify attention, MLA absorbed form (spec verify_attention.md), as plan then run:
// kd_verify_plan makes every dispatch choice for one shape on the current device (kernel,
// key copy, splits, how splits merge: the rules in verify_plan.cu), kd_verify_run launches
// that plan on pointers. A plan holds no pointers; keep it as long as the shape holds.
#define KD_VERIFY_AUTO 0            // the device's best kernel
#define KD_VERIFY_MMA_SYNC 1        // the mma.sync kernel everywhere (what sm_120 runs)
#define KD_VERIFY_WGMMA_CP_ASYNC 2  // as AUTO, keys copied by cp.async even where TMA fits
#define KD_VERIFY_WGMMA_COMBINE 3   // as AUTO, key splits always merged by the combine kernel

typedef struct kd_verify_plan {
  // The shape (as passed to kd_verify_plan).
  int B, D, H, page_size, max_pages, path, device;
  // The choices: kernel 0 mma.sync, 1 wgmma; copy 0 cp.async, 1 TMA, 3 TMA for each tile of
  // 64 consecutive cache rows and cp.async for the others (page sizes off 64; 2, multicast
  // pairs, is no longer made); merge 0 one split, 1 splits merged in thread-block clusters,
  // 2 bf16 partials merged by the combine kernel; combine (where a combine runs) 0 a plain
  // launch after the attention kernel, 1 its programmatic dependent, 2 a programmatic
  // dependent held to ceil(CTAs / SMs) CTAs an SM.
  int kernel, copy, rows_per_cta, keys_per_tile, num_splits, merge, small_launch, combine;
  // wave: CTAs of this kernel resident at once. split_base > 0 (per_request plans whose count
  // passes the one-wave fill, split_base): num_splits is the count for max_pages, and a
  // request with fewer keys takes the count the plan's rule gives its own length, from
  // split_base up (its other splits hold no keys); 0: every request takes num_splits.
  // tail 1 (per_request plans where D * H leaves the last row tile part full and the other
  // row tiles fill their waves): those take one split each and write their rows, the last
  // row tile alone takes per-request counts of up to num_splits (split_base 0).
  int wave, split_base, tail;
} kd_verify_plan;

// Plans a launch of B requests, D tree slots and H heads each, over block tables of
// max_pages pages of page_size keys, on the current device. path: KD_VERIFY_*.
// num_splits: 0 lets the plan's rule choose (verify_plan.cu) for max_pages' keys; 1..128
// forces it. per_request 1 (num_splits 0 only): each request takes the rule's count for its
// own keys, for tables much wider than their requests (a server's context length); it costs
// requests as long as the table a few percent.
int kd_verify_plan_make(int B, int D, int H, int page_size, int max_pages, int path, int num_splits,
                        int per_request, kd_verify_plan* plan);

// Runs a plan on the current device (the plan's). q bf16 [B, D, H, 576] (SGLang's
// [B*D, H, 576] is the same memory); kv_cache bf16 [num_pages, page_size, 576] (SGLang's
// token pool [slots, 1, 576] is page_size 1); request b reads its pages from row
// req_rows[b] (or b where req_rows is NULL) of block_table, a row-major table of rows of
// table_stride int32 entries, its first max_pages columns (SGLang's req_to_token with
// req_pool_indices: no per-round copy). seq_lens i32 [B] (= P_b + D). visibility: u8
// [B, D, D] (vis_bits 0) or i32 [B, D, ceil(D/32)] bit-packed (vis_bits 1). out bf16
// [B, D, H, 512], lse f32 [B, D, H] (natural log). With num_splits > 1, partial_out bf16
// [B, num_splits, D*H, 512] and partial_lse f32 [B, num_splits, D*H] are the caller's
// workspace (needed even where the plan merges in clusters: a launch that cannot encode
// its tensor map falls back to the combine). q, kv_cache, out and partial_out must be
// 16-byte aligned (KD_ERR_ARGUMENT otherwise).
int kd_verify_run(const kd_verify_plan* plan, const void* q, const void* kv_cache, int num_pages,
                  const int32_t* block_table, int table_stride, const int32_t* req_rows,
                  const int32_t* seq_lens, const void* visibility, int vis_bits, float scale,
                  void* out, float* lse, void* partial_out, float* partial_lse, void* stream);

// SGLang's custom tree mask (spec sglang.md, step 4): per request b a row-major block of
// bytes [q, P_b + q] at mask + mask_indptr[b], its P_b prefix columns 1 and then the padded
// visibility u8 [bs, q, q] (pad rows and columns 0). prefix_lens [bs], i64 (prefix_i64 = 1)
// or i32 (0); a negative length counts as 0. Writes mask_indptr i64 [bs + 1] (0, then the
// running sum of q (P_b + q)); a block that would end past `capacity` bytes is left
// unwritten. bs <= 65535.
int kd_sglang_custom_mask(const uint8_t* visibility, const void* prefix_lens, int prefix_i64, int bs, int q,
                          int64_t capacity, uint8_t* mask, int64_t* mask_indptr, void* stream);

// SGLang's padded verify layout (spec sglang.md, step 3) from kd_build_trees' outputs for
// bs requests of q slots (d_max = q): node_counts i32 [bs]; tokens, depths, next_token,
// next_sibling i64 [bs, q]; visibility u8 [bs, q, q] (dense); bonus_tokens i64 [bs];
// prefix_lens [bs], i64 (prefix_i64 = 1) or i32 (0). Writes tree_tokens i64 [bs, q] (slots
// past node_counts[b] take bonus_tokens[b]), tree_positions i64 [bs, q] (prefix_lens[b] +
// depth; the prefix length alone past node_counts[b]), retrieve_next_token and
// retrieve_next_sibling i32 [bs, q], tree_visibility u8 [bs, q, q] (pad rows and columns 0).
// bs <= 65535.
int kd_sglang_round_layout(const int32_t* node_counts, const int64_t* tokens, const int64_t* depths,
                           const int64_t* next_token, const int64_t* next_sibling, const uint8_t* visibility,
                           const int64_t* bonus_tokens, const void* prefix_lens, int prefix_i64, int bs, int q,
                           int64_t* tree_tokens, int64_t* tree_positions, int32_t* retrieve_next_token,
                           int32_t* retrieve_next_sibling, uint8_t* tree_visibility, void* stream);

// SGLang's step-6 outputs (spec sglang.md) from kd_tree_accept's with max_depth = q - 1:
// accept_index i32 [bs, q], accept_len i32 [bs], bonus i64 [bs], and the layout's
// tree_tokens i64 [bs, q]. Writes accept_index_out i64 [bs, q], commit_lens i32 [bs]
// (accept_len + 1) and next_token_ids i64 [bs, q] (the accepted tokens, the bonus, zeros).
int kd_sglang_accept_outputs(const int32_t* accept_index, const int32_t* accept_len, const int64_t* bonus,
                             const int64_t* tree_tokens, int bs, int q, int64_t* accept_index_out,
                             int32_t* commit_lens, int64_t* next_token_ids, void* stream);

#ifdef __cplusplus
}
#endif
