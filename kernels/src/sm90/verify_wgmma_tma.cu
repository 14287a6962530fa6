// The wgmma verify kernel's TMA copy path (page slabs), splits merged by the combine kernel
// or not split.
#include "verify_wgmma.cuh"

KD_DEFINE_WGMMA_PATH(COPY_TMA, false)
