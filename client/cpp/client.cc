#include "client/cpp/client.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/fd/fd_channel_client.h"
#include "common/status_macros.h"
#include "common/version.h"

namespace arfuse::client {
namespace {

constexpr char kSessionKey[] = "arfuse-session";

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

void SetRef(const std::optional<TensorLoc>& loc, v1::RegionRef* ref) {
  ref->set_region_id(loc->region.id);
  ref->set_generation(loc->region.generation);
  ref->set_offset(loc->offset);
}

void ToOpSpec(const OpDesc& op, v1::OpSpec* spec) {
  spec->set_pattern(ToProto(op.pattern));
  spec->set_dtype(ToProto(op.dtype));
  spec->set_hidden(op.hidden);
  spec->set_max_tokens(op.max_tokens);
  if (op.eps) spec->set_eps(*op.eps);
  if (op.input) SetRef(op.input, spec->mutable_input());
  if (op.output) SetRef(op.output, spec->mutable_output());
  if (op.residual_in) SetRef(op.residual_in, spec->mutable_residual_in());
  if (op.residual_out) SetRef(op.residual_out, spec->mutable_residual_out());
  if (op.norm_out) SetRef(op.norm_out, spec->mutable_norm_out());
  if (op.gamma) SetRef(op.gamma, spec->mutable_gamma());
}

}  // namespace

std::string GrpcTarget(const std::string& target) {
  if (absl::StartsWith(target, "unix:") || absl::StartsWith(target, "unix-abstract:")) {
    return target;
  }
  if (absl::StartsWith(target, "/") || absl::StartsWith(target, ".")) {
    return absl::StrCat("unix:", target);
  }
  return target;
}

v1::DType ToProto(DType d) { return static_cast<v1::DType>(d); }
v1::Pattern ToProto(Pattern p) { return static_cast<v1::Pattern>(p); }

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  if (options.target.empty()) return absl::InvalidArgumentError("target is empty");
  if (options.keepalive_time < absl::Seconds(1) || options.keepalive_time > absl::Hours(2)) {
    return absl::InvalidArgumentError(absl::StrCat("keepalive_time must be within 1s..2h, got ",
                                                   absl::FormatDuration(options.keepalive_time)));
  }
  std::unique_ptr<Client> c(new Client());
  c->options_ = options;
  grpc::ChannelArguments args;
  // Keep the session stream alive across idle periods; a dead sidecar is noticed by keepalive.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS,
              static_cast<int>(absl::ToInt64Milliseconds(options.keepalive_time)));
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  c->channel_ = grpc::CreateCustomChannel(GrpcTarget(options.target),
                                          grpc::InsecureChannelCredentials(), args);
  const absl::Time deadline = absl::Now() + options.connect_timeout;
  if (!c->channel_->WaitForConnected(absl::ToChronoTime(deadline))) {
    return absl::UnavailableError(absl::StrCat("no arfused answers at ", options.target, " within ",
                                               absl::FormatDuration(options.connect_timeout)));
  }
  c->stub_ = v1::Fusion::NewStub(c->channel_);
  c->session_ctx_ = std::make_unique<grpc::ClientContext>();
  c->session_ctx_->AddMetadata(kApiVersionMetadataKey, absl::StrCat(kApiMajor, ".", kApiMinor));
  c->session_stream_ = c->stub_->Session(c->session_ctx_.get());
  v1::SessionRequest hello;
  hello.set_client_name(options.client_name);
  v1::SessionResponse resp;
  // The first reply carries the session id. Read on a helper-free path: the sidecar answers at
  // once, and a dead one breaks the stream, so Read is bounded by the connection itself; the
  // alarm below bounds it by connect_timeout anyway.
  std::atomic<bool> done{false};
  std::thread watchdog([&] {
    while (!done.load() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
    if (!done.load()) c->session_ctx_->TryCancel();
  });
  bool ok = c->session_stream_->Write(hello) && c->session_stream_->Read(&resp);
  done = true;
  watchdog.join();
  if (!ok) {
    grpc::Status s = c->session_stream_->Finish();
    c->session_stream_.reset();
    if (s.ok() || s.error_code() == grpc::StatusCode::CANCELLED) {
      return absl::UnavailableError("the sidecar did not open a session in time");
    }
    return FromGrpc(s);
  }
  if (resp.session_token().empty()) {
    c->session_ctx_->TryCancel();
    c->session_stream_->Finish().ok();
    c->session_stream_.reset();
    return absl::FailedPreconditionError(
        absl::StrCat("the sidecar (API ", resp.server_api().major(), ".", resp.server_api().minor(),
                     ") sent no session token; this client needs API ", kApiMajor, ".", kApiMinor,
                     " or later: use the sidecar of this client's release"));
  }
  c->session_.session_token = resp.session_token();
  c->session_.device = resp.device();
  c->session_.rank = resp.rank();
  c->session_.world_size = resp.world_size();
  c->session_.server_api_major = resp.server_api().major();
  c->session_.server_api_minor = resp.server_api().minor();
  c->api_version_value_ = absl::StrCat(kApiMajor, ".", kApiMinor);
  c->session_value_ = c->session_.session_token;
  return c;
}

