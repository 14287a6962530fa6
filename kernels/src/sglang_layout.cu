// SGLang's padded verify layout (spec sglang.md, step 3) from the build's padded outputs, in
// one launch: request b's slots 0..n_b are the tree (n_b = node_counts[b]) at positions
// prefix + depth; the others take the bonus token and the prefix length. The prefix is added
// here, not by the build, so an i64 prefix needs no narrowing copy. The retrieve links are
// narrowed to i32 and the visibility's pad rows and columns cleared. One warp a slot: its
// fields, then its q columns (a row of bytes, written whole by the warp). One launch, since
// in a CUDA graph each launch costs more than this work (docs/sglang.md).
#include "common.cuh"

namespace kd {
namespace {

constexpr int LAYOUT_ROWS = 8;  // slots (warps) a CTA

__global__ void round_layout_kernel(const int32_t* node_counts, const int64_t* tokens, const int64_t* depths,
                                    const int64_t* next_token, const int64_t* next_sibling, const uint8_t* vis,
                                    const int64_t* bonus, const void* prefix_lens, bool prefix_i64, int q,
                                    int64_t* tree_tokens, int64_t* tree_positions, int32_t* retrieve_next_token,
                                    int32_t* retrieve_next_sibling, uint8_t* tree_vis) {
  const int b = blockIdx.y, lane = threadIdx.x & 31;
  const int row = blockIdx.x * LAYOUT_ROWS + (threadIdx.x >> 5);
  if (row >= q) return;
  const int n = node_counts[b];
  const bool in_tree = row <= n;
  const int64_t s = (int64_t)b * q + row;
  if (lane == 0) {
    tree_tokens[s] = in_tree ? tokens[s] : bonus[b];
    tree_positions[s] = load_len(prefix_lens, prefix_i64, b) + (in_tree ? depths[s] : 0);
    retrieve_next_token[s] = (int32_t)next_token[s];
    retrieve_next_sibling[s] = (int32_t)next_sibling[s];
  }
  const uint8_t* src = vis + s * q;
  uint8_t* dst = tree_vis + s * q;
  for (int c = lane; c < q; c += 32) dst[c] = in_tree && c <= n && src[c] != 0;
}

}  // namespace
}  // namespace kd

extern "C" int kd_sglang_round_layout(const int32_t* node_counts, const int64_t* tokens, const int64_t* depths,
                                      const int64_t* next_token, const int64_t* next_sibling,
                                      const uint8_t* visibility, const int64_t* bonus_tokens,
                                      const void* prefix_lens, int prefix_i64, int bs, int q, int64_t* tree_tokens,
                                      int64_t* tree_positions, int32_t* retrieve_next_token,
                                      int32_t* retrieve_next_sibling, uint8_t* tree_visibility, void* stream) {
  if (bs < 0 || q < 1 || bs > 65535 || (prefix_i64 != 0 && prefix_i64 != 1)) return KD_ERR_ARGUMENT;
  if (bs == 0) return 0;
  const dim3 grid(kd::ceil_div(q, kd::LAYOUT_ROWS), bs);
  kd::round_layout_kernel<<<grid, 32 * kd::LAYOUT_ROWS, 0, (cudaStream_t)stream>>>(
      node_counts, tokens, depths, next_token, next_sibling, visibility, bonus_tokens, prefix_lens, prefix_i64 != 0, q,
      tree_tokens, tree_positions, retrieve_next_token, retrieve_next_sibling, tree_visibility);
  KD_LAUNCH_CHECK();
  return 0;
}
