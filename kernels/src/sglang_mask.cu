// SGLang's custom tree mask (spec sglang.md, step 4), built on the GPU from the padded
// visibility: request b's block of bytes (bool or uint8) [q, P_b + q] at mask_indptr[b],
// prefix columns 1, then its q x q visibility row. One CTA a (row, request). The prefix,
// most of the bytes, goes out as 16-byte stores; a block that would end past `capacity`
// bytes is not written (a device-side length cannot be checked on the host without a sync).
#include "common.cuh"

namespace kd {
namespace {

__global__ void custom_mask_kernel(const uint8_t* vis, const int64_t* prefix_lens, const int64_t* indptr,
                                   int q, int64_t capacity, uint8_t* mask) {
  const int row = blockIdx.x, b = blockIdx.y;
  const int64_t P = prefix_lens[b] > 0 ? prefix_lens[b] : 0;
  const int64_t width = P + q;
  const int64_t start = indptr[b];
  if (start < 0 || start + (int64_t)q * width > capacity) return;
  uint8_t* dst = mask + start + (int64_t)row * width;
  const uint8_t* src = vis + ((int64_t)b * q + row) * q;
  const int tid = threadIdx.x, nt = blockDim.x;
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

extern "C" int kd_sglang_custom_mask(const uint8_t* visibility, const int64_t* prefix_lens,
                                     const int64_t* mask_indptr, int bs, int q, int64_t capacity,
                                     uint8_t* mask, void* stream) {
  if (bs < 0 || q < 1 || bs > 65535 || capacity < 0) return KD_ERR_ARGUMENT;
  if (bs == 0) return 0;
  kd::custom_mask_kernel<<<dim3(q, bs), 256, 0, (cudaStream_t)stream>>>(visibility, prefix_lens, mask_indptr, q,
                                                                         capacity, mask);
  KD_LAUNCH_CHECK();
  return 0;
}
