// arfuse-demo's shapes: what the parent and every client process agree on (the planes, the
// shapes, the inputs every process can regenerate, the sockets), one shape's tensors in a client
// and what a client reports for it.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/cpp/client.h"
#include "kernels/common/op_types.h"
#if defined(ARFUSE_DEMO_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace arfuse::demo {

struct Shape {
  uint32_t tokens;
  uint32_t hidden;
};

// The data planes a run shows, in the table's order: in-stream first (the default plane, the one
// every other row is compared with), then eager, then doorbell.
enum class Plane { kInStream, kEager, kDoorbell };
inline constexpr Plane kAllPlanes[] = {Plane::kInStream, Plane::kEager, Plane::kDoorbell};
const char* PlaneName(Plane p);

// What --planes (with --device and --doorbell) selects: the planes to run, and which of them a
// sidecar's refusal fails (a plane named in --planes, or --doorbell=on) rather than shows as
// skipped.
struct PlaneChoice {
  bool run[3] = {false, false, false};
  bool required[3] = {false, false, false};
  bool runs(Plane p) const { return run[static_cast<int>(p)]; }
  bool requires_plane(Plane p) const { return required[static_cast<int>(p)]; }
  std::vector<Plane> planes() const;
};

// `planes`: "" (the default: instream, eager and, with --device=cuda and --doorbell other than
// off, doorbell) or a comma-separated list of plane names. INVALID_ARGUMENT for an unknown or
// missing name; FAILED_PRECONDITION for a plane `device` cannot run (doorbell in host mode).
absl::StatusOr<PlaneChoice> ParsePlanes(const std::string& planes, const std::string& device,
                                        const std::string& doorbell);

// --tokens and --hidden (`what` names the flag in the error); --dtype.
absl::StatusOr<std::vector<uint32_t>> ParseList(const std::string& s, const char* what);
absl::StatusOr<DType> ParseDType(const std::string& s);

// Inputs every process can regenerate for every rank: small multiples of 1/8, exact in bf16.
float InputValue(int rank, uint64_t i);
float ResidualValue(uint64_t i);
float GammaValue(uint64_t h);
// Rank `rank`'s input of replay variant k (k >= 1: other small multiples of 1/8 than variant 0,
// the eager rows' input), for the rows that run the op with a new input before every launch.
float VariantInput(int rank, uint64_t i, int k);

// The ranks' agreement before a plane's first op (every rank must launch the same ops, or its
// peers spin until the spin timeout): each rank writes whether it can run `tag` (and why not)
// under <dir>/votes, then waits until every rank has. OK with an empty string when every rank
// can, OK with "rank R: why" naming the first rank that cannot, DEADLINE_EXCEEDED when a rank
// does not vote by `deadline_s` seconds from now.
absl::StatusOr<std::string> Agree(const std::string& dir, int rank, int world,
                                  const std::string& tag, const std::string& why_not,
                                  double deadline_s);

// Rank `rank`'s sidecar socket in the run's directory.
std::string SocketOf(const std::string& dir, int rank);

// Each plane's row runs kDemoWarmup untimed ops, then the timed ones, cycling through
// kDemoVariants inputs per rank (VariantInput); the last op of each variant is checked.
constexpr int kDemoVariants = 3;
constexpr int kDemoWarmup = 3;

// Memory for one shape: input | residual_in | residual_out | norm_out | gamma, each 256-aligned.
struct Layout {
  uint64_t tensor = 0, gamma = 0;
  uint64_t input = 0, residual_in = 0, residual_out = 0, norm_out = 0, gamma_off = 0, total = 0;
  Layout(const Shape& s, DType dt) {
    auto up = [](uint64_t v) { return (v + 255) / 256 * 256; };
    tensor = up(uint64_t{s.tokens} * s.hidden * DTypeSize(dt));
    gamma = up(uint64_t{s.hidden} * DTypeSize(dt));
    residual_in = tensor;
    residual_out = 2 * tensor;
    norm_out = 3 * tensor;
    gamma_off = 4 * tensor;
    total = 4 * tensor + gamma;
  }
};