Client::~Client() {
  if (session_stream_) {
    session_stream_->WritesDone();
    // Cancel rather than wait for the sidecar's answer: the destructor stays bounded, and the
    // sidecar releases the session on cancellation just the same.
    session_ctx_->TryCancel();
    session_stream_->Finish().ok();
  }
}

void Client::PrepareContext(grpc::ClientContext* ctx, absl::Duration timeout) const {
  ctx->AddMetadata(kApiVersionMetadataKey, api_version_value_);
  ctx->AddMetadata(kSessionKey, session_value_);
  if (timeout <= absl::ZeroDuration()) timeout = options_.default_timeout;
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

absl::StatusOr<Region> Client::DoRegister(const v1::RegisterRegionRequest& req) {
  v1::RegisterRegionResponse resp;
  grpc::ClientContext ctx;
  PrepareContext(&ctx, absl::ZeroDuration());
  grpc::Status s = stub_->RegisterRegion(&ctx, req, &resp);
  if (!s.ok()) return FromGrpc(s);
  return Region{resp.region_id(), resp.generation(), req.name(), req.byte_size()};
}

absl::StatusOr<Region> Client::RegisterHostShm(const std::string& name, const std::string& shm_name,
                                               uint64_t byte_size) {
  v1::RegisterRegionRequest req;
  req.set_name(name);
  req.set_byte_size(byte_size);
  req.mutable_host_shm()->set_shm_name(shm_name);
  return DoRegister(req);
}

absl::StatusOr<std::string> Client::FdChannelSocket() const {
  const std::string grpc_target = GrpcTarget(options_.target);
  absl::string_view target = grpc_target;
  // "unix-abstract:" names no path the fd channel could sit beside.
  if (!absl::ConsumePrefix(&target, "unix:")) {
    return absl::FailedPreconditionError(absl::StrCat(
        "host memory by descriptor needs the sidecar's Unix socket, not ", options_.target));
  }
  absl::ConsumePrefix(&target, "//");  // unix://<absolute path>
  return FdChannelPath(target);
}

absl::StatusOr<Region> Client::RegisterHostFd(const std::string& name, int fd, uint64_t byte_size) {
  ARFUSE_ASSIGN_OR_RETURN(std::string path, FdChannelSocket());
  ARFUSE_ASSIGN_OR_RETURN(std::string ticket, DepositFds(path, {fd}, options_.default_timeout));
  v1::RegisterRegionRequest req;
  req.set_name(name);
  req.set_byte_size(byte_size);
  req.mutable_host_fd()->set_fd_ticket(ticket);
  return DoRegister(req);
}

absl::StatusOr<Region> Client::RegisterHostBuffer(const std::string& name,
                                                  const HostShmBuffer& buffer) {
  if (buffer.fd() >= 0) return RegisterHostFd(name, buffer.fd(), buffer.size());
  return RegisterHostShm(name, buffer.shm_name(), buffer.size());
}

absl::StatusOr<Region> Client::RegisterCudaIpc(const std::string& name,
                                               const std::string& ipc_handle, int32_t device_id,
                                               uint64_t byte_size) {
  v1::RegisterRegionRequest req;
  req.set_name(name);
  req.set_byte_size(byte_size);
  req.mutable_cuda_ipc()->set_handle(ipc_handle);
  req.mutable_cuda_ipc()->set_device_id(device_id);
  return DoRegister(req);
}

absl::Status Client::Unregister(const Region& region, absl::Duration timeout) {
  v1::UnregisterRegionRequest req;
  req.set_region_id(region.id);
  req.set_generation(region.generation);
  v1::UnregisterRegionResponse resp;
  grpc::ClientContext ctx;
  PrepareContext(&ctx, timeout);
  return FromGrpc(stub_->UnregisterRegion(&ctx, req, &resp));
}

absl::StatusOr<std::vector<v1::RegionInfo>> Client::ListRegions() {
  v1::ListRegionsRequest req;
  v1::ListRegionsResponse resp;
  grpc::ClientContext ctx;
  PrepareContext(&ctx, absl::ZeroDuration());
  grpc::Status s = stub_->ListRegions(&ctx, req, &resp);
  if (!s.ok()) return FromGrpc(s);
  return std::vector<v1::RegionInfo>(resp.regions().begin(), resp.regions().end());
}

absl::StatusOr<Plan> Client::CreatePlan(const OpDesc& op, bool doorbell) {
  v1::CreatePlanRequest req;
  ToOpSpec(op, req.mutable_op());
  req.set_doorbell(doorbell);
  v1::CreatePlanResponse resp;
  grpc::ClientContext ctx;
  PrepareContext(&ctx, absl::ZeroDuration());
  grpc::Status s = stub_->CreatePlan(&ctx, req, &resp);
  if (!s.ok()) return FromGrpc(s);
  Plan plan{resp.plan_id(), resp.generation(), resp.path(), resp.reason(), std::nullopt};
  if (resp.has_doorbell() && !resp.doorbell().ipc_handle().empty()) {
    const v1::Doorbell& d = resp.doorbell();
    plan.doorbell = DoorbellInfo{d.ipc_handle(), d.offset(), d.request_value(), d.complete_value(),
                                 d.reset_value()};
  }
  return plan;
}

absl::Status Client::DestroyPlan(const Plan& plan) {
  v1::DestroyPlanRequest req;
  req.set_plan_id(plan.id);
  req.set_generation(plan.generation);
  v1::DestroyPlanResponse resp;
  grpc::ClientContext ctx;
  PrepareContext(&ctx, absl::ZeroDuration());
  return FromGrpc(stub_->DestroyPlan(&ctx, req, &resp));
}

absl::StatusOr<ExecResult> Client::DoExecute(v1::ExecuteRequest& req, const ExecOptions& options) {
  req.set_wait_event(options.wait_event);
  req.set_synchronous(options.synchronous);
  req.set_workspace_generation(options.workspace_generation);
  v1::ExecuteResponse resp;
  grpc::ClientContext ctx;
  PrepareContext(&ctx, options.timeout);
  grpc::Status s = stub_->Execute(&ctx, req, &resp);
  if (!s.ok()) return FromGrpc(s);
  return ExecResult{resp.path(), resp.reason(), resp.done_event(), resp.workspace_generation()};
}

absl::StatusOr<ExecResult> Client::Execute(const Plan& plan, uint32_t num_tokens,
                                           const ExecOptions& options) {
  v1::ExecuteRequest req;
  req.set_plan_id(plan.id);
  req.set_plan_generation(plan.generation);
  req.set_num_tokens(num_tokens);
  return DoExecute(req, options);
}

absl::StatusOr<ExecResult> Client::ExecuteOp(const OpDesc& op, uint32_t num_tokens,
                                             const ExecOptions& options) {
  v1::ExecuteRequest req;
  ToOpSpec(op, req.mutable_op());
  req.set_num_tokens(num_tokens);
  return DoExecute(req, options);
}

bool IsFusionUnavailableForOp(const absl::Status& status) {
  return status.code() == absl::StatusCode::kOutOfRange;
}

namespace {

absl::StatusOr<std::optional<ExecResult>> UnlessUnavailable(absl::StatusOr<ExecResult> result) {
  if (result.ok()) return std::optional<ExecResult>(*std::move(result));
  if (IsFusionUnavailableForOp(result.status())) return std::optional<ExecResult>();
  return result.status();
}

}  // namespace

absl::StatusOr<std::optional<ExecResult>> Client::TryExecute(const Plan& plan, uint32_t num_tokens,
                                                             const ExecOptions& options) {
  return UnlessUnavailable(Execute(plan, num_tokens, options));
}

absl::StatusOr<std::optional<ExecResult>> Client::TryExecuteOp(const OpDesc& op,
                                                               uint32_t num_tokens,
                                                               const ExecOptions& options) {
  return UnlessUnavailable(ExecuteOp(op, num_tokens, options));
}

absl::StatusOr<v1::GetWorkspaceInfoResponse> Client::GetWorkspaceInfo() {
  v1::GetWorkspaceInfoRequest req;
  v1::GetWorkspaceInfoResponse resp;
  grpc::ClientContext ctx;
  PrepareContext(&ctx, absl::ZeroDuration());
  grpc::Status s = stub_->GetWorkspaceInfo(&ctx, req, &resp);
  if (!s.ok()) return FromGrpc(s);
  return resp;
}

absl::StatusOr<v1::AttachResponse> Client::Attach(const v1::AttachRequest& request) {
  v1::AttachResponse resp;
  grpc::ClientContext ctx;
  PrepareContext(&ctx, absl::ZeroDuration());
  grpc::Status s = stub_->Attach(&ctx, request, &resp);
  if (!s.ok()) return FromGrpc(s);
  return resp;
}

absl::Status Client::Detach(uint64_t attach_id) {
  v1::DetachRequest req;
  req.set_attach_id(attach_id);
  v1::DetachResponse resp;
  grpc::ClientContext ctx;
  PrepareContext(&ctx, absl::ZeroDuration());
  return FromGrpc(stub_->Detach(&ctx, req, &resp));
}

// ---- HostShmBuffer ----

absl::StatusOr<HostShmBuffer> HostShmBuffer::Create(uint64_t byte_size, const std::string& tag) {
  if (byte_size == 0) return absl::InvalidArgumentError("byte_size must be > 0");
  HostShmBuffer b;
  b.fd_ = memfd_create(absl::StrCat("arfuse-", tag).c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (b.fd_ < 0) {
    return absl::InternalError(absl::StrCat("memfd_create failed: ", std::strerror(errno)));
  }
  if (ftruncate(b.fd_, static_cast<off_t>(byte_size)) != 0) {
    return absl::ResourceExhaustedError(absl::StrCat("ftruncate failed: ", std::strerror(errno)));
  }
  if (fcntl(b.fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return absl::InternalError(absl::StrCat("sealing the memfd failed: ", std::strerror(errno)));
  }
  void* p = mmap(nullptr, byte_size, PROT_READ | PROT_WRITE, MAP_SHARED, b.fd_, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("mmap failed: ", std::strerror(errno)));
  }
  b.data_ = p;
  b.size_ = byte_size;
  return b;
}

absl::StatusOr<HostShmBuffer> HostShmBuffer::CreateNamed(uint64_t byte_size,
                                                         const std::string& tag) {
  static std::atomic<uint64_t> seq{0};
  if (byte_size == 0) return absl::InvalidArgumentError("byte_size must be > 0");
  HostShmBuffer b;
  b.name_ = absl::StrCat("/arfuse-", getpid(), "-", seq.fetch_add(1), "-", tag);
  int fd = shm_open(b.name_.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("shm_open failed: ", std::strerror(errno)));
  }
  if (ftruncate(fd, static_cast<off_t>(byte_size)) != 0) {
    int err = errno;
    close(fd);
    shm_unlink(b.name_.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("ftruncate failed: ", std::strerror(err)));
  }
  void* p = mmap(nullptr, byte_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(b.name_.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("mmap failed: ", std::strerror(err)));
  }
  b.data_ = p;
  b.size_ = byte_size;
  return b;
}

HostShmBuffer::HostShmBuffer(HostShmBuffer&& o) noexcept
    : name_(std::move(o.name_)),
      fd_(std::exchange(o.fd_, -1)),
      data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)) {
  o.name_.clear();
}

HostShmBuffer& HostShmBuffer::operator=(HostShmBuffer&& o) noexcept {
  if (this != &o) {
    Reset();
    name_ = std::move(o.name_);
    o.name_.clear();
    fd_ = std::exchange(o.fd_, -1);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

HostShmBuffer::~HostShmBuffer() { Reset(); }

void HostShmBuffer::Reset() {
  if (data_ != nullptr) munmap(data_, size_);
  if (!name_.empty()) shm_unlink(name_.c_str());
  if (fd_ >= 0) close(fd_);
  data_ = nullptr;
  size_ = 0;
  fd_ = -1;
  name_.clear();
}

const char* ExecPathName(v1::ExecPath path) {
  switch (path) {
    case v1::EXEC_PATH_ONESHOT:
      return "oneshot";
    case v1::EXEC_PATH_TWOSHOT:
      return "twoshot";
    case v1::EXEC_PATH_UNFUSED:
      return "unfused";
    case v1::EXEC_PATH_HOST:
      return "host";
    default:
      return "unknown";
  }
}

}  // namespace arfuse::client
