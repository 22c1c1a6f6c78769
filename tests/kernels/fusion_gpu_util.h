// Shared by the fused kernels' GPU tests: N ranks simulated in one process on one GPU (N
// workspaces, N streams launched concurrently; peer pointers are plain device pointers), each
// rank's tensors, and host copies of one op with its CPU answer. Every simulated rank gets
// SMs / N as its sm_budget so all spinning grids are co-resident.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "kernels/host/reference_op.h"

namespace arfuse {
namespace fusion_test {

#define CUDA_OK(expr)                                                          \
  do {                                                                         \
    const cudaError_t err_ = (expr);                                           \
    ASSERT_EQ(err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(err_); \
  } while (false)

constexpr uint64_t kNormalTimeoutNs = 5'000'000'000ull;

struct DeviceBuffer {
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes(bytes) {
    if (cudaMalloc(&ptr, bytes) != cudaSuccess) ptr = nullptr;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr != nullptr) cudaFree(ptr);
  }
  void* ptr = nullptr;
  size_t bytes = 0;
};

// Host word mapped into the device (abort flag, error mirror).
struct MappedWord {
  MappedWord() {
    void* raw = nullptr;
    if (cudaHostAlloc(&raw, sizeof(uint32_t), cudaHostAllocMapped) == cudaSuccess) {
      host = static_cast<volatile uint32_t*>(raw);
      *host = 0;
      void* dev = nullptr;
      if (cudaHostGetDevicePointer(&dev, raw, 0) == cudaSuccess)
        device = static_cast<uint32_t*>(dev);
    }
  }
  ~MappedWord() {
    if (host != nullptr) cudaFreeHost(const_cast<uint32_t*>(host));
  }
  volatile uint32_t* host = nullptr;
  uint32_t* device = nullptr;
};

// One simulated group: workspaces, streams and per-rank tensors sized for (max_tokens, hidden).
class SimGroup {
 public:
  SimGroup(int world, uint32_t max_tokens, uint32_t hidden, DType dtype)
      : world_(world), max_tokens_(max_tokens), hidden_(hidden), dtype_(dtype) {
    layout_ = ComputeWorkspaceLayout(world, max_tokens, hidden, dtype);
    const size_t bytes = static_cast<size_t>(max_tokens) * hidden * DTypeSize(dtype);
    for (int r = 0; r < world; ++r) {
      workspaces_.push_back(std::make_unique<DeviceBuffer>(layout_.total_bytes));
      inputs_.push_back(std::make_unique<DeviceBuffer>(bytes));
      residual_in_.push_back(std::make_unique<DeviceBuffer>(bytes));
      residual_out_.push_back(std::make_unique<DeviceBuffer>(bytes));
      norm_out_.push_back(std::make_unique<DeviceBuffer>(bytes));
      output_.push_back(std::make_unique<DeviceBuffer>(bytes));
      // FP8 patterns: one code per element; scales for the largest layout (fp32 MN-major with
      // TMA padding, or a scale per token).
      quant_out_.push_back(
          std::make_unique<DeviceBuffer>(static_cast<size_t>(max_tokens) * hidden));
      scale_.push_back(std::make_unique<DeviceBuffer>(static_cast<size_t>(hidden / 128 + 1) *
                                                      (max_tokens + 4) * sizeof(float)));
      error_mirror_.push_back(std::make_unique<MappedWord>());
      cudaStream_t s = nullptr;
      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
      streams_.push_back(s);
    }
    gamma_ = std::make_unique<DeviceBuffer>(hidden * DTypeSize(dtype));
    static_scale_ = std::make_unique<DeviceBuffer>(sizeof(float));
    int device = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, device);
  }
  ~SimGroup() {
    for (cudaStream_t s : streams_) {
      cudaStreamSynchronize(s);
      cudaStreamDestroy(s);
    }
  }

  bool ok() const {
    if (layout_.total_bytes == 0 || gamma_->ptr == nullptr || host_abort_.host == nullptr) {
      return false;
    }
    for (int r = 0; r < world_; ++r) {
      if (workspaces_[r]->ptr == nullptr || inputs_[r]->ptr == nullptr ||
          norm_out_[r]->ptr == nullptr || output_[r]->ptr == nullptr ||
          error_mirror_[r]->host == nullptr) {
        return false;
      }
    }
    return true;
  }

