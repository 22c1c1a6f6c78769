// What the Fusion service tests share: the service on a real gRPC server on a Unix socket (host
// shared memory behind it, whatever device it reports), clients connected to it, and one shm
// region laid out for the fused op.
#pragma once

#include <grpcpp/grpcpp.h>
#include <stdlib.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/cpp/client.h"
#include "gtest/gtest.h"
#include "server/registry/host_shm_opener.h"
#include "server/services/fusion/fusion_service.h"

namespace arfuse::testing {

inline constexpr uint32_t kHidden = 64;
inline constexpr uint32_t kTokens = 4;
inline constexpr uint64_t kTensorBytes = uint64_t{kTokens} * kHidden * sizeof(float);

// One shm buffer holding input | residual | norm_out | gamma (fp32).
struct NormBuffers {
  client::HostShmBuffer buf;
  client::Region region;
  float* at(uint64_t offset) {
    return reinterpret_cast<float*>(static_cast<char*>(buf.data()) + offset);
  }
  float* input() { return at(0); }
  float* residual() { return at(kTensorBytes); }
  float* norm() { return at(2 * kTensorBytes); }
  float* gamma() { return at(3 * kTensorBytes); }
  client::OpDesc Op(uint32_t max_tokens = kTokens) {
    client::OpDesc op;
    op.pattern = Pattern::kAllReduceResidualRmsNorm;
    op.dtype = DType::kFP32;
    op.hidden = kHidden;
    op.max_tokens = max_tokens;
    op.eps = 1e-5f;
    op.input = client::TensorLoc{region, 0};
    op.residual_in = client::TensorLoc{region, kTensorBytes};
    op.residual_out = op.residual_in;
    op.norm_out = client::TensorLoc{region, 2 * kTensorBytes};
    op.gamma = client::TensorLoc{region, 3 * kTensorBytes};
    return op;
  }
};

// Fresh NormBuffers (zeroed) registered with `c` as region `name`.
inline NormBuffers RegisterNormBuffers(client::Client& c, const std::string& name = "buf") {
  NormBuffers b{*client::HostShmBuffer::CreateNamed(3 * kTensorBytes + kHidden * sizeof(float)),
                {}};
  auto r = c.RegisterHostShm(name, b.buf.shm_name(), b.buf.size());
  EXPECT_TRUE(r.ok()) << r.status();
  if (r.ok()) b.region = *r;
  return b;
}

// Polls `cond` until it holds or `timeout` passes.
inline bool WaitFor(const std::function<bool()>& cond, absl::Duration timeout) {
  absl::Time until = absl::Now() + timeout;
  while (absl::Now() < until) {
    if (cond()) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return cond();
}

// A FusionService on a gRPC server listening on a Unix socket in a fresh temporary directory.
class FusionTestServer {
 public:
  FusionTestServer() = default;
  FusionTestServer(const FusionTestServer&) = delete;
  FusionTestServer& operator=(const FusionTestServer&) = delete;
  ~FusionTestServer() { Stop(); }

  // Serves a FusionService made with `options`, `engine`, the host shm opener and `events` (none
  // by default, as in host mode); the socket's directory is made from `dir_template` (mkdtemp: it
  // ends in XXXXXX).
  void Start(std::string dir_template, const FusionServiceOptions& options,
             FusionService::EngineGetter engine, std::unique_ptr<EventIpc> events = nullptr) {
    ASSERT_NE(mkdtemp(dir_template.data()), nullptr);
    dir_ = dir_template;
    socket_ = dir_ + "/fusion.sock";
    // Every client of this server is this process (gRPC's own listener: no peer credentials).
    FusionServiceOptions with_callers = options;
    if (with_callers.callers == nullptr) with_callers.callers = &own_process_;
    service_ = std::make_unique<FusionService>(
        with_callers, std::move(engine), std::make_unique<HostShmOpener>(), std::move(events));
    grpc::ServerBuilder builder;
    builder.AddListeningPort("unix:" + socket_, grpc::InsecureServerCredentials());
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
  }

  // Ends the service's calls (FusionService::Shutdown first, so open Session streams do not hold
  // the server's shutdown for its whole deadline), then the server, then removes the directory.
  // Idempotent.
  void Stop() {
    if (server_) {
      service_->Shutdown();
      server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(10));
      server_.reset();
    }
    service_.reset();
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
    dir_.clear();
  }

  bool running() const { return server_ != nullptr; }
  const std::string& socket() const { return socket_; }
  FusionService* service() const { return service_.get(); }

  // A client with its Session open; null (and a test failure) when it could not connect.
  std::unique_ptr<client::Client> Connect(const std::string& name) const {
    client::ClientOptions o;
    o.target = socket_;
    o.client_name = name;
    o.default_timeout = absl::Seconds(30);
    auto c = client::Client::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

 private:
  std::string dir_, socket_;
  OwnProcessCredentials own_process_;
  std::unique_ptr<FusionService> service_;
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace arfuse::testing
