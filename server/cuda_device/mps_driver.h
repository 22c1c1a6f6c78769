// MPS detection that asks the CUDA driver first (mps.h says why and when it falls back to the
// scan). CUDA builds only: it calls the driver through the shim (server/cudadrv).
#pragma once

#include "server/cuda_device/mps.h"

namespace arfuse {

// CU_DEVICE_ATTRIBUTE_MPS_ENABLED for CUDA device `device` (-1: the current one); kUnknown when
// there is no driver, the device cannot be had, or the driver predates the attribute.
DriverMps QueryDriverMps(int device);

// DetectMps() with the driver's answer for `device`.
MpsInfo DetectMpsOnDevice(int device);

}  // namespace arfuse
