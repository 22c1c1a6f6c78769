#include "tests/reliability/harness.h"

#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/version.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "kernels/host/reference_op.h"

namespace arfuse::reliability {

using namespace std::chrono_literals;

const char* DeviceName(Device d) { return d == Device::kCuda ? "cuda" : "host"; }

// ---------------------------------------------------------------- sidecars

Sidecar::Sidecar(SidecarConfig config) : config_(std::move(config)) {
  socket_ = absl::StrCat(config_.dir, "/s", config_.rank, ".sock");
}

Sidecar::~Sidecar() {
  // SIGKILL (from ~Subprocess) ends a stopped process too; continuing it first lets it notice
  // nothing and keeps the order of events in its log plain.
  if (proc_ != nullptr && !exited_) {
    proc_->Signal(SIGCONT);
  }
}

bool Sidecar::Start(std::chrono::milliseconds timeout) {
  std::vector<std::string> argv = {
      testing::BinaryPath("server/daemon/arfused"),
      std::string("--device=") + DeviceName(config_.device),
      absl::StrCat("--rank=", config_.rank),
      absl::StrCat("--world-size=", config_.world_size),
      "--peer-dir=" + config_.dir + "/peers",
      "--group=" + config_.group,
      "--socket=" + socket_,
      "--health-port=0",
      "--health-host=127.0.0.1",
      absl::StrCat("--max-tokens=", config_.max_tokens),
      absl::StrCat("--hidden=", config_.hidden),
      "--dtype=" + config_.dtype,
      absl::StrCat("--spin-timeout=", config_.spin_timeout_s),
      absl::StrCat("--peer-timeout=", config_.peer_timeout_s),
      absl::StrCat("--grace-period=", config_.grace_period_s),
      absl::StrCat("--default-deadline=", config_.default_deadline_s),
  };
  argv.insert(argv.end(), config_.extra_flags.begin(), config_.extra_flags.end());
  proc_ = std::make_unique<testing::Subprocess>(argv);
  exited_ = false;
  health_port_ = 0;
  if (!proc_->WaitForOutput("ready to accept", timeout)) return false;
  std::smatch m;
  std::string out = proc_->Stdout();
  if (std::regex_search(out, m, std::regex("health_port=(\\d+)"))) {
    health_port_ = std::stoi(m[1]);
  }
  return true;
}

void Sidecar::Signal(int sig) {
  if (proc_ != nullptr && !exited_) proc_->Signal(sig);
}

std::optional<int> Sidecar::Wait(std::chrono::milliseconds timeout) {
  if (proc_ == nullptr) return 0;
  auto code = proc_->Wait(timeout);
  if (code) exited_ = true;
  return code;
}

bool Sidecar::running() const {
  if (proc_ == nullptr || exited_) return false;
  return const_cast<Sidecar*>(this)->Wait(0ms) == std::nullopt;
}

pid_t Sidecar::pid() const { return proc_ == nullptr ? -1 : proc_->pid(); }

std::string Sidecar::Log() const {
  return proc_ == nullptr ? std::string() : proc_->Stdout() + proc_->Stderr();
}

Group::Group(int world_size, SidecarConfig base) : dir_(testing::MakeTempDir()) {
  std::filesystem::create_directories(dir_ + "/peers");
  for (int r = 0; r < world_size; ++r) {
    SidecarConfig c = base;
    c.rank = r;
    c.world_size = world_size;
    c.dir = dir_;
    sidecars_.push_back(std::make_unique<Sidecar>(c));
  }
}

Group::~Group() {
  sidecars_.clear();
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

bool Group::StartAll(std::chrono::milliseconds timeout) {
  for (auto& s : sidecars_) {
    if (!s->Start(timeout)) return false;
  }
  return true;
}

bool Group::WaitAllReady(absl::Duration timeout) {
  const absl::Time until = absl::Now() + timeout;
  for (auto& s : sidecars_) {
    if (!WaitReadiness(s->socket(), true, until - absl::Now())) return false;
  }
  return true;
}

std::string Group::Logs() const {
  std::string out;
  for (const auto& s : sidecars_) {
    std::string log = s->Log();
    // The tail is what explains a failure; keep test output readable.
    if (log.size() > 6000) log = "...\n" + log.substr(log.size() - 6000);
    absl::StrAppend(&out, "---- arfused rank ", s->rank(), " ----\n", log, "\n");
  }
  return out;
}

// ---------------------------------------------------------------- observations

absl::StatusOr<bool> Serving(const std::string& socket, const std::string& service,
                             absl::Duration timeout) {
  auto channel = grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials());
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status s = stub->Check(&ctx, req, &resp);
  if (!s.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  }
  return resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

bool WaitReadiness(const std::string& socket, bool serving, absl::Duration timeout) {
  return WaitUntil(
      [&] {
        auto s = Serving(socket, kReadiness, absl::Seconds(1));
        return s.ok() && *s == serving;
      },
      timeout);
}

absl::StatusOr<v1::GetStatsResponse> GetStats(const std::string& socket, absl::Duration timeout) {
  auto channel = grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials());
  auto stub = v1::Admin::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  ctx.AddMetadata(kApiVersionMetadataKey, absl::StrCat(kApiMajor, ".", kApiMinor));
  v1::GetStatsRequest req;
  v1::GetStatsResponse resp;
  grpc::Status s = stub->GetStats(&ctx, req, &resp);
  if (!s.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  }
  return resp;
}

int64_t VmRssKiB(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) {
      std::istringstream ls(line.substr(6));
      int64_t kib = -1;
      ls >> kib;
      return kib;
    }
  }
  return -1;
}

