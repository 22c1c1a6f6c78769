// arfuse C++ client: connect to a sidecar (Unix socket path or host:port), keep a session open,
// register regions (host shared memory or CUDA IPC), create plans and run the fused op on the
// eager plane. Every call carries the API version and the session id, and a deadline (the
// caller's timeout, or ClientOptions::default_timeout). Results are absl::Status codes as the
// sidecar sent them (docs/api.md lists them).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "arfuse/v1/fusion.grpc.pb.h"
#include "kernels/common/op_types.h"

namespace arfuse::client {

struct ClientOptions {
  // "unix:/run/arfuse/rank0.sock", a plain path ("/run/arfuse/rank0.sock"), or "host:port".
  std::string target;
  // For the sidecar's logs only.
  std::string client_name = "arfuse-cpp";
  absl::Duration default_timeout = absl::Seconds(10);
  // How long Connect waits for the sidecar to accept the connection and open the session.
  absl::Duration connect_timeout = absl::Seconds(10);
  // How often the channel pings the sidecar while idle, so that a session stream with no traffic
  // stays open and a dead sidecar is noticed. 1 s .. 2 h; arfused accepts pings this frequent.
  absl::Duration keepalive_time = absl::Seconds(10);
};

struct SessionInfo {
  // SessionResponse.session_token: 128 random bits as 32 hex characters. Every call of this
  // client carries it; only calls from this client's user reach the session.
  std::string session_token;
  v1::DeviceKind device = v1::DEVICE_KIND_UNSPECIFIED;
  uint32_t rank = 0;
  uint32_t world_size = 0;
  uint32_t server_api_major = 0;
  uint32_t server_api_minor = 0;
};

struct Region {
  uint64_t id = 0;
  uint64_t generation = 0;
  std::string name;
  uint64_t byte_size = 0;
};

// A tensor at `offset` bytes inside a registered region.
struct TensorLoc {
  Region region;
  uint64_t offset = 0;
};

struct OpDesc {
  Pattern pattern = Pattern::kAllReduceResidualRmsNorm;
  DType dtype = DType::kBF16;
  uint32_t hidden = 0;
  // Plans: the largest num_tokens Execute may ask for. Explicit ops: 0 means num_tokens.
  uint32_t max_tokens = 0;
  std::optional<float> eps;
  std::optional<TensorLoc> input;
  std::optional<TensorLoc> output;  // kAllReduce
  std::optional<TensorLoc> residual_in;
  std::optional<TensorLoc> residual_out;
  std::optional<TensorLoc> norm_out;
  std::optional<TensorLoc> gamma;
};

// CreatePlan(doorbell = true): the sidecar-owned words the ring kernel uses (client/ring,
// docs/doorbell.md), as the Doorbell message carries them.
struct DoorbellInfo {
  std::string ipc_handle;  // 64 bytes: cudaIpcMemHandle_t of the doorbell block
  uint64_t offset = 0;     // this plan's slot in the block
  uint32_t request_value = 0;
  uint32_t complete_value = 0;
  uint32_t reset_value = 0;
};

struct Plan {
  uint64_t id = 0;
  uint64_t generation = 0;
  v1::ExecPath path = v1::EXEC_PATH_UNSPECIFIED;
  std::string reason;
  // Set when the plan was created with doorbell = true and the sidecar answered with one.
  std::optional<DoorbellInfo> doorbell;
};

struct ExecOptions {
  // cudaIpcEventHandle_t the sidecar's stream waits on (CUDA only); empty: none.
  std::string wait_event;
  bool synchronous = false;
  uint64_t workspace_generation = 0;
  // 0: ClientOptions::default_timeout.
  absl::Duration timeout = absl::ZeroDuration();
};

struct ExecResult {
  v1::ExecPath path = v1::EXEC_PATH_UNSPECIFIED;
  std::string reason;
  // cudaIpcEventHandle_t to wait on (CUDA, asynchronous ops); empty when the op completed.
  std::string done_event;
  uint64_t workspace_generation = 0;
};

// True when the sidecar refused an op because the fused path cannot run it (larger than the
// workspace, another dtype): OUT_OF_RANGE, with a message starting "fusion unavailable for this
// op: ". Nothing ran on any rank; the framework's own path takes the op, as FlashInfer's callers
// fall back when its fused op returns nothing (docs/config.md, "Fallback honesty").
bool IsFusionUnavailableForOp(const absl::Status& status);
class HostShmBuffer;

class Client {
 public:
  // Connects and opens the session. UNAVAILABLE when nothing answers within connect_timeout.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  // Ends the session (the sidecar releases its regions and plans). Bounded: cancels the stream.
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const SessionInfo& session() const { return session_; }

