// The threshold selection's state (tree_threshold.cuh): one request's node buffer, sort
// items and scratch carved out of the CTA's shared memory, the nodes' packed meta, the node
// buffer's limits, and the barrier and profile macros the selection's parts share.
#pragma once

#include "tree_select.cuh"

namespace kd {

#ifdef __CUDA_ARCH__
#define KD_BARRIER() __syncthreads()
#else
#define KD_BARRIER() ((void)0)
#endif

// Profile builds (-DKD_BUILD_PROFILE): one block (g_prof_block, 0 unless chosen) stamps
// clock64() at phase ends.
#ifdef KD_BUILD_PROFILE
constexpr int KD_PROF_SLOTS = 40;  // scripts/profile_tree_build.py reads as many
__device__ long long g_prof[KD_PROF_SLOTS];
__constant__ int g_prof_block;  // constant: the stamps' test costs no global load
constexpr int KD_PROF_BLOCKS = 256;
__device__ long long g_block_cycles[KD_PROF_BLOCKS];  // per request: tree_build.cu
#endif
#if defined(KD_BUILD_PROFILE) && defined(__CUDA_ARCH__)
#define KD_PROF(k) do { if (threadIdx.x == 0 && blockIdx.x == g_prof_block) g_prof[k] = clock64(); } while (0)
#else
#define KD_PROF(k) ((void)0)
#endif

constexpr int TS_MAX_NODES = 4096;   // node buffer; parent index in 12 bits
constexpr int TS_MIN_NODES = 64;
constexpr int TS_BINS = 256;         // radix digit of 8 bits
constexpr int TS_COUNTERS = TS_BINS + 16;  // three rotating level counters
constexpr int TS_NARROW = TS_COUNTERS + 8;  // where warp 0's narrow levels ended (3 ints)
constexpr int TS_DEPTH = TS_NARROW + 3;     // the tree's depth at the walk's tau (share_tree_depth)
constexpr int TS_SCRATCH_INTS = TS_BINS + 48;

// Node of the enumerated set: parent's buffer index, rank, depth and an inexact-sum flag.
KD_HD uint32_t ts_meta(int parent, int rank, int depth, bool inexact) {
  return (uint32_t)parent | ((uint32_t)rank << 12) | ((uint32_t)depth << 22) | ((uint32_t)inexact << 31);
}
KD_HD int ts_parent(uint32_t m) { return (int)(m & 0xfffu); }
KD_HD int ts_rank(uint32_t m) { return (int)((m >> 12) & 0x3ffu); }
KD_HD int ts_depth(uint32_t m) { return (int)((m >> 22) & 0x1ffu); }
KD_HD bool ts_inexact(uint32_t m) { return (m >> 31) != 0; }

struct SortItem {
  double score;
  uint64_t k0;  // first word of the path key: most ties are settled in registers
  int idx;
  int pad;
};

// Shared-memory views of one request's selection (sizes: kd_threshold_smem_bytes).
struct Threshold {
  float* lp;          // [L][ld] staged log-probs, -inf clamped; dead after enumeration
  uint64_t* keys;     // [cap][KEY_WORDS] path keys, written over lp after enumeration
  double* score;      // [cap]
  uint32_t* meta;     // [cap]
  int* pos;           // [cap + 1] child offsets, compaction targets, then pop indices
  SortItem* items;    // [cap] compaction staging, then the sort
  int* scratch;       // [TS_SCRATCH_INTS] radix histogram and broadcast slots
  unsigned long long* minkey;  // two 64-bit slots: raise_tau's minimum, raise_tau_linear's bin range
  int ld;             // row stride of lp
  int cap;            // node buffer size
};

// Row stride of the staged log-probs for `ld` ranks: odd, so that the rows' same rank falls
// in different shared-memory banks (deviation_bound reads one rank of many rows at once; a
// stride of 256 put them all in one bank).
KD_HD int ts_stride(int ld) { return ld | 1; }

KD_HD size_t ts_smem_bytes(int L, int ld, int cap) {
  const size_t lp = (size_t)L * ts_stride(ld) * sizeof(float), keys = (size_t)cap * KEY_WORDS * 8;
  const size_t a = ((lp > keys ? lp : keys) + 15) & ~(size_t)15;
  return a + (size_t)cap * (sizeof(SortItem) + 8 + 4) + (size_t)(cap + 1) * 4 + TS_SCRATCH_INTS * 4 + 16;
}

// Carve the views out of one 16-byte aligned block.
KD_HD Threshold ts_views(unsigned char* base, int L, int ld, int cap) {
  Threshold t;
  const size_t lp = (size_t)L * ts_stride(ld) * sizeof(float), keys = (size_t)cap * KEY_WORDS * 8;
  const size_t a = ((lp > keys ? lp : keys) + 15) & ~(size_t)15;
  t.lp = reinterpret_cast<float*>(base);
  t.keys = reinterpret_cast<uint64_t*>(base);
  t.items = reinterpret_cast<SortItem*>(base + a);
  const size_t sc = a + (size_t)cap * sizeof(SortItem);
  t.score = reinterpret_cast<double*>(base + sc);
  t.minkey = reinterpret_cast<unsigned long long*>(base + sc + (size_t)cap * 8);
  t.meta = reinterpret_cast<uint32_t*>(base + sc + (size_t)cap * 8 + 16);
  t.pos = reinterpret_cast<int*>(base + sc + (size_t)cap * 12 + 16);
  t.scratch = t.pos + cap + 1;
  t.ld = ts_stride(ld);
  t.cap = cap;
  return t;
}

}  // namespace kd
