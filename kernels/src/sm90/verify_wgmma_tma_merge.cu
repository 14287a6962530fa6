// The wgmma verify kernel's TMA copy path with its key splits (2 by the host's rule) merged
// in their cluster through distributed shared memory (no partials, no combine kernel).
#include "verify_wgmma.cuh"

KD_DEFINE_WGMMA_MERGE_PATH(COPY_TMA)