  // Host memory by descriptor: `fd` is a memfd sealed against shrinking (HostShmBuffer::Create
  // makes one). It goes to the sidecar over its fd channel (FdChannelPath of the target; a Unix
  // socket target only) and the ticket it answers names it in RegisterRegion. The caller's
  // descriptor stays open.
  absl::StatusOr<Region> RegisterHostFd(const std::string& name, int fd, uint64_t byte_size);
  // A named POSIX shm object (compatibility; prefer RegisterHostFd): the sidecar opens it only if
  // this process's user may open it read-write.
  absl::StatusOr<Region> RegisterHostShm(const std::string& name, const std::string& shm_name,
                                         uint64_t byte_size);
  // `buffer` by descriptor when it is a memfd, else by name.
  absl::StatusOr<Region> RegisterHostBuffer(const std::string& name, const HostShmBuffer& buffer);
  // The sidecar's fd channel path; FAILED_PRECONDITION for a target that is not a Unix socket.
  absl::StatusOr<std::string> FdChannelSocket() const;
  // `ipc_handle`: the 64 bytes of cudaIpcGetMemHandle for a plain cudaMalloc allocation.
  absl::StatusOr<Region> RegisterCudaIpc(const std::string& name, const std::string& ipc_handle,
                                         int32_t device_id, uint64_t byte_size);
  absl::Status Unregister(const Region& region, absl::Duration timeout = absl::ZeroDuration());
  absl::StatusOr<std::vector<v1::RegionInfo>> ListRegions();

  absl::StatusOr<Plan> CreatePlan(const OpDesc& op, bool doorbell = false);
  absl::Status DestroyPlan(const Plan& plan);

  absl::StatusOr<ExecResult> Execute(const Plan& plan, uint32_t num_tokens,
                                     const ExecOptions& options = {});
  absl::StatusOr<ExecResult> ExecuteOp(const OpDesc& op, uint32_t num_tokens,
                                       const ExecOptions& options = {});
  // Execute / ExecuteOp for callers with a path of their own: nullopt when the fused path is
  // unavailable for this op (IsFusionUnavailableForOp), other errors as they came.
  absl::StatusOr<std::optional<ExecResult>> TryExecute(const Plan& plan, uint32_t num_tokens,
                                                       const ExecOptions& options = {});
  absl::StatusOr<std::optional<ExecResult>> TryExecuteOp(const OpDesc& op, uint32_t num_tokens,
                                                         const ExecOptions& options = {});

  absl::StatusOr<v1::GetWorkspaceInfoResponse> GetWorkspaceInfo();

  // Fusion.Attach / Fusion.Detach of the in-stream plane (docs/instream.md), as raw messages:
  // the request carries the client library's versions (client/cpp/instream_attach.h fills them
  // from libarfuse_client and completes the attach). Detach after the attachment's launches and
  // the graphs that captured them are gone.
  absl::StatusOr<v1::AttachResponse> Attach(const v1::AttachRequest& request);
  absl::Status Detach(uint64_t attach_id);

  // The raw stub and a context with version, session and deadline set, for calls this class
  // does not wrap.
  v1::Fusion::Stub& stub() { return *stub_; }
  // The channel every call of this client goes over (for other services on the same socket,
  // e.g. grpc.health.v1).
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  void PrepareContext(grpc::ClientContext* ctx, absl::Duration timeout) const;

 private:
  Client() = default;
  absl::StatusOr<ExecResult> DoExecute(v1::ExecuteRequest& req, const ExecOptions& options);
  absl::StatusOr<Region> DoRegister(const v1::RegisterRegionRequest& req);

  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Fusion::Stub> stub_;
  std::unique_ptr<grpc::ClientContext> session_ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionResponse>>
      session_stream_;
  SessionInfo session_;
  // The metadata values every call carries, formatted once.
  std::string api_version_value_;
  std::string session_value_;
};

// Turns "unix:/p", "/p" or "host:port" into a gRPC target.
std::string GrpcTarget(const std::string& target);

// The proto enum values of the plain enums.
v1::DType ToProto(DType d);
v1::Pattern ToProto(Pattern p);

// Host shared memory this process creates and maps, for host-mode regions. Create makes a memfd
// sealed against shrinking and growing (F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_SEAL), registered by
// descriptor (Client::RegisterHostBuffer): the descriptor proves this process's access and the
// seal keeps the memory from shrinking under the sidecar. CreateNamed makes a named POSIX shm
// object ("/arfuse-<pid>-<n>-<tag>", mode 0600) instead, for sidecars that predate descriptors.
// Unmapped (and closed or unlinked) in the destructor. Move-only.
class HostShmBuffer {
 public:
  static absl::StatusOr<HostShmBuffer> Create(uint64_t byte_size, const std::string& tag = "buf");
  static absl::StatusOr<HostShmBuffer> CreateNamed(uint64_t byte_size,
                                                   const std::string& tag = "buf");
  HostShmBuffer(HostShmBuffer&& o) noexcept;
  HostShmBuffer& operator=(HostShmBuffer&& o) noexcept;
  HostShmBuffer(const HostShmBuffer&) = delete;
  HostShmBuffer& operator=(const HostShmBuffer&) = delete;
  ~HostShmBuffer();

  // The object's name; empty for a memfd.
  const std::string& shm_name() const { return name_; }
  // The memfd; -1 for a named object.
  int fd() const { return fd_; }
  void* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  HostShmBuffer() = default;
  void Reset();
  std::string name_;
  int fd_ = -1;
  void* data_ = nullptr;
  uint64_t size_ = 0;
};

// The short name of a reply's path, as tables and logs print it: "oneshot", "twoshot",
// "unfused", "host", or "unknown".
const char* ExecPathName(v1::ExecPath path);

}  // namespace arfuse::client
