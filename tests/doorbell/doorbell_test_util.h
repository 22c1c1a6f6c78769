// GPU test harness of the doorbell plane: N ranks simulated on one GPU in one process (N
// workspaces, N sidecar streams, N client streams; peer pointers are plain device pointers), the
// way tests/kernels/fusion_gpu_test.cc simulates them, plus host-side op data checked against
// kernels/host's ReferenceFusedOp. Shared by the GPU tests, the IPC client helper and the bench.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "kernels/common/op_types.h"

namespace arfuse::doorbell_test {

// Owning device allocation (cudaMalloc), zero-filled.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// A host word mapped into the device (abort flag).
class MappedWord {
 public:
  MappedWord();
  ~MappedWord();
  MappedWord(const MappedWord&) = delete;
  MappedWord& operator=(const MappedWord&) = delete;
  void Set(uint32_t v) { __atomic_store_n(host_, v, __ATOMIC_RELEASE); }
  uint32_t* device() const { return device_; }
  bool ok() const { return host_ != nullptr && device_ != nullptr; }

 private:
  uint32_t* host_ = nullptr;
  uint32_t* device_ = nullptr;
};

// SMs per simulated rank: SMs / N minus room for every rank's ring and waiter blocks (and the
// completion kernels), so all ranks' fused grids stay co-resident next to them.
uint32_t SharedGpuSmBudget(int world);

struct GroupShape {
  int world = 2;
  uint32_t max_tokens = 64;
  uint32_t hidden = 1024;
  DType dtype = DType::kBF16;
  uint64_t spin_timeout_ns = 5'000'000'000ull;
};

class RankGroup {
 public:
  explicit RankGroup(const GroupShape& shape);
  ~RankGroup();
  RankGroup(const RankGroup&) = delete;
  RankGroup& operator=(const RankGroup&) = delete;

  // Allocation succeeded.
  bool ok() const { return ok_; }
  // Every rank re-initializes its workspace on its sidecar stream; waits for all.
  absl::Status Init();
  absl::Status SyncSidecars(absl::Duration timeout = absl::Seconds(30));
  absl::Status SyncClients(absl::Duration timeout = absl::Seconds(30));

  // The op's params for `rank` (pointers into this group's tensors), at `hidden` (<= the shape's).
  FusionParams Params(int rank, uint32_t tokens, FusionAlgo algo,
                      Pattern pattern = Pattern::kAllReduceResidualRmsNorm,
                      uint32_t hidden = 0) const;
  uint32_t ErrorWord(int rank) const;  // the workspace's error word (0xffffffff: read failed)

  const GroupShape& shape() const { return shape_; }
  int world() const { return shape_.world; }
  const WorkspaceLayout& layout() const { return layout_; }
  void* workspace(int r) const { return workspaces_[r]->get(); }
  cudaStream_t sidecar(int r) const { return sidecar_[r]; }
  cudaStream_t client(int r) const { return client_[r]; }
  MappedWord& host_abort() { return host_abort_; }
  void* input(int r) const { return inputs_[r]->get(); }
  void* residual_in(int r) const { return residual_in_[r]->get(); }
  void* residual_out(int r) const { return residual_out_[r]->get(); }
  void* norm_out(int r) const { return norm_out_[r]->get(); }
  void* output(int r) const { return output_[r]->get(); }
  void* gamma() const { return gamma_->get(); }
  size_t Bytes(uint32_t tokens, uint32_t hidden = 0) const;

 private:
  GroupShape shape_;
  WorkspaceLayout layout_{};
  bool ok_ = false;
  std::vector<std::unique_ptr<DeviceBuffer>> workspaces_, inputs_, residual_in_, residual_out_,
      norm_out_, output_;
  std::unique_ptr<DeviceBuffer> gamma_;
  MappedWord host_abort_;
  std::vector<cudaStream_t> sidecar_, client_;
};

// One op's host data: per-rank inputs, residual (the same on every rank, as in tensor
// parallelism) and gamma.
struct HostOp {
  HostOp(int world, uint32_t tokens, uint32_t hidden, DType dtype);
  void FillRandom(std::mt19937& rng);
  // Uploads on each rank's client stream (asynchronous; the buffers must stay alive until the
  // stream passed the copies: call SyncClients or keep the HostOp).
  absl::Status Upload(RankGroup& g, bool async = false) const;
  // Compares every rank's outputs with ReferenceFusedOp: residual_out (or output) exactly,
  // norm_out within two dtype ulps, and norm_out bit-identical across ranks. An empty string
  // when they agree, else the first difference.
  std::string Verify(const RankGroup& g, Pattern pattern) const;

  int world;
  uint32_t tokens, hidden;
  DType dtype;
  std::vector<std::vector<uint8_t>> inputs;
  std::vector<uint8_t> residual, gamma;
};

}  // namespace arfuse::doorbell_test