int ClientShmMappings(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/maps"));
  if (!in) return -1;
  int n = 0;
  std::string line;
  while (std::getline(in, line)) {
    // Client memory: named objects, and memfds the clients handed over by descriptor (not the
    // sidecars' own host workspace, a memfd too).
    if ((line.find("/dev/shm/arfuse-") != std::string::npos &&
         line.find("/dev/shm/arfuse-host-") == std::string::npos) ||
        (line.find("/memfd:arfuse-") != std::string::npos &&
         line.find("/memfd:arfuse-host-workspace") == std::string::npos)) {
      ++n;
    }
  }
  return n;
}

bool WaitUntil(const std::function<bool()>& cond, absl::Duration timeout) {
  const absl::Time until = absl::Now() + timeout;
  for (;;) {
    if (cond()) return true;
    if (absl::Now() >= until) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
}

// ---------------------------------------------------------------- clients

float InputValue(int rank, uint64_t salt, uint64_t i) {
  return float(int((i * 7 + uint64_t(rank) * 13 + salt * 5) % 17) - 8) / 8.0f;
}

namespace {

uint64_t Align(uint64_t v) { return (v + 255) / 256 * 256; }

// splitmix64: residuals differ per op, reproducibly.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

float ResidualValue(uint64_t seed, uint64_t i) {
  return float(int(Mix(seed * 1000003 + i) % 23) - 11) / 4.0f;
}
float GammaValue(uint64_t h) { return 0.5f + float(h % 9) / 8.0f; }

}  // namespace

namespace {

class HostShmMemory final : public TensorMemory {
 public:
  explicit HostShmMemory(client::HostShmBuffer b) : b_(std::move(b)) {}
  char* host() override { return static_cast<char*>(b_.data()); }
  absl::Status Upload() override { return absl::OkStatus(); }
  absl::Status Download() override { return absl::OkStatus(); }
  absl::StatusOr<client::Region> Register(client::Client& c, const std::string& name) override {
    return c.RegisterHostBuffer(name, b_);
  }

 private:
  client::HostShmBuffer b_;
};

}  // namespace

#if !defined(ARFUSE_RELIABILITY_WITH_CUDA)
absl::StatusOr<std::unique_ptr<TensorMemory>> MakeCudaTensorMemory(int, uint64_t) {
  return absl::UnimplementedError("this test binary was built without CUDA");
}
#endif

absl::StatusOr<std::unique_ptr<TensorMemory>> MakeTensorMemory(Device device, int rank,
                                                               uint64_t bytes) {
  if (device == Device::kCuda) return MakeCudaTensorMemory(rank, bytes);
  auto buf = client::HostShmBuffer::Create(bytes, absl::StrCat("rel", rank));
  if (!buf.ok()) return buf.status();
  return std::unique_ptr<TensorMemory>(new HostShmMemory(std::move(*buf)));
}

absl::StatusOr<std::unique_ptr<RankClient>> RankClient::Create(const std::string& socket, int rank,
                                                               int world_size, ShapeConfig shape,
                                                               uint64_t salt,
                                                               const std::string& name,
                                                               Device device) {
  std::unique_ptr<RankClient> c(new RankClient());
  c->socket_ = socket;
  c->rank_ = rank;
  c->world_size_ = world_size;
  c->shape_ = shape;
  c->salt_ = salt;
  c->name_ = name;
  const uint64_t t = Align(uint64_t{shape.tokens} * shape.hidden * DTypeSize(shape.dtype));
  c->off_input_ = 0;
  c->off_res_in_ = t;
  c->off_res_out_ = 2 * t;
  c->off_norm_ = 3 * t;
  c->off_gamma_ = 4 * t;
  c->total_ = 4 * t + Align(uint64_t{shape.hidden} * DTypeSize(shape.dtype));
  auto mem = MakeTensorMemory(device, rank, c->total_);
  if (!mem.ok()) return mem.status();
  c->memory_ = std::move(*mem);
  if (absl::Status st = c->Open(); !st.ok()) return st;
  return c;
}

client::OpDesc RankClient::op() const {
  client::OpDesc op;
  op.pattern = shape_.pattern;
  op.dtype = shape_.dtype;
  op.hidden = shape_.hidden;
  op.max_tokens = shape_.tokens;
  op.eps = shape_.eps;
  op.input = client::TensorLoc{region_, off_input_};
  if (shape_.pattern == Pattern::kAllReduce) {
    op.output = client::TensorLoc{region_, off_res_out_};
  } else {
    op.residual_in = client::TensorLoc{region_, off_res_in_};
    op.residual_out = client::TensorLoc{region_, off_res_out_};
    op.norm_out = client::TensorLoc{region_, off_norm_};
    op.gamma = client::TensorLoc{region_, off_gamma_};
  }
  return op;
}

absl::Status RankClient::Open() {
  client::ClientOptions o;
  o.target = socket_;
  o.client_name = name_;
  o.default_timeout = absl::Seconds(10);
  o.connect_timeout = absl::Seconds(10);
  auto c = client::Client::Connect(o);
  if (!c.ok()) return c.status();
  client_ = std::move(*c);
  auto region = memory_->Register(*client_, name_);
  if (!region.ok()) return region.status();
  region_ = *region;
  auto plan = client_->CreatePlan(op());
  if (!plan.ok()) return plan.status();
  plan_ = *plan;
  return absl::OkStatus();
}

absl::Status RankClient::Reconnect() {
  stale_region_ = region_;
  stale_plan_ = plan_;
  client_.reset();
  return Open();
}

void RankClient::Prepare(uint64_t residual_seed) {
  residual_seed_ = residual_seed;
  const DType dt = shape_.dtype;
  const uint64_t n = uint64_t{shape_.tokens} * shape_.hidden;
  char* base = memory_->host();
  for (uint64_t i = 0; i < n; ++i) {
    StoreFromFloat(dt, base + off_input_, i, InputValue(rank_, salt_, i));
    StoreFromFloat(dt, base + off_res_in_, i, ResidualValue(residual_seed, i));
  }
  for (uint64_t h = 0; h < shape_.hidden; ++h) {
    StoreFromFloat(dt, base + off_gamma_, h, GammaValue(h));
  }
  // All-ones bytes are NaN in bf16, fp16 and fp32: an output the op did not write fails Check.
  std::memset(base + off_res_out_, 0xFF, off_gamma_ - off_res_out_);
  // A failed upload shows up as a wrong result in Check.
  (void)memory_->Upload();
}

absl::StatusOr<client::ExecResult> RankClient::Run(absl::Duration timeout) {
  client::ExecOptions eo;
  eo.synchronous = true;
  eo.timeout = timeout;
  return client_->Execute(plan_, shape_.tokens, eo);
}

bool RankClient::Check(std::string* why) {
  const DType dt = shape_.dtype;
  const uint64_t n = uint64_t{shape_.tokens} * shape_.hidden;
  if (absl::Status st = memory_->Download(); !st.ok()) {
    *why = st.ToString();
    return false;
  }
  const char* base = memory_->host();
  std::vector<std::vector<char>> inputs(world_size_, std::vector<char>(n * DTypeSize(dt)));
  std::vector<const void*> ptrs;
  for (int q = 0; q < world_size_; ++q) {
    for (uint64_t i = 0; i < n; ++i)
      StoreFromFloat(dt, inputs[q].data(), i, InputValue(q, salt_, i));
    ptrs.push_back(inputs[q].data());
  }
  std::vector<char> want_a(n * DTypeSize(dt)), want_b(n * DTypeSize(dt));
  CpuOpArgs ref;
  ref.pattern = shape_.pattern;
  ref.dtype = dt;
  ref.world_size = world_size_;
  ref.hidden = shape_.hidden;
  ref.num_tokens = shape_.tokens;
  ref.eps = shape_.eps;
  ref.rank_inputs = ptrs.data();
  if (shape_.pattern == Pattern::kAllReduce) {
    ref.output = want_a.data();
  } else {
    ref.residual_in = base + off_res_in_;
    ref.residual_out = want_a.data();
    ref.norm_out = want_b.data();
    ref.gamma = base + off_gamma_;
  }
  if (absl::Status st = ReferenceFusedOp(ref); !st.ok()) {
    *why = st.ToString();
    return false;
  }
  // The sum (and the residual add) is bit-exact; the norm within two units in the last place.
  if (std::memcmp(base + off_res_out_, want_a.data(), want_a.size()) != 0) {
    for (uint64_t i = 0; i < n; ++i) {
      float got = LoadAsFloat(dt, base + off_res_out_, i);
      float want = LoadAsFloat(dt, want_a.data(), i);
      if (!(got == want)) {
        *why = absl::StrCat(shape_.pattern == Pattern::kAllReduce ? "output" : "residual_out", "[",
                            i, "] = ", got, ", want ", want);
        return false;
      }
    }
  }
  if (shape_.pattern == Pattern::kAllReduceResidualRmsNorm) {
    const double tol = dt == DType::kFP32 ? 1e-5 : (dt == DType::kFP16 ? 2e-3 : 1.6e-2);
    for (uint64_t i = 0; i < n; ++i) {
      double got = LoadAsFloat(dt, base + off_norm_, i);
      double want = LoadAsFloat(dt, want_b.data(), i);
      if (!(std::fabs(got - want) <= tol * std::max(1.0, std::fabs(want)))) {
        *why = absl::StrCat("norm_out[", i, "] = ", got, ", want ", want);
        return false;
      }
    }
  }
  return true;
}

absl::Status RankClient::WaitWorkspaceReady(absl::Duration timeout) {
  const absl::Time until = absl::Now() + timeout;
  std::string last = "no answer";
  for (;;) {
    auto info = client_->GetWorkspaceInfo();
    if (info.ok()) {
      if (info->state() == v1::WORKSPACE_STATE_READY ||
          info->state() == v1::WORKSPACE_STATE_UNFUSED) {
        return absl::OkStatus();
      }
      last = absl::StrCat("state ", v1::WorkspaceState_Name(info->state()), ": ", info->reason());
    } else {
      last = info.status().ToString();
    }
    if (absl::Now() >= until) {
      return absl::DeadlineExceededError(absl::StrCat("workspace not ready: ", last));
    }
    absl::SleepFor(absl::Milliseconds(25));
  }
}

bool IsCleanFaultCode(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kFailedPrecondition:
      return true;
    default:
      return false;
  }
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  double rank = p / 100.0 * double(v.size() - 1);
  size_t lo = static_cast<size_t>(std::floor(rank));
  size_t hi = std::min(v.size() - 1, lo + 1);
  return v[lo] + (v[hi] - v[lo]) * (rank - double(lo));
}

}  // namespace arfuse::reliability
