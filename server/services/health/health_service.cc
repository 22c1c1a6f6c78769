#include "server/services/health/health_service.h"

#include <deque>

namespace arfuse {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// One Watch stream: sends the current status, then every change, until the client cancels or
// the server shuts down. Writes are serialized: at most one in flight, changes queue behind it.
class HealthWatcher final : public grpc::ServerWriteReactor<HealthCheckResponse> {
 public:
  HealthWatcher(HealthState* state, std::string service)
      : state_(state), service_(std::move(service)) {
    state_->AddWatcher(this);
    Push(state_->Get(service_));
  }

  // Called with HealthState::mu_ held.
  void OnChangeLocked(const std::string& service, HealthState::Status status) {
    if (service == service_) Push(status);
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (!ok) {
      FinishLocked();
      return;
    }
    WriteNextLocked();
  }

  void OnCancel() override {
    std::lock_guard<std::mutex> lock(mu_);
    FinishLocked();
  }

  void OnDone() override {
    state_->RemoveWatcher(this);
    delete this;
  }

 private:
  void Push(HealthState::Status status) {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_) return;
    pending_.push_back(status);
    WriteNextLocked();
  }

  void WriteNextLocked() {
    if (writing_ || finished_ || pending_.empty()) return;
    response_.set_status(pending_.front());
    pending_.pop_front();
    writing_ = true;
    StartWrite(&response_);
  }

  void FinishLocked() {
    if (finished_) return;
    finished_ = true;
    Finish(grpc::Status::CANCELLED);
  }

  HealthState* state_;
  std::string service_;
  std::mutex mu_;
  std::deque<HealthState::Status> pending_;
  HealthCheckResponse response_;
  bool writing_ = false;
  bool finished_ = false;
};

void HealthState::Set(const std::string& service, bool serving) {
  std::lock_guard<std::mutex> lock(mu_);
  if (shutdown_) return;
  status_[service] = serving ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING;
  NotifyLocked(service);
}

void HealthState::Shutdown() {
  std::lock_guard<std::mutex> lock(mu_);
  shutdown_ = true;
  for (auto& [service, status] : status_) {
    status = HealthCheckResponse::NOT_SERVING;
    NotifyLocked(service);
  }
}

HealthState::Status HealthState::Get(const std::string& service) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = status_.find(service);
  return it == status_.end() ? HealthCheckResponse::SERVICE_UNKNOWN : it->second;
}

void HealthState::AddWatcher(HealthWatcher* watcher) {
  std::lock_guard<std::mutex> lock(mu_);
  watchers_.insert(watcher);
}

void HealthState::RemoveWatcher(HealthWatcher* watcher) {
  std::lock_guard<std::mutex> lock(mu_);
  watchers_.erase(watcher);
}

void HealthState::NotifyLocked(const std::string& service) {
  for (HealthWatcher* w : watchers_) w->OnChangeLocked(service, status_[service]);
}

grpc::ServerUnaryReactor* HealthService::Check(grpc::CallbackServerContext* context,
                                               const HealthCheckRequest* request,
                                               HealthCheckResponse* response) {
  auto* reactor = context->DefaultReactor();
  HealthState::Status status = state_->Get(request->service());
  if (status == HealthCheckResponse::SERVICE_UNKNOWN) {
    // grpc.health.v1: Check on an unknown entry is NOT_FOUND (SERVICE_UNKNOWN is Watch-only).
    reactor->Finish(grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown health entry"));
    return reactor;
  }
  response->set_status(status);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerWriteReactor<HealthCheckResponse>* HealthService::Watch(
    grpc::CallbackServerContext* /*context*/, const HealthCheckRequest* request) {
  return new HealthWatcher(state_, request->service());
}

}  // namespace arfuse
