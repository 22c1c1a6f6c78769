// The CUDA/driver/NCCL -> absl::Status mapping. Runs without a GPU or a driver: it only maps
// result codes (machines without a driver get numeric names for driver results).
#include "server/cuda_device/cuda_status.h"

#include "gtest/gtest.h"
#include "server/cuda_device/device_error.h"

namespace arfuse {
namespace {

absl::Status ReturnsEarly(cudaError_t first, bool* reached_end) {
  ARFUSE_CUDA_RETURN_IF_ERROR(first);
  *reached_end = true;
  return absl::OkStatus();
}

TEST(CudaStatus, SuccessIsOk) {
  EXPECT_TRUE(ARFUSE_CUDA_STATUS(cudaSuccess).ok());
  EXPECT_TRUE(ARFUSE_CUDA_STATUS(CUDA_SUCCESS).ok());
  EXPECT_TRUE(ARFUSE_CUDA_STATUS(ncclSuccess).ok());
}

TEST(CudaStatus, ReturnIfErrorStopsAtTheFailure) {
  bool reached = false;
  absl::Status s = ReturnsEarly(cudaErrorMemoryAllocation, &reached);
  EXPECT_FALSE(reached);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(ReturnsEarly(cudaSuccess, &reached).ok());
  EXPECT_TRUE(reached);
}

TEST(CudaStatus, RuntimeErrorsMapToActionableCodes) {
  cudaError_t oom = cudaErrorMemoryAllocation;
  absl::Status s = ARFUSE_CUDA_STATUS(oom);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  // Names the call and the error, never a pointer.
  EXPECT_NE(s.message().find("cuda call oom failed: cudaErrorMemoryAllocation"),
            absl::string_view::npos)
      << s.message();
  EXPECT_EQ(s.message().find("0x"), absl::string_view::npos);
  EXPECT_EQ(ARFUSE_CUDA_STATUS(cudaErrorInvalidValue).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ARFUSE_CUDA_STATUS(cudaErrorNotSupported).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ARFUSE_CUDA_STATUS(cudaErrorUnknown).code(), absl::StatusCode::kInternal);
  EXPECT_FALSE(IsStickyDeviceError(ARFUSE_CUDA_STATUS(cudaErrorInvalidValue)));
}

TEST(CudaStatus, StickyRuntimeErrorsAreMarked) {
  for (cudaError_t e : {cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorMisalignedAddress,
                        cudaErrorIllegalInstruction, cudaErrorAssert}) {
    absl::Status s = ARFUSE_CUDA_STATUS(e);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << cudaGetErrorName(e);
    EXPECT_TRUE(IsStickyDeviceError(s)) << cudaGetErrorName(e);
    EXPECT_TRUE(IsStickyCudaError(e));
  }
  EXPECT_FALSE(IsStickyCudaError(cudaErrorNotReady));
  EXPECT_FALSE(IsStickyCudaError(cudaErrorMemoryAllocation));
}

TEST(CudaStatus, DriverErrors) {
  absl::Status s = ARFUSE_CUDA_STATUS(CUDA_ERROR_OUT_OF_MEMORY);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("cu call CUDA_ERROR_OUT_OF_MEMORY failed"), absl::string_view::npos)
      << s.message();
  EXPECT_EQ(ARFUSE_CUDA_STATUS(CUDA_ERROR_NOT_PERMITTED).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ARFUSE_CUDA_STATUS(CUDA_ERROR_INVALID_VALUE).code(),
            absl::StatusCode::kInvalidArgument);
  absl::Status sticky = ARFUSE_CUDA_STATUS(CUDA_ERROR_ILLEGAL_ADDRESS);
  EXPECT_EQ(sticky.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(IsStickyDeviceError(sticky));
  EXPECT_FALSE(IsStickyCudaError(CUDA_ERROR_NOT_READY));
}

TEST(CudaStatus, NcclErrors) {
  absl::Status remote = ARFUSE_CUDA_STATUS(ncclRemoteError);
  EXPECT_EQ(remote.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(remote.message().find("nccl call ncclRemoteError failed: ncclRemoteError"),
            absl::string_view::npos)
      << remote.message();
  EXPECT_FALSE(IsStickyDeviceError(remote));
  EXPECT_EQ(ARFUSE_CUDA_STATUS(ncclInvalidArgument).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ARFUSE_CUDA_STATUS(ncclInvalidUsage).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ARFUSE_CUDA_STATUS(ncclInProgress).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(ARFUSE_CUDA_STATUS(ncclInternalError).code(), absl::StatusCode::kInternal);
}

TEST(CudaStatus, DeviceHealthIsOkWithoutAStickyError) {
  // Without a GPU the runtime reports "no device" or "insufficient driver": not sticky.
  EXPECT_TRUE(DeviceHealth().ok());
}

// ctest runs every test in its own process: the mark, never cleared, stays in this one.
TEST(CudaStatus, AWedgedDeviceIsReportedStickyWithTheFirstReason) {
  MarkDeviceWedged("an NCCL kernel waits for a peer that is gone");
  MarkDeviceWedged("a later reason");
  const absl::Status health = DeviceHealth();
  EXPECT_TRUE(IsStickyDeviceError(health)) << health;
  EXPECT_EQ(health.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(health.message().find("cannot finish: an NCCL kernel waits for a peer that is gone"),
            absl::string_view::npos)
      << health;
  EXPECT_EQ(health.message().find("a later reason"), absl::string_view::npos) << health;
}

// A GPU held by another process, or an MPS server refusing this client (it waits for every
// client to leave after a fault): mapped like a sticky error and recorded, so that DeviceHealth()
// makes the daemon exit for a restart (retrying in-process did not recover, docs/reliability.md).
TEST(CudaStatus, RestartOnlyRuntimeErrorsAreStickyAndRecorded) {
  for (cudaError_t e :
       {cudaErrorDevicesUnavailable, cudaErrorMpsConnectionFailed, cudaErrorMpsRpcFailure,
        cudaErrorMpsServerNotReady, cudaErrorMpsClientTerminated}) {
    EXPECT_TRUE(IsRestartOnlyCudaError(e)) << cudaGetErrorName(e);
    EXPECT_FALSE(IsStickyCudaError(e)) << cudaGetErrorName(e);
  }
  EXPECT_FALSE(IsRestartOnlyCudaError(cudaErrorMemoryAllocation));
  EXPECT_FALSE(IsRestartOnlyCudaError(cudaErrorIllegalAddress));
  EXPECT_TRUE(DeviceHealth().ok());
  cudaError_t busy = cudaErrorDevicesUnavailable;
  const absl::Status s = ARFUSE_CUDA_STATUS(busy);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(IsStickyDeviceError(s)) << s;
  EXPECT_NE(s.message().find("cuda call busy failed: cudaErrorDevicesUnavailable"),
            absl::string_view::npos)
      << s;
  // Recorded: the process's health says so from now on, with the first reason.
  static_cast<void>(ARFUSE_CUDA_STATUS(cudaErrorMpsServerNotReady));
  const absl::Status health = DeviceHealth();
  EXPECT_TRUE(IsStickyDeviceError(health)) << health;
  EXPECT_EQ(health.message(), s.message());
}

TEST(CudaStatus, RestartOnlyDriverErrorsAreStickyAndRecorded) {
  EXPECT_TRUE(IsRestartOnlyCudaError(CUDA_ERROR_DEVICE_UNAVAILABLE));
  EXPECT_TRUE(IsRestartOnlyCudaError(CUDA_ERROR_MPS_SERVER_NOT_READY));
  EXPECT_FALSE(IsRestartOnlyCudaError(CUDA_ERROR_OUT_OF_MEMORY));
  const absl::Status s = ARFUSE_CUDA_STATUS(CUDA_ERROR_MPS_CLIENT_TERMINATED);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(IsStickyDeviceError(s)) << s;
  EXPECT_TRUE(IsStickyDeviceError(DeviceHealth()));
}

// A recoverable error is not recorded.
TEST(CudaStatus, OrdinaryErrorsLeaveTheHealthAlone) {
  static_cast<void>(ARFUSE_CUDA_STATUS(cudaErrorMemoryAllocation));
  static_cast<void>(ARFUSE_CUDA_STATUS(CUDA_ERROR_INVALID_VALUE));
  static_cast<void>(ARFUSE_CUDA_STATUS(ncclRemoteError));
  EXPECT_TRUE(DeviceHealth().ok());
}

}  // namespace
}  // namespace arfuse
