// Types and helpers shared by the kernels of libkdtree.
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "kdtree.h"

#define KD_LAUNCH_CHECK() \
  do { cudaError_t e_ = cudaGetLastError(); if (e_ != cudaSuccess) return (int)e_; } while (0)

#define KD_HD __host__ __device__ inline

namespace kd {

constexpr int QK_DIM = 576;     // latent (512) + rope (64)
constexpr int V_DIM = 512;      // values: the first 512 columns of a cache row
constexpr float NEG_INF_FLOOR = -1.0e4f;   // -inf log-probs are clamped to this (spec 1)
constexpr int64_t PAD_TOKEN = 0;

__host__ __device__ inline int ceil_div(int a, int b) { return (a + b - 1) / b; }

// x / s for 0 <= x < 2^20 and 1 <= s < 2^20, exact: a float quotient, then one correction
// each way (a few instructions; the integer division is a ~20-instruction sequence, and
// in the tree build's once-run code each instruction is also a fetch).
__device__ __forceinline__ int small_div(int x, int s) {
  int q = __float2int_rz(__fdividef((float)x, (float)s));
  q += (q + 1) * s <= x;
  q -= q * s > x;
  return q;
}

}  // namespace kd
