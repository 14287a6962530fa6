// Host side of the wgmma verify kernel (sm_90a builds only): which copy path a launch
// takes, the cache's tensor map for the TMA paths, and which launches merge their splits.
//
// TMA needs a 16-byte aligned cache (kd_verify_attention refuses any other) and the
// driver's tensor-map encoder, fetched through the runtime (cudaGetDriverEntryPointByVersion:
// nothing links libcuda). With a page size that is a multiple of 64 every 64-key tile is one
// slab of one page; with any other (SGLang's 1) the kernel checks each tile and copies it by
// TMA where its keys are 64 consecutive cache rows, by cp.async elsewhere (COPY_RUNS). When
// the plan asks for it (KD_VERIFY_WGMMA_CP_ASYNC), warpgroup 1 copies every tile by cp.async.
// No clusters of row tiles: since the single CTA looks its next slab up a tile ahead
// (v14), it is faster than pairs sharing each slab by multicast (v16 in the notes).
// Splits: 2 key splits of a row tile on the TMA path, in launches of 16 or more row tiles
// (verify_wgmma_paths.cuh says why), run as one cluster that merges them in distributed
// shared memory (verify_wgmma.cuh), where those clusters all fit on the GPU at once; the
// merge takes precedence over pairs. Otherwise, or when the
// plan asks for it (KD_VERIFY_WGMMA_COMBINE), the splits write bf16 partials for the
// combine kernel.
#include <atomic>

#include "verify_wgmma_paths.cuh"

namespace kd {
namespace {

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*,
                                 CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                                 CUtensorMapFloatOOBfill);

EncodeTiled encoder() {
  static EncodeTiled fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) !=
            cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      f = nullptr;
    return reinterpret_cast<EncodeTiled>(f);
  }();
  return fn;
}

// The cache [num_pages * page_size rows, 576] as 64 x 64 boxes, 128-byte swizzled (the
// kernel's tile layout), with L2 promotion to 128 bytes, one box row: at 256 bytes the
// memory-bound streams ran 5-7% slower (v17 in the notes).
// The last map is kept per thread: callers reuse one cache.
bool kv_map(const VerifyParams& p, CUtensorMap* out) {
  struct Last {
    const void* kv = nullptr;
    uint64_t rows = 0;
    CUtensorMap map;
  };
  thread_local Last last;
  const uint64_t rows = (uint64_t)p.num_pages * p.page_size;
  if (last.kv == p.kv && last.rows == rows) {
    *out = last.map;
    return true;
  }
  EncodeTiled enc = encoder();
  if (!enc) return false;
  const cuuint64_t dims[2] = {QK_DIM, rows};
  const cuuint64_t strides[1] = {QK_DIM * sizeof(__nv_bfloat16)};
  const cuuint32_t box[2] = {64, 64};
  const cuuint32_t elem[2] = {1, 1};
  CUtensorMap m;
  if (enc(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<__nv_bfloat16*>(p.kv), dims, strides, box, elem,
          CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return false;
  last.kv = p.kv;
  last.rows = rows;
  last.map = m;
  *out = m;
  return true;
}

// Clusters of `splits` CTAs (MERGE) of copy path `copy` (COPY_TMA or COPY_RUNS) resident at once on
// device `dev`, asked once per device, path and size (kept plus one: static zeros mean not
// asked). A failed query gives 0, so that launch does not merge, and is asked again next time.
int merge_clusters(int dev, int copy, int splits) {
  static std::atomic<int> known[MAX_DEVICES][2][WGMMA_MERGE_MAX_SPLITS + 1];
  if (dev < 0 || dev >= MAX_DEVICES) return 0;
  std::atomic<int>& k = known[dev][copy == COPY_RUNS][splits];
  const int kept = k.load(std::memory_order_relaxed);
  if (kept > 0) return kept - 1;
  int clusters = 0;
  const int rc = copy == COPY_RUNS ? verify_wgmma_merge_clusters<COPY_RUNS>(splits, &clusters)
                                   : verify_wgmma_merge_clusters<COPY_TMA>(splits, &clusters);
  if (rc != 0) {
    cudaGetLastError();  // leaves no error behind for the caller's next check
    return 0;
  }
  k.store(clusters + 1, std::memory_order_relaxed);
  return clusters;
}

}  // namespace

// The copy path for this page size: COPY_CP_ASYNC, COPY_TMA or COPY_RUNS (a cache too
// large for a tensor map falls back to cp.async at launch, launch_verify_wgmma).
int verify_wgmma_copy_path(int page_size, int path) {
  if (path == KD_VERIFY_WGMMA_CP_ASYNC || !encoder()) return COPY_CP_ASYNC;
  return page_size % 64 == 0 ? COPY_TMA : COPY_RUNS;
}

bool verify_wgmma_merges(int device, int B, int R, int copy, int num_splits, int path) {
  if (path == KD_VERIFY_WGMMA_COMBINE || num_splits < 2 || num_splits > WGMMA_MERGE_MAX_SPLITS ||
      copy == COPY_CP_ASYNC)
    return false;
  const int64_t row_tiles = (int64_t)B * ceil_div(R, WGMMA_ROWS);
  if (row_tiles < WGMMA_MERGE_MIN_ROW_TILES) return false;
  return row_tiles <= merge_clusters(device, copy, num_splits);
}

// The plan's copy path, unless the cache is too large for a tensor map (2^31 rows and more)
// or its map cannot be encoded: then cp.async, and the splits (if any) go to the combine
// kernel.
int launch_verify_wgmma(const VerifyParams& p, int B, cudaStream_t st, int copy, bool merge, bool* merged) {
  CUtensorMap map = {};
  if (copy != COPY_CP_ASYNC && ((int64_t)p.num_pages * p.page_size >= (int64_t{1} << 31) || !kv_map(p, &map)))
    copy = COPY_CP_ASYNC;
  *merged = copy != COPY_CP_ASYNC && merge;
  if (*merged)
    return copy == COPY_RUNS ? launch_verify_wgmma_path<COPY_RUNS, true>(p, map, B, st)
                             : launch_verify_wgmma_path<COPY_TMA, true>(p, map, B, st);
  switch (copy) {
    case COPY_TMA: return launch_verify_wgmma_path<COPY_TMA, false>(p, map, B, st);
    case COPY_RUNS: return launch_verify_wgmma_path<COPY_RUNS, false>(p, map, B, st);
    default: return launch_verify_wgmma_path<COPY_CP_ASYNC, false>(p, map, B, st);
  }
}

size_t verify_wgmma_smem_bytes() { return WGMMA_SMEM_BYTES; }

}  // namespace kd
