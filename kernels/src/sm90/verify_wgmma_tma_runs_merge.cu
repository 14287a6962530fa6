// The wgmma verify kernel's runs copy path (page sizes off 64) with its 2 key splits merged
// in their cluster through distributed shared memory, as on the page-slab path.
#include "verify_wgmma.cuh"

KD_DEFINE_WGMMA_MERGE_PATH(COPY_RUNS)
