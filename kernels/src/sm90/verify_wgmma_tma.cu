// The wgmma verify kernel's TMA copy path without clusters (fewer than 16 row tiles, or an
// odd number).
#include "verify_wgmma.cuh"

KD_DEFINE_WGMMA_PATH(1, false)
