// grpc.health.v1 for both of arfused's servers, from one shared state. gRPC's built-in default
// health service keeps one state per server (two copies that could drift apart), cannot be read
// back (the supervisor reads readiness) and is switched on for every server of the process; so
// both servers register a HealthService over one HealthState (docs/architecture.md, "Health").
// Entries: "" (liveness: the process answers) and "arfuse.v1.Fusion" (readiness).
#pragma once

#include <map>
#include <mutex>
#include <set>
#include <string>

#include "grpc/health/v1/health.grpc.pb.h"

namespace arfuse {

class HealthWatcher;

class HealthState {
 public:
  using Status = grpc::health::v1::HealthCheckResponse::ServingStatus;

  void Set(const std::string& service, bool serving);
  // After Shutdown every entry reads NOT_SERVING and Set is ignored (the process is going away).
  void Shutdown();
  // SERVICE_UNKNOWN when the entry was never set.
  Status Get(const std::string& service) const;

 private:
  friend class HealthWatcher;
  void AddWatcher(HealthWatcher* watcher);
  void RemoveWatcher(HealthWatcher* watcher);
  void NotifyLocked(const std::string& service);

  mutable std::mutex mu_;
  std::map<std::string, Status> status_;
  std::set<HealthWatcher*> watchers_;
  bool shutdown_ = false;
};

class HealthService final : public grpc::health::v1::Health::CallbackService {
 public:
  explicit HealthService(HealthState* state) : state_(state) {}

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* context,
                                  const grpc::health::v1::HealthCheckRequest* request,
                                  grpc::health::v1::HealthCheckResponse* response) override;
  grpc::ServerWriteReactor<grpc::health::v1::HealthCheckResponse>* Watch(
      grpc::CallbackServerContext* context,
      const grpc::health::v1::HealthCheckRequest* request) override;

 private:
  HealthState* state_;
};

}  // namespace arfuse
