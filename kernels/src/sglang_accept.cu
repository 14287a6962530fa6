// SGLang's step-6 outputs (spec sglang.md) from tree_accept's, in one launch: accept_index
// widened to i64 (-1 padded as it comes), commit_lens = accept_len + 1 (the root counts),
// next_token_ids = the accepted path's tokens in order, then the bonus, then zeros. One CTA a
// request. One launch, since in a CUDA graph each launch costs more than this work.
#include "common.cuh"

namespace kd {
namespace {

__global__ void accept_outputs_kernel(const int32_t* accept_index, const int32_t* accept_len, const int64_t* bonus,
                                      const int64_t* tree_tokens, int q, int64_t* accept_index_out,
                                      int32_t* commit_lens, int64_t* next_token_ids) {
  const int b = blockIdx.x;
  const int len = accept_len[b];
  const int64_t row = (int64_t)b * q;
  if (threadIdx.x == 0) commit_lens[b] = len + 1;
  for (int k = threadIdx.x; k < q; k += blockDim.x) {
    accept_index_out[row + k] = accept_index[row + k];
    int64_t token = 0;
    if (k < len) {  // path node k + 1, a global slot b * q + i with i in [1, q)
      const int64_t i = accept_index[row + k + 1] - row;
      token = tree_tokens[row + (i > 0 ? i : 0)];
    } else if (k == len) {
      token = bonus[b];
    }
    next_token_ids[row + k] = token;
  }
}

}  // namespace
}  // namespace kd

extern "C" int kd_sglang_accept_outputs(const int32_t* accept_index, const int32_t* accept_len,
                                        const int64_t* bonus, const int64_t* tree_tokens, int bs, int q,
                                        int64_t* accept_index_out, int32_t* commit_lens, int64_t* next_token_ids,
                                        void* stream) {
  if (bs < 0 || q < 1) return KD_ERR_ARGUMENT;
  if (bs == 0) return 0;
  kd::accept_outputs_kernel<<<bs, 128, 0, (cudaStream_t)stream>>>(accept_index, accept_len, bonus, tree_tokens, q,
                                                                  accept_index_out, commit_lens, next_token_ids);
  KD_LAUNCH_CHECK();
  return 0;
}