  // Every rank re-initializes its own workspace; the host waits for all (the "barrier").
  cudaError_t Init() {
    for (int r = 0; r < world_; ++r) {
      if (cudaError_t e = LaunchWorkspaceInit(workspaces_[r]->ptr, layout_, streams_[r]); e)
        return e;
      *error_mirror_[r]->host = 0;
    }
    return SyncAll();
  }

  cudaError_t SyncAll() {
    for (cudaStream_t s : streams_) {
      if (cudaError_t e = cudaStreamSynchronize(s); e != cudaSuccess) return e;
    }
    return cudaSuccess;
  }

  FusionParams Params(int rank, FusionAlgo algo, Pattern pattern, uint32_t tokens) const {
    FusionParams p{};
    for (int q = 0; q < world_; ++q) p.peer_workspace[q] = workspaces_[q]->ptr;
    p.input = inputs_[rank]->ptr;
    p.output = output_[rank]->ptr;
    p.residual_in = residual_in_[rank]->ptr;
    p.residual_out = residual_out_[rank]->ptr;
    p.norm_out = norm_out_[rank]->ptr;
    p.gamma = gamma_->ptr;
    p.host_abort = host_abort_.device;
    p.host_error = error_mirror_[rank]->device;
    p.spin_timeout_ns = timeout_ns_;
    p.layout = layout_;
    p.num_tokens = tokens;
    p.hidden = hidden_;
    p.eps = 1e-5f;
    p.rank = rank;
    p.world_size = world_;
    // Ranks share the GPU: each gets its share of the SMs (and no programmatic launches). A
    // group with `whole_gpu_` set passes 0 (small grids only: they fit next to each other).
    p.sm_budget = whole_gpu_ ? 0u : static_cast<uint32_t>(std::max(1, sms_ / world_));
    p.dtype = dtype_;
    p.pattern = pattern;
    p.algo = algo;
    p.quant_out = quant_out_[rank]->ptr;
    // The static pattern reads one scale (the same on every rank); the others write their own.
    p.scale = pattern == Pattern::kAllReduceResidualRmsNormFp8Static ? static_scale_->ptr
                                                                     : scale_[rank]->ptr;
    p.scale_layout = scale_layout_;
    if (IsQuantPattern(pattern) && !fp8_norm_out_) p.norm_out = nullptr;
    return p;
  }

  // Launches the op on the given ranks (all by default), without waiting.
  cudaError_t Launch(FusionAlgo algo, Pattern pattern, uint32_t tokens, int skip_rank = -1) {
    for (int r = 0; r < world_; ++r) {
      if (r == skip_rank) continue;
      if (cudaError_t e = LaunchAllReduceFusion(Params(r, algo, pattern, tokens), streams_[r]);
          e != cudaSuccess) {
        return e;
      }
    }
    return cudaSuccess;
  }

  uint32_t ErrorWord(int rank) {
    uint32_t code = 0xffffffffu;
    if (ReadWorkspaceError(workspaces_[rank]->ptr, layout_, streams_[rank], &code) != cudaSuccess) {
      return 0xfffffffeu;
    }
    return code;
  }

  size_t Bytes(uint32_t tokens) const {
    return static_cast<size_t>(tokens) * hidden_ * DTypeSize(dtype_);
  }

