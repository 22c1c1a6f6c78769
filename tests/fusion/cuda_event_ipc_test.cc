// The eager plane's interprocess events: a wait handle of the wrong length is refused before any
// CUDA call (so this runs in CUDA builds without a GPU or a driver), whoever calls Prepare.
#include "server/services/fusion/cuda/cuda_event_ipc.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace arfuse {
namespace {

using ::testing::HasSubstr;

TEST(CudaEventIpc, RefusesAWaitHandleOfTheWrongLength) {
  CudaEventIpc events(0);
  for (const std::string& handle :
       {std::string(1, 'x'), std::string(63, 'x'), std::string(65, 'x')}) {
    auto prepared = events.Prepare(handle);
    EXPECT_EQ(prepared.status().code(), absl::StatusCode::kInvalidArgument) << handle.size();
    EXPECT_THAT(prepared.status().message(), HasSubstr("wait_event must be exactly 64 bytes"));
  }
}

}  // namespace
}  // namespace arfuse
