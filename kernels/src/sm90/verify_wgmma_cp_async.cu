// The wgmma verify kernel's cp.async copy path (any page size).
#include "verify_wgmma.cuh"

KD_DEFINE_WGMMA_PATH(COPY_CP_ASYNC, false)
