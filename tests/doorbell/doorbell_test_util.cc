#include "tests/doorbell/doorbell_test_util.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/host/reference_op.h"

namespace arfuse::doorbell_test {
namespace {

absl::Status Cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(err)));
}

absl::Status WaitStreams(const std::vector<cudaStream_t>& streams, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (cudaStream_t s : streams) {
    while (true) {
      const cudaError_t err = cudaStreamQuery(s);
      if (err == cudaSuccess) break;
      if (err != cudaErrorNotReady) return Cuda(err, "stream");
      if (absl::Now() > deadline) return absl::DeadlineExceededError("stream did not drain");
      absl::SleepFor(absl::Microseconds(100));
    }
  }
  return absl::OkStatus();
}

std::vector<uint8_t> Download(const void* device, size_t bytes) {
  std::vector<uint8_t> host(bytes);
  if (cudaMemcpy(host.data(), device, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) host.clear();
  return host;
}

double Ulp(DType dt) {
  return dt == DType::kBF16   ? std::ldexp(1.0, -8)
         : dt == DType::kFP16 ? std::ldexp(1.0, -11)
                              : std::ldexp(1.0, -18);
}

}  // namespace

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  if (cudaMalloc(&ptr_, bytes) != cudaSuccess) {
    ptr_ = nullptr;
    cudaGetLastError();
    return;
  }
  cudaMemset(ptr_, 0, bytes);
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) cudaFree(ptr_);
}