// Device memory for --device=cuda (a plain cudaMalloc, exported by IPC), host memory otherwise.
class Buffer {
 public:
  virtual ~Buffer() = default;
  virtual absl::StatusOr<client::Region> Register(client::Client& c, const std::string& name) = 0;
  virtual absl::Status Upload(const std::vector<char>& host) = 0;
  virtual absl::Status Download(std::vector<char>& host) = 0;
};

class HostBuffer final : public Buffer {
 public:
  explicit HostBuffer(client::HostShmBuffer b) : b_(std::move(b)) {}
  absl::StatusOr<client::Region> Register(client::Client& c, const std::string& name) override {
    return c.RegisterHostBuffer(name, b_);
  }
  absl::Status Upload(const std::vector<char>& host) override {
    std::memcpy(b_.data(), host.data(), host.size());
    return absl::OkStatus();
  }
  absl::Status Download(std::vector<char>& host) override {
    std::memcpy(host.data(), b_.data(), host.size());
    return absl::OkStatus();
  }

 private:
  client::HostShmBuffer b_;
};

#if defined(ARFUSE_DEMO_CUDA)
class CudaBuffer final : public Buffer {
 public:
  static absl::StatusOr<std::unique_ptr<Buffer>> Create(uint64_t bytes, int device) {
    auto b = std::unique_ptr<CudaBuffer>(new CudaBuffer());
    b->device_ = device;
    b->bytes_ = bytes;
    if (cudaSetDevice(device) != cudaSuccess || cudaMalloc(&b->ptr_, bytes) != cudaSuccess) {
      return absl::ResourceExhaustedError("cudaMalloc failed");
    }
    cudaIpcMemHandle_t h;
    if (cudaIpcGetMemHandle(&h, b->ptr_) != cudaSuccess) {
      return absl::InternalError("cudaIpcGetMemHandle failed");
    }
    b->handle_.assign(reinterpret_cast<const char*>(&h), sizeof(h));
    return std::unique_ptr<Buffer>(std::move(b));
  }
  ~CudaBuffer() override {
    if (ptr_) cudaFree(ptr_);
  }
  void* ptr() const { return ptr_; }
  absl::StatusOr<client::Region> Register(client::Client& c, const std::string& name) override {
    return c.RegisterCudaIpc(name, handle_, device_, bytes_);
  }
  absl::Status Upload(const std::vector<char>& host) override {
    return cudaMemcpy(ptr_, host.data(), host.size(), cudaMemcpyHostToDevice) == cudaSuccess
               ? absl::OkStatus()
               : absl::InternalError("cudaMemcpy H2D failed");
  }
  absl::Status Download(std::vector<char>& host) override {
    return cudaMemcpy(host.data(), ptr_, host.size(), cudaMemcpyDeviceToHost) == cudaSuccess
               ? absl::OkStatus()
               : absl::InternalError("cudaMemcpy D2H failed");
  }

 private:
  CudaBuffer() = default;
  void* ptr_ = nullptr;
  uint64_t bytes_ = 0;
  int device_ = 0;
  std::string handle_;
};
#endif

struct ShapeResult {
  Shape shape;
  std::string path = "-";
  double us_per_op = 0;
  double max_error = 0;
  bool ok = false;
  std::string error;
};

// One rank's region contents for shape `s`: its `input`, the residual and gamma every process
// regenerates, zeroed outputs.
std::vector<char> RegionImage(const Layout& L, const Shape& s, DType dt,
                              const std::vector<char>& input);

// Compares one rank's outputs of shape `s` with the CPU reference over every rank's inputs:
// residual_out is bit-exact on every path, norm_out within two units of the dtype's last place.
// Raises *max_error to the largest difference; false when any element is off.
absl::StatusOr<bool> MatchesReference(DType dt, int world, const Shape& s,
                                      const std::vector<const void*>& rank_inputs,
                                      const char* residual_in, const char* gamma,
                                      const char* got_residual, const char* got_norm,
                                      double* max_error);

}  // namespace arfuse::demo
