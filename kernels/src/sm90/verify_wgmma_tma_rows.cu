// The wgmma verify kernel's row-by-row TMA copy path (page sizes that are not multiples of 64).
#include "verify_wgmma.cuh"

KD_DEFINE_WGMMA_PATH(COPY_TMA_ROWS, false)
