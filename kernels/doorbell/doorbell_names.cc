// Host-only names of the doorbell codes (no CUDA calls).
#include "kernels/doorbell/doorbell.h"

namespace arfuse {

const char* DoorbellErrorName(uint32_t code) {
  if ((code & ~0xffu) == static_cast<uint32_t>(DoorbellError::kFusionFailed)) {
    const DeviceErrorInfo* e = FindDeviceError(code & 0xffu);
    return e != nullptr ? e->doorbell_text : "fused op failed (workspace poisoned)";
  }
  switch (static_cast<DoorbellError>(code)) {
    case DoorbellError::kNone:
      return "none";
    case DoorbellError::kRingTimeout:
      return "ring timed out before the sidecar took the request; the op did not run";
    case DoorbellError::kRingTimeoutInFlight:
      return "ring timed out after the sidecar took the request; the slot needs a reset";
    case DoorbellError::kStopped:
      return "the sidecar's doorbell plane stopped or the plan was removed";
    case DoorbellError::kBadTokenCount:
      return "token count above the plan's maximum; the op did not run";
    case DoorbellError::kDesynchronized:
      return "completion word already set (a late completion); the slot needs a reset";
    case DoorbellError::kFusionFailed:
      break;
  }
  return "unknown doorbell error";
}

const char* DoorbellOutcomeName(uint32_t outcome) {
  switch (static_cast<DoorbellOutcome>(outcome)) {
    case DoorbellOutcome::kPending:
      return "pending";
    case DoorbellOutcome::kServed:
      return "served";
    case DoorbellOutcome::kIdle:
      return "idle";
    case DoorbellOutcome::kKicked:
      return "kicked";
    case DoorbellOutcome::kStopped:
      return "stopped";
    case DoorbellOutcome::kAborted:
      return "aborted";
    case DoorbellOutcome::kRejected:
      return "rejected";
    case DoorbellOutcome::kFailedInPlace:
      return "failed_in_place";
  }
  return "unknown";
}

}  // namespace arfuse