  int world_;
  uint32_t max_tokens_, hidden_;
  DType dtype_;
  int sms_ = 0;
  bool whole_gpu_ = false;
  uint64_t timeout_ns_ = kNormalTimeoutNs;
  WorkspaceLayout layout_{};
  std::vector<std::unique_ptr<DeviceBuffer>> workspaces_, inputs_, residual_in_, residual_out_,
      norm_out_, output_, quant_out_, scale_;
  std::unique_ptr<DeviceBuffer> static_scale_;
  uint8_t scale_layout_ = 1;  // the per-group pattern's (fp8::GroupScaleLayout)
  bool fp8_norm_out_ = true;  // whether the FP8 patterns also write norm_out
  std::vector<std::unique_ptr<MappedWord>> error_mirror_;
  std::unique_ptr<DeviceBuffer> gamma_;
  MappedWord host_abort_;
  std::vector<cudaStream_t> streams_;
};

// Host copies of one op's tensors and its CPU answer.
struct HostOp {
  HostOp(const SimGroup& g, uint32_t tokens) : tokens(tokens), dtype(g.dtype_), hidden(g.hidden_) {
    const size_t bytes = g.Bytes(tokens);
    inputs.assign(g.world_, std::vector<uint8_t>(bytes));
    residual.resize(bytes);
    gamma.resize(hidden * DTypeSize(dtype));
  }
  void FillRandom(std::mt19937& rng) {
    std::normal_distribution<float> dist(0.0f, 1.0f);
    const size_t n = static_cast<size_t>(tokens) * hidden;
    for (auto& in : inputs)
      for (size_t i = 0; i < n; ++i) StoreFromFloat(dtype, in.data(), i, dist(rng));
    for (size_t i = 0; i < n; ++i) StoreFromFloat(dtype, residual.data(), i, dist(rng));
    for (size_t i = 0; i < hidden; ++i)
      StoreFromFloat(dtype, gamma.data(), i, 1.0f + 0.1f * dist(rng));
  }
  void FillIntegers(std::mt19937& rng) {
    std::uniform_int_distribution<int> dist(-8, 8);
    const size_t n = static_cast<size_t>(tokens) * hidden;
    for (auto& in : inputs)
      for (size_t i = 0; i < n; ++i)
        StoreFromFloat(dtype, in.data(), i, static_cast<float>(dist(rng)));
    for (size_t i = 0; i < n; ++i)
      StoreFromFloat(dtype, residual.data(), i, static_cast<float>(dist(rng)));
    for (size_t i = 0; i < hidden; ++i) StoreFromFloat(dtype, gamma.data(), i, 1.0f);
  }
  // bf16 only: every element -0.0, +0.0 or a subnormal of either sign (the FlashInfer hang).
  void FillZerosAndSubnormals(std::mt19937& rng) {
    std::uniform_int_distribution<int> pick(0, 3), mant(1, 0x7f);
    auto draw = [&]() -> uint16_t {
      switch (pick(rng)) {
        case 0:
          return 0x8000;
        case 1:
          return 0x0000;
        case 2:
          return static_cast<uint16_t>(0x8000 | mant(rng));
        default:
          return static_cast<uint16_t>(mant(rng));
      }
    };
    const size_t n = static_cast<size_t>(tokens) * hidden;
    for (auto& in : inputs)
      for (size_t i = 0; i < n; ++i) reinterpret_cast<uint16_t*>(in.data())[i] = draw();
    for (size_t i = 0; i < n; ++i) reinterpret_cast<uint16_t*>(residual.data())[i] = draw();
    for (size_t i = 0; i < hidden; ++i) StoreFromFloat(dtype, gamma.data(), i, 1.0f);
  }
  // Same residual on every rank (as in tensor parallelism), so outputs must agree bit for bit.
  ::testing::AssertionResult Upload(SimGroup& g) const {
    for (int r = 0; r < g.world_; ++r) {
      if (cudaMemcpy(g.inputs_[r]->ptr, inputs[r].data(), inputs[r].size(),
                     cudaMemcpyHostToDevice) ||
          cudaMemcpy(g.residual_in_[r]->ptr, residual.data(), residual.size(),
                     cudaMemcpyHostToDevice)) {
        return ::testing::AssertionFailure() << "upload failed";
      }
    }
    if (cudaMemcpy(g.gamma_->ptr, gamma.data(), gamma.size(), cudaMemcpyHostToDevice)) {
      return ::testing::AssertionFailure() << "gamma upload failed";
    }
    return ::testing::AssertionSuccess();
  }
  CpuOpArgs Args(Pattern pattern) {
    ptrs.clear();
    for (auto& in : inputs) ptrs.push_back(in.data());
    const size_t bytes = inputs[0].size();
    want_out.assign(bytes, 0);
    want_residual.assign(bytes, 0);
    want_norm.assign(bytes, 0);
    CpuOpArgs a;
    a.pattern = pattern;
    a.dtype = dtype;
    a.world_size = static_cast<int>(inputs.size());
    a.hidden = hidden;
    a.num_tokens = tokens;
    a.eps = 1e-5f;
    a.rank_inputs = ptrs.data();
    a.output = want_out.data();
    a.residual_in = residual.data();
    a.residual_out = want_residual.data();
    a.norm_out = want_norm.data();
    a.gamma = gamma.data();
    return a;
  }
  uint32_t tokens;
  DType dtype;
  uint32_t hidden;
  std::vector<std::vector<uint8_t>> inputs;
  std::vector<uint8_t> residual, gamma;
  std::vector<const void*> ptrs;
  std::vector<uint8_t> want_out, want_residual, want_norm;
};

inline std::vector<uint8_t> Download(const void* device, size_t bytes) {
  std::vector<uint8_t> host(bytes);
  if (cudaMemcpy(host.data(), device, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) host.clear();
  return host;
}

}  // namespace fusion_test
}  // namespace arfuse
