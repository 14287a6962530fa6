// Greedy tree accept (spec ddtree.md section 5): one thread walks one request's
// left-child / right-sibling lists from the root, as SGLang's verify_tree_greedy does.
#include "common.cuh"

namespace kd {
namespace {

__global__ void tree_accept_kernel(const int64_t* __restrict__ candidates,
                                   const int64_t* __restrict__ next_token,
                                   const int64_t* __restrict__ next_sibling,
                                   const int64_t* __restrict__ target, int B, int D,
                                   int max_depth, int32_t* __restrict__ accept_index,
                                   int32_t* __restrict__ accept_len, int64_t* __restrict__ bonus) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= B) return;
  const size_t row = (size_t)b * D;
  int32_t* idx = accept_index + (size_t)b * (max_depth + 1);
  idx[0] = (int32_t)row;
  int cur = 0, k = 0;
  int64_t want = target[row];
  int64_t child = next_token[row];
  // Each step visits a new slot; the cap keeps a cyclic (corrupt) link list from hanging.
  for (int steps = 0; child >= 0 && child < D && k < max_depth && steps < D; ++steps) {
    if (candidates[row + child] == want) {
      cur = (int)child;
      idx[++k] = (int32_t)(row + cur);
      want = target[row + cur];
      child = next_token[row + cur];
    } else {
      child = next_sibling[row + child];
    }
  }
  for (int j = k + 1; j <= max_depth; ++j) idx[j] = -1;
  accept_len[b] = k;
  bonus[b] = want;
}

}  // namespace
}  // namespace kd

extern "C" int kd_tree_accept(const int64_t* candidates, const int64_t* next_token,
                              const int64_t* next_sibling, const int64_t* target, int B, int D,
                              int max_depth, int32_t* accept_index, int32_t* accept_len,
                              int64_t* bonus, void* stream) {
  if (B < 0 || D < 1 || max_depth < 0) return KD_ERR_ARGUMENT;
  if (B == 0) return 0;
  const int threads = 128;
  kd::tree_accept_kernel<<<kd::ceil_div(B, threads), threads, 0, (cudaStream_t)stream>>>(
      candidates, next_token, next_sibling, target, B, D, max_depth, accept_index, accept_len,
      bonus);
  KD_LAUNCH_CHECK();
  return 0;
}
