// The wgmma verify kernel's TMA copy path, key tiles multicast to clusters of 2 row tiles
// (launched only in KD_VERIFY_MULTICAST=1 builds: the pairs' A/B side).
#include "verify_wgmma.cuh"

KD_DEFINE_WGMMA_PATH(2, false)
