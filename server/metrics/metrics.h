// Prometheus metrics of one sidecar. Labels stay low-cardinality: plane, backend, path, reason
// class, result; never client names, regions or shapes.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/instream/op_counts.h"

namespace prometheus {
class Registry;
class Exposer;
class Gauge;
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

// Running op counts since the process started, as Admin.GetStats reports them. Fused: the
// one-shot and two-shot kernels; unfused: every other path that completed (the NCCL fallback, and
// the CPU implementation of host mode, which stands in for the unfused path), so ok = fused +
// unfused whenever no op is being recorded. bytes_reduced counts completed ops only, like
// arfuse_bytes_reduced_total.
struct OpTotals {
  uint64_t ok = 0;
  uint64_t failed = 0;
  uint64_t fused = 0;
  uint64_t unfused = 0;
  uint64_t bytes_reduced = 0;
};

class Metrics {
 public:
  // The labels of arfuse_build_info besides rank, device and world_size.
  struct BuildLabels {
    std::string version;      // "0.1.0" (the VERSION file)
    std::string revision;     // the git revision the binary was built from
    std::string api_version;  // "1.0": the arfuse.v1 API's MAJOR.MINOR
  };
  Metrics(int rank, int world_size, const std::string& device, const BuildLabels& build);
  ~Metrics();

  // Serves /metrics on host:port ("0.0.0.0" every IPv4 address, "127.0.0.1" loopback only, an
  // IPv6 address in brackets or not; port 0 picks a free port). UNAVAILABLE when the address
  // cannot be bound.
  absl::Status Serve(const std::string& host, int port);
  int port() const { return port_; }

  // Counts the op in the Prometheus families and in op_totals(). Thread-safe.
  void RecordOp(const OpSample& sample);
  // Every op RecordOp saw so far (whether or not /metrics is served). Thread-safe.
  OpTotals op_totals() const;
  void SetRegions(uint64_t count, uint64_t bytes);
  void SetWorkspaceBytes(uint64_t bytes);
  void SetBackend(const std::string& backend, bool fusion_enabled);
  void IncPoisonings();
  void IncReinitializations();
  void SetPeersReady(int ready);
  void SetMps(bool detected, double doorbell_hop_s);
  void SetReady(bool ready);
  // The workspace generation this rank serves (it grows with every re-formed group and backend
  // switch; an op stamped with an older one fails fast).
  void SetGeneration(uint64_t generation);
  // The in-stream plane: attachments now, and the kernels' launch counters as the sidecar last
  // read them (monotonic; counted up by the difference).
  void SetInStream(uint64_t attachments, uint64_t launches, uint64_t stale);
  // The in-stream clients' op decisions as the sidecar last summed their counter pages
  // (monotonic; counted up by the difference): arfuse_instream_ops_total.
  void SetInStreamOps(const InStreamOpCounts& counts);
  // The sidecars found `diverged_rank` declining in-stream ops its peers fused
  // (server/instream/divergence.h): arfuse_instream_divergence_total{diverged_rank}.
  void IncInStreamDivergence(uint32_t diverged_rank);

  // The text exposition of every family (what a scrape returns).
  std::string Render() const;

 private:
  struct Families;
  struct InStreamFamilies;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<Families> families_;
  std::unique_ptr<InStreamFamilies> instream_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;
  prometheus::Gauge* generation_ = nullptr;  // owned by registry_
  // Kept apart from the Prometheus families so GetStats reads them without parsing labels.
  std::atomic<uint64_t> ops_ok_{0};
  std::atomic<uint64_t> ops_failed_{0};
  std::atomic<uint64_t> ops_fused_{0};
  std::atomic<uint64_t> ops_unfused_{0};
  std::atomic<uint64_t> bytes_reduced_{0};
};

}  // namespace arfuse
