// Cycles a step of a dependent chain costs on this GPU, for the tree build's double-precision
// sums (docs/kernels/tree_build.md, v14 fitted ~50-60 cycles a dependent double add; v15: ~8):
// __dadd_rn chains, the one-deviation walk's step (add, compare, select, count), and float
// adds beside them; one warp alone, then the build's 16 warps of one CTA at once.
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/fp64_chain scripts/fp64_chain_rate.cu
//   /tmp/fp64_chain
#include <cstdio>

constexpr int STEPS = 4096;

// MODE 0: x = x + y (double); 1: the walk's step; 2: x = x + y (float). Each thread's chain
// starts from its own input and its result is stored, so nothing folds away.
template <int MODE>
__global__ void chain(const double* in, double* out, long long* cycles, double tau) {
  const int tid = threadIdx.x;
  double x = in[tid], y = -in[tid + 1] * 1e-30;  // y <= 0, as the log-probs
  float xf = (float)x, yf = (float)y;
  int below = 0;
  __syncthreads();
  const long long t0 = clock64();
#pragma unroll 16
  for (int i = 0; i < STEPS; ++i) {
    if constexpr (MODE == 0) {
      x = __dadd_rn(x, y);
    } else if constexpr (MODE == 1) {
      const double next = __dadd_rn(x, y);
      const bool on = next >= tau;
      below += on;
      x = on ? next : x;
    } else {
      xf = __fadd_rn(xf, yf);
    }
  }
  const long long t1 = clock64();
  out[tid] = x + xf + below;
  if ((tid & 31) == 0) cycles[tid >> 5] = t1 - t0;
}

template <int MODE>
void run(const char* name, const double* in, double* out, long long* cycles, int threads) {
  chain<MODE><<<1, threads>>>(in, out, cycles, -1e300);  // warm-up
  chain<MODE><<<1, threads>>>(in, out, cycles, -1e300);
  cudaDeviceSynchronize();
  long long c[16];
  cudaMemcpy(c, cycles, sizeof(long long) * (threads / 32), cudaMemcpyDeviceToHost);
  long long worst = 0;
  for (int w = 0; w < threads / 32; ++w) worst = c[w] > worst ? c[w] : worst;
  printf("%-28s %3d warps: %6.1f cycles a step (slowest warp)\n", name, threads / 32, (double)worst / STEPS);
}

int main() {
  double *in, *out;
  long long* cycles;
  cudaMalloc(&in, 513 * sizeof(double));
  cudaMalloc(&out, 512 * sizeof(double));
  cudaMalloc(&cycles, 16 * sizeof(long long));
  double h[513];
  for (int i = 0; i < 513; ++i) h[i] = 1.0 + i * 1e-3;
  cudaMemcpy(in, h, sizeof(h), cudaMemcpyHostToDevice);
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  printf("%s\n", prop.name);
  for (int threads : {32, 512}) {
    run<0>("dependent __dadd_rn", in, out, cycles, threads);
    run<1>("walk step (add, >=, select)", in, out, cycles, threads);
    run<2>("dependent __fadd_rn", in, out, cycles, threads);
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) { printf("error: %s\n", cudaGetErrorString(e)); return 1; }
  return 0;
}
