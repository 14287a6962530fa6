// Types and helpers shared by the kernels of libkdtree.
#pragma once
#include <atomic>

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
constexpr int MAX_DEVICES = 64;  // per-device tables (facts, attributes, cluster counts) hold this many

// A shared-memory pointer as the 32-bit address the .shared instructions take.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

// What launch paths read off the current device, once per device (so launches query no
// attributes): its index, SMs, shared memory a block may opt in to and an SM holds, compute
// capability, and the shared memory the system reserves a block.
struct DeviceFacts {
  int device, sms, smem_optin, smem_sm, smem_reserved, major, minor, ready;
};
inline int device_facts(const DeviceFacts** out) {
  static DeviceFacts facts[MAX_DEVICES];
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return (int)e;
  if (dev < 0 || dev >= MAX_DEVICES) return KD_ERR_ARGUMENT;
  DeviceFacts& f = facts[dev];
  if (!f.ready) {
    e = cudaDeviceGetAttribute(&f.sms, cudaDevAttrMultiProcessorCount, dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&f.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&f.smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&f.smem_reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&f.major, cudaDevAttrComputeCapabilityMajor, dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&f.minor, cudaDevAttrComputeCapabilityMinor, dev);
    if (e != cudaSuccess) return (int)e;
    f.device = dev;
    f.ready = 1;
  }
  *out = &f;
  return 0;
}

// Kernel's dynamic shared memory bound (and, where carveout >= 0, its shared memory
// carveout), set once per device: attributes live in the device's context, so later
// launches skip the driver calls (host time an eager caller pays). Every caller passes the
// same values for one Kernel, so no launch can find a bound below its own.
template <auto Kernel>
cudaError_t configure_once(int smem_bound, int carveout = -1) {
  static std::atomic<bool> done[MAX_DEVICES];
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (dev < 0 || dev >= MAX_DEVICES) return cudaErrorInvalidDevice;
  if (done[dev].load(std::memory_order_acquire)) return cudaSuccess;
  e = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bound);
  if (e == cudaSuccess && carveout >= 0)
    e = cudaFuncSetAttribute(Kernel, cudaFuncAttributePreferredSharedMemoryCarveout, carveout);
  if (e == cudaSuccess) done[dev].store(true, std::memory_order_release);
  return e;
}

__host__ __device__ inline int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Entry i of a length array that comes as i64 or i32 (SGLang keeps both kinds), read as given:
// a narrowing copy would be a launch of its own.
__device__ __forceinline__ int64_t load_len(const void* lens, bool i64, int i) {
  return i64 ? static_cast<const int64_t*>(lens)[i] : (int64_t) static_cast<const int32_t*>(lens)[i];
}

// Max and sum over the whole warp (every lane gets them); the sum serves the attention's
// float weights and the mask's int64 offsets alike.
__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
template <typename T>
__device__ __forceinline__ T warp_sum(T x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// x / s for 0 <= x < 2^20 and 1 <= s < 2^20, exact: a float quotient, then one correction
// each way (a few instructions; the integer division is a ~20-instruction sequence, and
// in the tree build's once-run code each instruction is also a fetch).
__device__ __forceinline__ int small_div(int x, int s) {
  int q = __float2int_rz(__fdividef((float)x, (float)s));
  q += (q + 1) * s <= x;
  q -= q * s > x;
  return q;
}

// Programmatic dependent launch (sm_90 on): a kernel launched with the programmatic
// stream-serialisation attribute may be scheduled while the kernel before it drains, so its
// launch latency hides behind that kernel's tail. It must call pdl_wait() before it reads
// anything the kernel before wrote. The kernel before may call pdl_launch_dependents():
// the dependent is scheduled once every CTA has called it or exited.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The host side: launches `kernel`, as a programmatic dependent of the kernel before it on
// `st` where `programmatic` (the launch attribute above), else as a plain launch. One place
// for the attribute, so that the build and the verify combine launch alike.
template <class... Params, class... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t st,
                          bool programmatic, Args... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cfg.attrs = attr;
  cfg.numAttrs = programmatic ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

}  // namespace kd
