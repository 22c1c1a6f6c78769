// The in-stream kernel image as the sidecar sees it: the embedded fatbin (instream_kernels.cu
// compiled for every architecture of the build) and the names and launch geometry of its entries.
// Host code only; the sidecar loads the image itself (the driver API) to check it and to size
// each entry's grid before it hands the image to a client.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "kernels/instream/attach_abi.h"

namespace arfuse::instream {

// The fatbin with machine code for a GPU of compute capability `sm` (major * 10 + minor), or
// null when the build has none for it; `bytes` receives its size.
const void* KernelImage(uint32_t sm, size_t* bytes);

// Fills everything of `entry` but max_grid for (dtype, pattern, algo, hidden) at this world
// size: the entry's function name, block size (the row layout of the by-value kernels:
// row_math.cuh) and rows divisor. False (entry untouched) when the kernels cannot run that hidden
// (not a positive multiple of 8, above MaxFusionHidden) or the combination is unsupported.
bool DescribeKernelEntry(DType dtype, Pattern pattern, FusionAlgo algo, uint32_t hidden,
                         int world_size, KernelEntry* entry);

}  // namespace arfuse::instream
