// The wgmma verify kernel's copy path for page sizes off 64: TMA for the tiles that are
// runs of consecutive cache rows, cp.async for the others.
#include "verify_wgmma.cuh"

KD_DEFINE_WGMMA_PATH(COPY_RUNS, false)
