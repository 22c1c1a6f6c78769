#include "server/cuda_device/device_error.h"

#include "gtest/gtest.h"

namespace arfuse {
namespace {

TEST(DeviceError, StickyErrorIsUnavailableAndMarked) {
  absl::Status s = StickyDeviceError("cuda call x failed: cudaErrorIllegalAddress");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(s.message().find("cudaErrorIllegalAddress"), absl::string_view::npos);
  EXPECT_TRUE(IsStickyDeviceError(s));
}

TEST(DeviceError, OrdinaryErrorsAreNotSticky) {
  EXPECT_FALSE(IsStickyDeviceError(absl::UnavailableError("peer gone")));
  EXPECT_FALSE(IsStickyDeviceError(absl::OkStatus()));
}

TEST(DeviceError, MarkSurvivesCopy) {
  absl::Status s = StickyDeviceError("lost");
  absl::Status copy = s;
  EXPECT_TRUE(IsStickyDeviceError(copy));
}

}  // namespace
}  // namespace arfuse
