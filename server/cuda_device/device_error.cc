#include "server/cuda_device/device_error.h"

#include "absl/strings/cord.h"

namespace arfuse {

absl::Status StickyDeviceError(absl::string_view message) {
  absl::Status status = absl::UnavailableError(message);
  status.SetPayload(kStickyDeviceErrorPayload, absl::Cord("1"));
  return status;
}

bool IsStickyDeviceError(const absl::Status& status) {
  return !status.ok() && status.GetPayload(kStickyDeviceErrorPayload).has_value();
}

}  // namespace arfuse
