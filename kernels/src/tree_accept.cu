// Greedy tree accept (spec ddtree.md section 5), walking the left-child / right-sibling
// lists from the root as SGLang's verify_tree_greedy does. The lists come as i64 (the
// build's) or i32 (SGLang's retrieve links), read as given: a widening copy would be a
// launch of its own.
//
// The walk is a chain of dependent loads, so its cost is their latency: the batch's time
// is a fixed part plus ~70-100 cycles for each slot its longest walk tests. A group of
// threads per request copies the request's rows to shared memory (each thread loads all
// its slots before it stores any: one round trip to L2, not one a slot), then its first
// thread walks there, loading both possible next slots before the compare that picks one.
// Small trees take a warp per request (4 a CTA); from D > 64 a request gets the whole
// 128-thread CTA, so its copy is one round trip too. Rows too wide for shared memory walk
// global memory.
#include "common.cuh"

namespace kd {
namespace {

constexpr int ACCEPT_THREADS = 128;
constexpr int ACCEPT_WARPS = ACCEPT_THREADS / 32;    // requests per CTA, at most
constexpr size_t ACCEPT_SMEM_MAX = 96 * 1024;        // fits sm_90 and sm_120 opt-in limits
constexpr int COPY_SLOTS = 4;                        // slots a thread copies per round trip

// One slot as the walk reads it (two 16-byte loads). In shared memory the links are byte
// offsets from the row's first slot, and "none" is the offset of a sentinel slot after
// the row, so a visit's next loads need no clamp and no multiply; in global memory they
// are slot indices and "none" is -1. alignas(16) pads it to 32 bytes.
struct alignas(16) Slot {
  int64_t cand;
  int64_t tgt;
  int32_t child;   // first child
  int32_t next;    // next sibling
};
static_assert(sizeof(Slot) == 32, "slot offsets assume 32-byte slots");

// A slot's first 24 bytes from shared memory. Volatile, so that the compiler issues both
// next slots' loads before the compare (left to itself, it moves each load into the branch
// that uses it, and a visit costs a load, a compare and a branch in a row).
__device__ __forceinline__ Slot load_slot(uint32_t addr) {
  uint32_t c0, c1, t0, t1, child, next;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(c0), "=r"(c1), "=r"(t0), "=r"(t1) : "r"(addr));
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2 + 16];" : "=r"(child), "=r"(next) : "r"(addr));
  Slot v;
  v.cand = (int64_t)(((uint64_t)c1 << 32) | c0);
  v.tgt = (int64_t)(((uint64_t)t1 << 32) | t0);
  v.child = (int32_t)child;
  v.next = (int32_t)next;
  return v;
}

// Shared memory per request: D slots and the sentinel.
__host__ __device__ inline size_t accept_row_bytes(int D) { return (size_t)(D + 1) * sizeof(Slot); }

__device__ __forceinline__ int32_t link_or_none(int64_t x, int D) {
  return (int32_t)(x >= 0 && x < D ? x : -1);  // out of range ends the walk
}

// The walk: from the root's first child, descend on a match, else go to the next sibling.
// Every tested slot counts a step, and the walk stops after D steps, so a cyclic (corrupt)
// list cannot hang it. at(link) gives a slot, none is the link that ends a list, slot_of
// turns a link into a slot index. Returns the accepted count; idx gets their global slot
// ids, *want the bonus token.
template <class At, class SlotOf>
__device__ __forceinline__ int walk(At at, int32_t none, SlotOf slot_of, int D, int max_depth,
                                    size_t row, int32_t* idx, int64_t* want) {
  const Slot root = at(0);
  *want = root.tgt;
  int32_t link = root.child;
  int k = 0;
  if (link == none || max_depth < 1) return 0;
  Slot r = at(link);
  for (int steps = 1;; ++steps) {  // r = the slot at link, the steps-th tested
    // Both possible next slots load before the compare that picks one.
    const Slot down = at(r.child), across = at(r.next);
    if (r.cand == *want) {
      idx[++k] = (int32_t)(row + slot_of(link));
      *want = r.tgt;
      link = r.child;
      r = down;
    } else {
      link = r.next;
      r = across;
    }
    if (link == none || k >= max_depth || steps >= D) return k;
  }
}

