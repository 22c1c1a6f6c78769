// CUDA-free helpers around device errors, so layers without the toolkit (the daemon's health
// logic, tests in CI) can tell a fatal device error from a recoverable one.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace arfuse {

// Payload type URL attached to statuses caused by a sticky CUDA error.
inline constexpr char kStickyDeviceErrorPayload[] = "type.arfuse.dev/arfuse.StickyDeviceError";

// UNAVAILABLE status carrying the sticky-error payload: the CUDA context is lost, the process
// must report NOT_SERVING and exit non-zero so its supervisor restarts it.
absl::Status StickyDeviceError(absl::string_view message);

// True when `status` was produced by a sticky device error (see cuda_status.h).
bool IsStickyDeviceError(const absl::Status& status);

}  // namespace arfuse
