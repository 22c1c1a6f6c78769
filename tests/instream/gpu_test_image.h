// The embedded kernel image of libarfuse_client's GPU tests (gpu_test_image.cu, compiled to a
// fatbin for the build's architectures).
#pragma once

#include <cstddef>

namespace arfuse::instream::testing {

struct TestImage {
  const void* data;
  size_t bytes;
};
TestImage GpuTestImage();

// The image's functions: bf16, hidden up to 4096 (rows of one or two vectors per thread, at most
// 512 threads), "arfuse_test_bf16_{sum,norm}_{oneshot,twoshot}".
const char* GpuTestFunction(bool norm, bool twoshot);

}  // namespace arfuse::instream::testing
