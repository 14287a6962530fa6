// The wgmma verify kernel's TMA copy path, key tiles multicast to clusters of 2 row tiles.
#include "verify_wgmma.cuh"

KD_DEFINE_WGMMA_PATH(2, false)