MappedWord::MappedWord() {
  void* raw = nullptr;
  if (cudaHostAlloc(&raw, sizeof(uint32_t), cudaHostAllocMapped) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  host_ = static_cast<uint32_t*>(raw);
  *host_ = 0;
  void* dev = nullptr;
  if (cudaHostGetDevicePointer(&dev, raw, 0) == cudaSuccess) device_ = static_cast<uint32_t*>(dev);
}

MappedWord::~MappedWord() {
  if (host_ != nullptr) cudaFreeHost(host_);
}

uint32_t SharedGpuSmBudget(int world) {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  // Each rank adds a ring block and a waiter (or completion) block; keep a few SMs for them.
  const int spare = 2 * world + 2;
  return static_cast<uint32_t>(std::max(1, (sms - spare) / std::max(1, world)));
}

RankGroup::RankGroup(const GroupShape& shape) : shape_(shape) {
  layout_ = ComputeWorkspaceLayout(shape.world, shape.max_tokens, shape.hidden, shape.dtype);
  if (layout_.total_bytes == 0) return;
  const size_t bytes = Bytes(shape.max_tokens);
  bool ok = host_abort_.ok();
  for (int r = 0; r < shape.world; ++r) {
    workspaces_.push_back(std::make_unique<DeviceBuffer>(layout_.total_bytes));
    inputs_.push_back(std::make_unique<DeviceBuffer>(bytes));
    residual_in_.push_back(std::make_unique<DeviceBuffer>(bytes));
    residual_out_.push_back(std::make_unique<DeviceBuffer>(bytes));
    norm_out_.push_back(std::make_unique<DeviceBuffer>(bytes));
    output_.push_back(std::make_unique<DeviceBuffer>(bytes));
    for (auto* v : {&workspaces_, &inputs_, &residual_in_, &residual_out_, &norm_out_, &output_}) {
      ok = ok && v->back()->get() != nullptr;
    }
    cudaStream_t s = nullptr, c = nullptr;
    ok = ok && cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess;
    ok = ok && cudaStreamCreateWithFlags(&c, cudaStreamNonBlocking) == cudaSuccess;
    sidecar_.push_back(s);
    client_.push_back(c);
  }
  gamma_ =
      std::make_unique<DeviceBuffer>(static_cast<size_t>(shape.hidden) * DTypeSize(shape.dtype));
  ok_ = ok && gamma_->get() != nullptr && cudaDeviceSynchronize() == cudaSuccess;
}

RankGroup::~RankGroup() {
  // Bounded: a test that failed may leave a spin behind; its deadline ends it.
  (void)WaitStreams(sidecar_, absl::Seconds(10));
  (void)WaitStreams(client_, absl::Seconds(10));
  for (cudaStream_t s : sidecar_) {
    if (s != nullptr) cudaStreamDestroy(s);
  }
  for (cudaStream_t s : client_) {
    if (s != nullptr) cudaStreamDestroy(s);
  }
}

size_t RankGroup::Bytes(uint32_t tokens, uint32_t hidden) const {
  return static_cast<size_t>(tokens) * (hidden == 0 ? shape_.hidden : hidden) *
         DTypeSize(shape_.dtype);
}

absl::Status RankGroup::Init() {
  for (int r = 0; r < world(); ++r) {
    if (absl::Status st =
            Cuda(LaunchWorkspaceInit(workspace(r), layout_, sidecar_[r]), "workspace init");
        !st.ok()) {
      return st;
    }
  }
  return SyncSidecars();
}

absl::Status RankGroup::SyncSidecars(absl::Duration timeout) {
  return WaitStreams(sidecar_, timeout);
}
absl::Status RankGroup::SyncClients(absl::Duration timeout) {
  return WaitStreams(client_, timeout);
}

FusionParams RankGroup::Params(int rank, uint32_t tokens, FusionAlgo algo, Pattern pattern,
                               uint32_t hidden) const {
  FusionParams p{};
  for (int q = 0; q < world(); ++q) p.peer_workspace[q] = workspace(q);
  p.input = input(rank);
  p.output = output(rank);
  p.residual_in = residual_in(rank);
  p.residual_out = residual_out(rank);
  p.norm_out = norm_out(rank);
  p.gamma = gamma();
  p.host_abort = host_abort_.device();
  p.spin_timeout_ns = shape_.spin_timeout_ns;
  p.layout = layout_;
  p.num_tokens = tokens;
  p.hidden = hidden == 0 ? shape_.hidden : hidden;
  p.eps = 1e-5f;
  p.rank = rank;
  p.world_size = world();
  p.sm_budget = SharedGpuSmBudget(world());
  p.dtype = shape_.dtype;
  p.pattern = pattern;
  p.algo = algo;
  return p;
}

uint32_t RankGroup::ErrorWord(int rank) const {
  uint32_t code = 0xffffffffu;
  if (cudaMemcpy(&code, WorkspaceErrorWord(workspace(rank), layout_), sizeof(code),
                 cudaMemcpyDeviceToHost) != cudaSuccess) {
    cudaGetLastError();
    return 0xffffffffu;
  }
  return code;
}

HostOp::HostOp(int world, uint32_t tokens, uint32_t hidden, DType dtype)
    : world(world), tokens(tokens), hidden(hidden), dtype(dtype) {
  const size_t bytes = static_cast<size_t>(tokens) * hidden * DTypeSize(dtype);
  inputs.assign(world, std::vector<uint8_t>(bytes));
  residual.resize(bytes);
  gamma.resize(static_cast<size_t>(hidden) * DTypeSize(dtype));
}

void HostOp::FillRandom(std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  const size_t n = static_cast<size_t>(tokens) * hidden;
  for (auto& in : inputs) {
    for (size_t i = 0; i < n; ++i) StoreFromFloat(dtype, in.data(), i, dist(rng));
  }
  for (size_t i = 0; i < n; ++i) StoreFromFloat(dtype, residual.data(), i, dist(rng));
  for (size_t i = 0; i < hidden; ++i) {
    StoreFromFloat(dtype, gamma.data(), i, 1.0f + 0.1f * dist(rng));
  }
}

absl::Status HostOp::Upload(RankGroup& g, bool async) const {
  for (int r = 0; r < world; ++r) {
    cudaStream_t s = g.client(r);
    const std::pair<void*, const std::vector<uint8_t>*> copies[] = {{g.input(r), &inputs[r]},
                                                                    {g.residual_in(r), &residual}};
    for (const auto& [dst, src] : copies) {
      const cudaError_t err =
          async ? cudaMemcpyAsync(dst, src->data(), src->size(), cudaMemcpyHostToDevice, s)
                : cudaMemcpy(dst, src->data(), src->size(), cudaMemcpyHostToDevice);
      if (err != cudaSuccess) return Cuda(err, "upload");
    }
  }
  if (const cudaError_t err =
          cudaMemcpy(g.gamma(), gamma.data(), gamma.size(), cudaMemcpyHostToDevice);
      err != cudaSuccess) {
    return Cuda(err, "gamma upload");
  }
  if (async) return absl::OkStatus();
  // A cudaMemcpy from pageable memory may return before its DMA has landed. Kernels queued later
  // in this process wait for it (legacy stream order), but a doorbell rung by another process
  // does not: the sidecar's resident kernel would read the previous op's values (the doorbell
  // IPC test saw a stale gamma that way). Wait for the copies themselves.
  return Cuda(cudaStreamSynchronize(cudaStreamLegacy), "upload wait");
}

std::string HostOp::Verify(const RankGroup& g, Pattern pattern) const {
  std::vector<const void*> ptrs;
  for (const auto& in : inputs) ptrs.push_back(in.data());
  const size_t bytes = inputs[0].size();
  std::vector<uint8_t> want_out(bytes), want_residual(bytes), want_norm(bytes);
  CpuOpArgs a;
  a.pattern = pattern;
  a.dtype = dtype;
  a.world_size = world;
  a.hidden = hidden;
  a.num_tokens = tokens;
  a.eps = 1e-5f;
  a.rank_inputs = ptrs.data();
  a.output = want_out.data();
  a.residual_in = residual.data();
  a.residual_out = want_residual.data();
  a.norm_out = want_norm.data();
  a.gamma = gamma.data();
  if (absl::Status st = ReferenceFusedOp(a); !st.ok()) return st.ToString();
  const size_t n = static_cast<size_t>(tokens) * hidden;
  std::vector<uint8_t> rank0_norm;
  for (int r = 0; r < world; ++r) {
    if (pattern == Pattern::kAllReduce) {
      if (Download(g.output(r), bytes) != want_out) {
        return absl::StrCat("rank ", r, ": allreduce output differs from the CPU");
      }
      continue;
    }
    if (Download(g.residual_out(r), bytes) != want_residual) {
      return absl::StrCat("rank ", r, ": residual_out differs from the CPU");
    }
    const auto norm = Download(g.norm_out(r), bytes);
    if (norm.size() != bytes) return absl::StrCat("rank ", r, ": download failed");
    if (r == 0) {
      rank0_norm = norm;
    } else if (norm != rank0_norm) {
      return absl::StrCat("rank ", r, ": norm_out differs from rank 0's");
    }
    for (size_t i = 0; i < n; ++i) {
      const double got = LoadAsFloat(dtype, norm.data(), i);
      const double cpu = LoadAsFloat(dtype, want_norm.data(), i);
      if (std::fabs(got - cpu) > 2.0 * Ulp(dtype) * std::max(std::fabs(cpu), 1e-3)) {
        return absl::StrCat("rank ", r, ": norm_out element ", i, " is ", got, ", CPU ", cpu);
      }
    }
  }
  return "";
}

}  // namespace arfuse::doorbell_test
