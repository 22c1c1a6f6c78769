// The CUDA IPC opener's own refusal, when it is called without the registry's validation in
// front (it refuses before any CUDA call, so it runs in CUDA builds without a GPU or a driver).
#include "server/registry/cuda/cuda_ipc_opener.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace arfuse {
namespace {

using ::testing::HasSubstr;

TEST(CudaIpcOpener, RefusesAHandleOfTheWrongLength) {
  CudaIpcOpener opener(0);
  for (const std::string& handle : {std::string(), std::string(10, 'x'), std::string(65, 'x')}) {
    RegionSpec spec;
    spec.name = "t";
    spec.byte_size = 4096;
    spec.kind = MemoryKind::kCudaIpc;
    spec.cuda_handle = handle;
    auto mapped = opener.Open(spec);
    EXPECT_EQ(mapped.status().code(), absl::StatusCode::kInvalidArgument) << handle.size();
    EXPECT_THAT(mapped.status().message(), HasSubstr("cuda_ipc.handle must be exactly 64 bytes"));
  }
}

}  // namespace
}  // namespace arfuse
