// What the bindings ask of any libkdtree before and after a call (kdtree.h): the C ABI's
// version, and a sentence for each code an entry point returns.
#include <cuda_runtime.h>

#include "kdtree.h"

extern "C" int kd_version(void) { return KD_ABI_VERSION; }

extern "C" const char* kd_error_string(int code) {
  if (code == KD_ERR_ARGUMENT) return "a size or pointer is outside what the kernel supports";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
