// SGLang's custom tree mask (spec sglang.md, step 4), built on the GPU from the padded
// visibility: request b's block of bytes (bool or uint8) [q, P_b + q] at mask_indptr[b],
// prefix columns 1, then its q x q visibility row. One CTA a (row, request). Each CTA sums
// the blocks before its own for its start, and the row-0 CTAs write mask_indptr: one launch,
// where a separate scan would be several (each a launch slot in a CUDA graph); the sums read
// at most ceil(bs / 256) lengths a thread, a few at the batches a worker runs. The prefix,
// most of the bytes, goes out as 16-byte stores; a block that would end past `capacity`
// bytes is not written (a device-side length cannot be checked on the host without a sync).
#include "common.cuh"

namespace kd {
namespace {

constexpr int MASK_THREADS = 256;

__device__ __forceinline__ int64_t block_width(const void* prefix_lens, bool prefix_i64, int b, int q) {
  const int64_t P = load_len(prefix_lens, prefix_i64, b);
  return (P > 0 ? P : 0) + q;
}

// Sum over the CTA of each thread's v (every thread gets it).
__device__ int64_t block_sum(int64_t v) {
  __shared__ int64_t s_part[MASK_THREADS / 32];
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) s_part[threadIdx.x >> 5] = v;
  __syncthreads();
  int64_t sum = 0;
#pragma unroll
  for (int w = 0; w < MASK_THREADS / 32; ++w) sum += s_part[w];
  return sum;
}

__global__ void __launch_bounds__(MASK_THREADS)
custom_mask_kernel(const uint8_t* vis, const void* prefix_lens, bool prefix_i64, int q, int64_t capacity,
                   uint8_t* mask, int64_t* indptr) {
  const int row = blockIdx.x, b = blockIdx.y;
  const int tid = threadIdx.x, nt = MASK_THREADS;
  int64_t before = 0;
  for (int j = tid; j < b; j += nt) before += block_width(prefix_lens, prefix_i64, j, q);
  const int64_t width = block_width(prefix_lens, prefix_i64, b, q), P = width - q;
  const int64_t start = (int64_t)q * block_sum(before);
  if (row == 0 && tid == 0) {
    if (b == 0) indptr[0] = 0;
    indptr[b + 1] = start + (int64_t)q * width;
  }
  if (start + (int64_t)q * width > capacity) return;
  uint8_t* dst = mask + start + (int64_t)row * width;
  const uint8_t* src = vis + ((int64_t)b * q + row) * q;
  const int64_t head = min(P, (int64_t)((16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15));
  const int64_t vecs = (P - head) / 16;
  for (int64_t c = tid; c < head; c += nt) dst[c] = 1;
  uint4* v = reinterpret_cast<uint4*>(dst + head);
  const uint4 ones = make_uint4(0x01010101u, 0x01010101u, 0x01010101u, 0x01010101u);
  for (int64_t i = tid; i < vecs; i += nt) v[i] = ones;
  for (int64_t c = head + vecs * 16 + tid; c < P; c += nt) dst[c] = 1;
  for (int c = tid; c < q; c += nt) dst[P + c] = src[c] != 0;
}

}  // namespace
}  // namespace kd

extern "C" int kd_sglang_custom_mask(const uint8_t* visibility, const void* prefix_lens, int prefix_i64, int bs, int q,
                                     int64_t capacity, uint8_t* mask, int64_t* mask_indptr, void* stream) {
  if (bs < 0 || q < 1 || bs > 65535 || capacity < 0 || (prefix_i64 != 0 && prefix_i64 != 1)) return KD_ERR_ARGUMENT;
  if (bs == 0) return 0;
  kd::custom_mask_kernel<<<dim3(q, bs), kd::MASK_THREADS, 0, (cudaStream_t)stream>>>(
      visibility, prefix_lens, prefix_i64 != 0, q, capacity, mask, mask_indptr);
  KD_LAUNCH_CHECK();
  return 0;
}