// GROUP threads per request: 32 (a warp; ACCEPT_WARPS requests a CTA) or ACCEPT_THREADS.
// Link: the lists' element type, int64_t or int32_t.
template <bool STAGED, int GROUP, class Link>
__global__ void __launch_bounds__(ACCEPT_THREADS)
tree_accept_kernel(const int64_t* __restrict__ candidates, const Link* __restrict__ next_token,
                   const Link* __restrict__ next_sibling, const int64_t* __restrict__ target,
                   int B, int D, int max_depth, int32_t* __restrict__ accept_index,
                   int32_t* __restrict__ accept_len, int64_t* __restrict__ bonus) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int group = threadIdx.x / GROUP, lane = threadIdx.x % GROUP;
  const int b = blockIdx.x * (ACCEPT_THREADS / GROUP) + group;
  if (b >= B) return;  // the whole group leaves together (a CTA group: all of b's CTA)
  const size_t row = (size_t)b * D;
  const int64_t* cand = candidates + row;
  const int64_t* tgt = target + row;
  int32_t* idx = accept_index + (size_t)b * (max_depth + 1);
  auto group_sync = [] { if (GROUP == 32) __syncwarp(); else __syncthreads(); };
  int k = 0;
  int64_t want = 0;
  __shared__ int s_k[ACCEPT_WARPS];
  if (STAGED) {
    unsigned char* s_row = smem + group * accept_row_bytes(D);
    const int32_t none = D * (int32_t)sizeof(Slot);  // the sentinel's offset
    auto offset = [&](int64_t x) {
      const int32_t i = link_or_none(x, D);
      return i < 0 ? none : i * (int32_t)sizeof(Slot);
    };
    for (int base = 0; base < D; base += COPY_SLOTS * GROUP) {
      int64_t c[COPY_SLOTS], t[COPY_SLOTS];
      Link n[COPY_SLOTS], x[COPY_SLOTS];
#pragma unroll
      for (int u = 0; u < COPY_SLOTS; ++u) {
        const int i = base + u * GROUP + lane;
        if (i < D) c[u] = cand[i], t[u] = tgt[i], n[u] = next_token[row + i], x[u] = next_sibling[row + i];
      }
#pragma unroll
      for (int u = 0; u < COPY_SLOTS; ++u) {
        const int i = base + u * GROUP + lane;
        if (i < D) *reinterpret_cast<Slot*>(s_row + i * sizeof(Slot)) = Slot{c[u], t[u], offset(n[u]), offset(x[u])};
      }
    }
    if (lane == 0)  // the sentinel: its links lead back to itself
      *reinterpret_cast<Slot*>(s_row + none) = Slot{0, 0, none, none};
    group_sync();
    if (lane == 0) {
      idx[0] = (int32_t)row;
      const uint32_t s_addr = smem_addr(s_row);
      k = walk([&](int32_t off) { return load_slot(s_addr + off); }, none,
               [](int32_t off) { return off / (int32_t)sizeof(Slot); }, D, max_depth, row, idx, &want);
    }
  } else if (lane == 0) {  // rows too wide to stage: the same walk over global memory
    idx[0] = (int32_t)row;
    k = walk([&](int32_t i) {
               i = max(i, 0);  // a link of -1 loads slot 0, never used
               return Slot{cand[i], tgt[i], link_or_none(next_token[row + i], D),
                           link_or_none(next_sibling[row + i], D)};
             },
             -1, [](int32_t i) { return i; }, D, max_depth, row, idx, &want);
  }
  // The group learns k from its first thread, then pads the index row in parallel.
  if (lane == 0) s_k[group] = k;
  group_sync();
  k = s_k[group];
  for (int j = k + 1 + lane; j <= max_depth; j += GROUP) idx[j] = -1;
  if (lane == 0) {
    accept_len[b] = k;
    bonus[b] = want;
  }
}

template <bool STAGED, int GROUP, class Link>
int launch_accept(const int64_t* candidates, const Link* next_token, const Link* next_sibling,
                  const int64_t* target, int B, int D, int max_depth, int32_t* accept_index,
                  int32_t* accept_len, int64_t* bonus, cudaStream_t st) {
  constexpr int per_cta = ACCEPT_THREADS / GROUP;
  const size_t smem = STAGED ? per_cta * accept_row_bytes(D) : 0;
  constexpr auto kernel = tree_accept_kernel<STAGED, GROUP, Link>;
  if (smem > 48 * 1024) {  // opt in above the default limit, to the bound of every staged row
    const cudaError_t e = configure_once<kernel>((int)ACCEPT_SMEM_MAX);
    if (e != cudaSuccess) return (int)e;
  }
  kernel<<<ceil_div(B, per_cta), ACCEPT_THREADS, smem, st>>>(
      candidates, next_token, next_sibling, target, B, D, max_depth, accept_index, accept_len, bonus);
  KD_LAUNCH_CHECK();
  return 0;
}

// The launch by row width: a warp a request for small trees, a CTA for wider staged rows,
// global memory past shared memory.
template <class Link>
int accept_by_width(const int64_t* candidates, const Link* next_token, const Link* next_sibling,
                    const int64_t* target, int B, int D, int max_depth, int32_t* accept_index,
                    int32_t* accept_len, int64_t* bonus, cudaStream_t st) {
#define KD_ACCEPT_ARGS candidates, next_token, next_sibling, target, B, D, max_depth, accept_index, \
                       accept_len, bonus, st
  if (D <= 64) return launch_accept<true, 32>(KD_ACCEPT_ARGS);
  if (accept_row_bytes(D) <= ACCEPT_SMEM_MAX) return launch_accept<true, ACCEPT_THREADS>(KD_ACCEPT_ARGS);
  return launch_accept<false, 32>(KD_ACCEPT_ARGS);  // rows too wide to stage (D > ~3000)
#undef KD_ACCEPT_ARGS
}

}  // namespace
}  // namespace kd

extern "C" int kd_tree_accept(const int64_t* candidates, const void* next_token, const void* next_sibling,
                              int links_i64, const int64_t* target, int B, int D, int max_depth,
                              int32_t* accept_index, int32_t* accept_len, int64_t* bonus, void* stream) {
  using namespace kd;
  if (B < 0 || D < 1 || max_depth < 0 || (links_i64 != 0 && links_i64 != 1)) return KD_ERR_ARGUMENT;
  if (B == 0) return 0;
  cudaStream_t st = (cudaStream_t)stream;
  if (links_i64)
    return accept_by_width(candidates, static_cast<const int64_t*>(next_token),
                           static_cast<const int64_t*>(next_sibling), target, B, D, max_depth, accept_index,
                           accept_len, bonus, st);
  return accept_by_width(candidates, static_cast<const int32_t*>(next_token), static_cast<const int32_t*>(next_sibling),
                         target, B, D, max_depth, accept_index, accept_len, bonus, st);
}
