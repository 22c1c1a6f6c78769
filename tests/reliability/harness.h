// Reliability harness (docs/reliability.md): real `arfused --device=host` processes, clients
// through client/cpp, and outside-in observations of a sidecar (readiness, Admin.GetStats, the
// client shared-memory objects it maps, its resident memory). Shared by the fault, bad-input and
// load tests. Every wait here is on a condition with a bound, never a bare sleep.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "arfuse/v1/admin.grpc.pb.h"
#include "client/cpp/client.h"
#include "kernels/common/op_types.h"
#include "tests/support/subprocess.h"

namespace arfuse::reliability {

// ---------------------------------------------------------------- sidecars

// Where the tensors live: host shared memory (--device=host, CI) or CUDA memory exported by
// legacy IPC handles (--device=cuda; the harness is built with it only with the toolkit).
enum class Device { kHost, kCuda };
const char* DeviceName(Device d);

struct SidecarConfig {
  Device device = Device::kHost;
  int rank = 0;
  int world_size = 1;
  // The group's directory: sockets (<dir>/s<rank>.sock) and peers (<dir>/peers).
  std::string dir;
  std::string group = "rel";
  int max_tokens = 64;
  int hidden = 1024;
  std::string dtype = "bf16";
  // Small, so faults are detected fast; generous enough for a loaded 2-core machine.
  double spin_timeout_s = 2;
  double peer_timeout_s = 3;
  double grace_period_s = 5;
  double default_deadline_s = 10;
  std::vector<std::string> extra_flags;
};

// One arfused process. Start() may be called again after the process died (a restart on the
// same socket, same flags).
class Sidecar {
 public:
  explicit Sidecar(SidecarConfig config);
  ~Sidecar();  // SIGKILLs a process still running (Subprocess does)

  // Spawns the process and waits for its "ready to accept" line (the servers listen; the group
  // may still be forming). False with the log in `why` on failure.
  bool Start(std::chrono::milliseconds timeout = std::chrono::seconds(30));
  void Signal(int sig);
  // Exit code, or nullopt while it still runs after `timeout`.
  std::optional<int> Wait(std::chrono::milliseconds timeout);
  bool running() const;

  pid_t pid() const;
  const std::string& socket() const { return socket_; }
  int rank() const { return config_.rank; }
  int health_port() const { return health_port_; }
  // stdout + stderr of the current (or last) process.
  std::string Log() const;
  const SidecarConfig& config() const { return config_; }

 private:
  SidecarConfig config_;
  std::string socket_;
  int health_port_ = 0;
  std::unique_ptr<testing::Subprocess> proc_;
  bool exited_ = false;
};

// N sidecars of one host-mode group in a fresh temporary directory.
class Group {
 public:
  Group(int world_size, SidecarConfig base = {});
  ~Group();  // stops the sidecars, removes the directory (sockets)
  bool StartAll(std::chrono::milliseconds timeout = std::chrono::seconds(30));
  // Readiness of every rank is SERVING (the group formed and the workspace is built).
  bool WaitAllReady(absl::Duration timeout);
  Sidecar& operator[](int rank) { return *sidecars_[rank]; }
  int world_size() const { return static_cast<int>(sidecars_.size()); }
  const std::string& dir() const { return dir_; }
  std::string Logs() const;

