// Test support for libarfuse_client: a host workspace made in-process through
// kernels/host/host_collective (the object layout the host engine makes), host and CUDA exports
// for the blob builder, and per-rank tensors with their CPU reference answer.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/instream/arfuse_client.h"
#include "common/fd/unique_fd.h"
#include "kernels/common/op_types.h"
#include "kernels/host/host_collective.h"
#include "server/engine_api/instream_host.h"

namespace arfuse::instream::testing {

// A memfd host workspace for `world` ranks, initialized for `generation`.
struct TestHostWorkspace {
  static absl::StatusOr<std::unique_ptr<TestHostWorkspace>> Create(int world, uint32_t max_tokens,
                                                                   uint32_t hidden, DType dtype,
                                                                   uint64_t generation);
  int world = 0;
  uint32_t max_tokens = 0, hidden = 0;
  DType dtype = DType::kBF16;
  uint64_t generation = 0;
  size_t slot_bytes = 0;
  UniqueFd fd;
  host::HostWsMapping mapping;
};

// The export a host engine of rank `rank` makes for `ws` (entries for both patterns at each
// hidden, and the three FP8 patterns' for a bf16 or fp16 workspace; the workspace's hidden when
// `hiddens` is empty), holding a duplicate of ws.fd.
InStreamExport HostExport(const TestHostWorkspace& ws, uint32_t rank,
                          const std::vector<uint32_t>& hiddens = {});

// A CUDA export that passes the blob checks (world 2, bf16, one-shot and two-shot entries at
// hidden 1024, VMM POSIX-FD memory with fd `fd`), over a fake image of 64 bytes.
InStreamExport CudaExport(int fd);

// The blob of `e`, or a test failure; `counters`: naming an op counter page after e's descriptors.
std::string Blob(const InStreamExport& e, uint64_t attach_id = 7, bool counters = false);

// arfuse_attach's result: the code, the message and the ctx (null on failure).
struct AttachResult {
  int rc = -1;
  std::string message;
  arfuse_ctx* ctx = nullptr;
};
AttachResult AttachBlob(const std::string& blob, const std::vector<int>& fds);

// One rank's tensors of one op, 16-byte aligned host buffers, filled from (rank, call).
struct RankTensors {
  RankTensors(DType dtype, int rank, int call, uint32_t tokens, uint32_t hidden);
  uint8_t* input() { return buf(0); }
  uint8_t* residual_in() { return buf(1); }
  uint8_t* residual_out() { return buf(2); }
  uint8_t* norm_out() { return buf(3); }
  uint8_t* output() { return buf(4); }
  uint8_t* gamma() { return buf(5); }
  std::vector<uint8_t> bytes(int which, size_t n) const;
  size_t tensor_bytes = 0;
  size_t gamma_bytes = 0;

 private:
  uint8_t* buf(int i) { return reinterpret_cast<uint8_t*>(storage_[i].data()); }
  std::vector<std::vector<uint64_t>> storage_;  // 8-byte elements; vectors of >= 16 bytes are
                                                // 16-aligned by operator new
};

// The CPU reference of the op over every rank's input: fills want.output (kAllReduce) or
// want.residual_out and want.norm_out from want's residual_in and gamma.
void Reference(Pattern pattern, DType dtype, uint32_t tokens, uint32_t hidden,
               std::vector<RankTensors>& ranks, RankTensors& want);

}  // namespace arfuse::instream::testing
