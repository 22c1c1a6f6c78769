// Prometheus metrics of one sidecar. Labels stay low-cardinality: plane, backend, path, reason
// class, result; never client names, regions or shapes.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace prometheus {
class Registry;
class Exposer;
}  // namespace prometheus

namespace arfuse {

struct OpSample {
  std::string plane;    // "eager" or "doorbell"
  std::string backend;  // "trtllm", "mnnvl", "none"
  std::string path;     // "oneshot", "twoshot", "unfused", "host"
  // Why this path ran, as a short class: "dispatch", "fusion_disabled", "forced", "error".
  std::string reason;
  bool ok = true;
  double latency_s = 0;
  uint64_t bytes = 0;
};

class Metrics {
 public:
  Metrics(int rank, int world_size, const std::string& device, const std::string& version);
  ~Metrics();

  // Serves /metrics on 0.0.0.0:port (0 picks a free port). UNAVAILABLE when the port is taken.
  absl::Status Serve(int port);
  int port() const { return port_; }

  void RecordOp(const OpSample& sample);
  void SetRegions(uint64_t count, uint64_t bytes);
  void SetWorkspaceBytes(uint64_t bytes);
  void SetBackend(const std::string& backend, bool fusion_enabled);
  void IncPoisonings();
  void IncReinitializations();
  void SetPeersReady(int ready);
  void SetMps(bool detected, double doorbell_hop_s);
  void SetReady(bool ready);

  // The text exposition of every family (what a scrape returns).
  std::string Render() const;

 private:
  struct Families;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<Families> families_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;
};

}  // namespace arfuse
