// What the bindings ask of any libkdtree before and after a call (kdtree.h): the C ABI's
// version, and a sentence for each code an entry point returns.
#include <cuda_runtime.h>

#include "kdtree.h"

// kdtree.build passes the archs as one token (sm_90a__sm_120__compute_90).
#ifndef KD_BUILD_ARCHS
#define KD_BUILD_ARCHS unknown  // compiled by other means than kdtree.build
#endif
#define KD_STRINGIFY_(x) #x
#define KD_STRINGIFY(x) KD_STRINGIFY_(x)

extern "C" int kd_version(void) { return KD_ABI_VERSION; }

extern "C" const char* kd_build_archs(void) { return KD_STRINGIFY(KD_BUILD_ARCHS); }

extern "C" const char* kd_error_string(int code) {
  if (code == KD_ERR_ARGUMENT) return "a size or pointer is outside what the kernel supports";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
