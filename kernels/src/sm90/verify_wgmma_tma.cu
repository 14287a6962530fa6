// The wgmma verify kernel's TMA copy path, one CTA a cluster (an odd number of row tiles).
#include "verify_wgmma.cuh"

KD_DEFINE_WGMMA_PATH(1)