 private:
  std::string dir_;
  std::vector<std::unique_ptr<Sidecar>> sidecars_;
};

// ---------------------------------------------------------------- observations

// grpc.health.v1 Check of `service` on the sidecar's socket ("" liveness, "arfuse.v1.Fusion"
// readiness). The call is bounded by `timeout`.
absl::StatusOr<bool> Serving(const std::string& socket, const std::string& service,
                             absl::Duration timeout = absl::Seconds(2));
inline constexpr char kReadiness[] = "arfuse.v1.Fusion";
// Polls readiness until it equals `serving`, up to `timeout`.
bool WaitReadiness(const std::string& socket, bool serving, absl::Duration timeout);

absl::StatusOr<v1::GetStatsResponse> GetStats(const std::string& socket,
                                              absl::Duration timeout = absl::Seconds(5));

// VmRSS of a process in KiB (from /proc/PID/status); -1 when unreadable.
int64_t VmRssKiB(pid_t pid);
// Client shared-memory objects mapped into `pid` (lines of /proc/PID/maps naming
// /dev/shm/arfuse-*, not the sidecar's own /dev/shm/arfuse-host-* workspace); -1 when unreadable.
int ClientShmMappings(pid_t pid);

// Polls `cond` every 20 ms until it holds or `timeout` passes.
bool WaitUntil(const std::function<bool()>& cond, absl::Duration timeout);

// ---------------------------------------------------------------- clients

struct ShapeConfig {
  Pattern pattern = Pattern::kAllReduceResidualRmsNorm;
  DType dtype = DType::kBF16;
  uint32_t tokens = 8;
  uint32_t hidden = 256;
  float eps = 1e-6f;
};

// Deterministic inputs every process can regenerate for every rank: small multiples of 1/8,
// exact in bf16. `salt` tells clients (or iterations) apart.
float InputValue(int rank, uint64_t salt, uint64_t i);

// The memory of one client's tensors: a host view to write inputs and read outputs, synced
// to/from where the sidecar reads them (a no-op for host shared memory).
class TensorMemory {
 public:
  virtual ~TensorMemory() = default;
  virtual char* host() = 0;
  virtual absl::Status Upload() = 0;
  virtual absl::Status Download() = 0;
  virtual absl::StatusOr<client::Region> Register(client::Client& c, const std::string& name) = 0;
};
// `rank` picks the GPU (rank % visible GPUs, as arfused does). UNIMPLEMENTED for kCuda in a
// build without CUDA.
absl::StatusOr<std::unique_ptr<TensorMemory>> MakeTensorMemory(Device device, int rank,
                                                               uint64_t bytes);
// The CUDA implementation (harness_cuda.cc, or UNIMPLEMENTED without the toolkit).
absl::StatusOr<std::unique_ptr<TensorMemory>> MakeCudaTensorMemory(int rank, uint64_t bytes);

// One rank's client: a session, one region holding every tensor of the op, and a plan.
class RankClient {
 public:
  static absl::StatusOr<std::unique_ptr<RankClient>> Create(const std::string& socket, int rank,
                                                            int world_size, ShapeConfig shape,
                                                            uint64_t salt = 0,
                                                            const std::string& name = "rel",
                                                            Device device = Device::kHost);
  // Another session over the same buffer (after a sidecar restart): connects, re-registers,
  // re-creates the plan. The previous region and plan are kept in stale_region()/stale_plan().
  absl::Status Reconnect();

  // Writes this rank's input (salt), a residual drawn from `residual_seed`, gamma; fills the
  // outputs with a NaN pattern so that an op that did not write them is caught.
  void Prepare(uint64_t residual_seed);
  absl::StatusOr<client::ExecResult> Run(absl::Duration timeout = absl::Seconds(10));
  // Compares the outputs with kernels/host ReferenceFusedOp over every rank's inputs (same salt):
  // residual_out / output bit-exact, norm_out within two units in the last place of the dtype.
  bool Check(std::string* why);

  client::Client& client() { return *client_; }
  const client::Plan& plan() const { return plan_; }
  const client::Region& region() const { return region_; }
  const client::Region& stale_region() const { return stale_region_; }
  const client::Plan& stale_plan() const { return stale_plan_; }
  const ShapeConfig& shape() const { return shape_; }
  client::OpDesc op() const;  // the plan's op over the current region
  const std::string& socket() const { return socket_; }
  int rank() const { return rank_; }
  // Polls GetWorkspaceInfo until READY/UNFUSED (or `timeout`).
  absl::Status WaitWorkspaceReady(absl::Duration timeout);

 private:
  RankClient() = default;
  absl::Status Open();

  std::string socket_;
  int rank_ = 0;
  int world_size_ = 1;
  ShapeConfig shape_;
  uint64_t salt_ = 0;
  std::string name_;
  uint64_t residual_seed_ = 0;
  // Byte offsets of the tensors in the buffer.
  uint64_t off_input_ = 0, off_res_in_ = 0, off_res_out_ = 0, off_norm_ = 0, off_gamma_ = 0,
           total_ = 0;
  std::unique_ptr<TensorMemory> memory_;
  std::unique_ptr<client::Client> client_;
  client::Region region_, stale_region_;
  client::Plan plan_, stale_plan_;
};

// Codes an op may end with when a peer, the sidecar or the group fails (docs/api.md): anything
// else (OK aside) is a bug.
bool IsCleanFaultCode(absl::StatusCode code);

// p-th percentile (0..100) of `v` (copied and sorted); 0 for empty input.
double Percentile(std::vector<double> v, double p);

}  // namespace arfuse::reliability
