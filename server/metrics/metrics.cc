#include "server/metrics/metrics.h"

#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <mutex>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"

namespace arfuse {

struct Metrics::Families {
  prometheus::Family<prometheus::Counter>& ops;
  prometheus::Family<prometheus::Histogram>& latency;
  prometheus::Family<prometheus::Counter>& bytes;
  prometheus::Gauge& regions;
  prometheus::Gauge& region_bytes;
  prometheus::Gauge& workspace_bytes;
  prometheus::Family<prometheus::Gauge>& backend;
  prometheus::Counter& poisonings;
  prometheus::Counter& reinits;
  prometheus::Gauge& peers_ready;
  prometheus::Gauge& mps;
  prometheus::Gauge& doorbell_hop;
  prometheus::Gauge& ready;
  std::mutex backend_mu;
  prometheus::Gauge* backend_gauge = nullptr;
  // The series one op updates, per label set. Family::Add builds and hashes the label map and
  // takes the family's lock on every call; an eager op records itself before its reply, so the
  // series are looked up once per label set and kept (they live as long as the registry).
  struct OpSeries {
    prometheus::Counter* ops = nullptr;
    prometheus::Histogram* latency = nullptr;
    prometheus::Counter* bytes = nullptr;  // null for failed ops: they reduce nothing
  };
  std::mutex series_mu;
  absl::flat_hash_map<std::string, OpSeries> series;
};

struct Metrics::InStreamFamilies {
  prometheus::Gauge& attachments;
  prometheus::Counter& launches;
  prometheus::Counter& stale;
  prometheus::Family<prometheus::Counter>& ops;
  prometheus::Family<prometheus::Counter>& divergence;
  std::mutex mu{};
  uint64_t launches_seen = 0;
  uint64_t stale_seen = 0;
  // arfuse_instream_ops_total's series, made at start so that every one is exported from the
  // first scrape (a dashboard's rate() needs the zero), and the counts they last took.
  prometheus::Counter* fused[instream::kOpPatterns][instream::kOpTokenBuckets] = {};
  prometheus::Counter* declined[instream::kDeclineReasons] = {};
  InStreamOpCounts ops_seen{};
};

namespace {

// Latency buckets from 2 µs (a doorbell op) to 1 s (a stuck peer hitting its deadline).
prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  return {2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3, 2e-2, 1e-1, 1.0};
}

}  // namespace

Metrics::Metrics(int rank, int world_size, const std::string& device, const BuildLabels& build)
    : registry_(std::make_shared<prometheus::Registry>()) {
  auto& r = *registry_;
  const std::map<std::string, std::string> constant = {{"rank", std::to_string(rank)}};
  families_.reset(new Families{
      prometheus::BuildCounter()
          .Name("arfuse_ops_total")
          .Help("Ops by data plane, backend, path, reason class and result")
          .Labels(constant)
          .Register(r),
      prometheus::BuildHistogram()
          .Name("arfuse_op_latency_seconds")
          .Help("Op latency seen by the sidecar, from request to enqueue or completion")
          .Labels(constant)
          .Register(r),
      prometheus::BuildCounter()
          .Name("arfuse_bytes_reduced_total")
          .Help("Input bytes reduced (this rank's contribution)")
          .Labels(constant)
          .Register(r),
      prometheus::BuildGauge()
          .Name("arfuse_regions")
          .Help("Registered regions")
          .Labels(constant)
          .Register(r)
          .Add({}),
      prometheus::BuildGauge()
          .Name("arfuse_region_bytes")
          .Help("Bytes of registered regions")
          .Labels(constant)
          .Register(r)
          .Add({}),
      prometheus::BuildGauge()
          .Name("arfuse_workspace_bytes")
          .Help("Workspace bytes allocated on this rank")
          .Labels(constant)
          .Register(r)
          .Add({}),
      prometheus::BuildGauge()
          .Name("arfuse_backend_info")
          .Help("The group's backend (1 for the current one)")
          .Labels(constant)
          .Register(r),
      prometheus::BuildCounter()
          .Name("arfuse_poisonings_total")
          .Help("Workspaces poisoned by a timed-out or aborted wait")
          .Labels(constant)
          .Register(r)
          .Add({}),
      prometheus::BuildCounter()
          .Name("arfuse_reinitializations_total")
          .Help("Collective workspace re-initializations")
          .Labels(constant)
          .Register(r)
          .Add({}),
      prometheus::BuildGauge()
          .Name("arfuse_peers_ready")
          .Help("Ranks of the group that have joined, this one included (0 while the group forms)")
          .Labels(constant)
          .Register(r)
          .Add({}),
      prometheus::BuildGauge()
          .Name("arfuse_mps_detected")
          .Help("1 when CUDA MPS serves this GPU")
          .Labels(constant)
          .Register(r)
          .Add({}),
      prometheus::BuildGauge()
          .Name("arfuse_doorbell_hop_seconds")
          .Help("Doorbell hop measured by the self-test")
          .Labels(constant)
          .Register(r)
          .Add({}),
      prometheus::BuildGauge()
          .Name("arfuse_ready")
          .Help("1 when readiness is SERVING")
          .Labels(constant)
          .Register(r)
          .Add({}),
      /*backend_mu=*/{},
      /*backend_gauge=*/nullptr,
      /*series_mu=*/{},
      /*series=*/{},
  });
  instream_.reset(new InStreamFamilies{
      prometheus::BuildGauge()
          .Name("arfuse_instream_attachments")
          .Help("Clients attached to the workspace through the in-stream plane")
          .Labels(constant)
          .Register(r)
          .Add({}),
      prometheus::BuildCounter()
          .Name("arfuse_instream_launches_total")
          .Help("In-stream kernel launches on the workspace (counted by the kernels)")
          .Labels(constant)
          .Register(r)
          .Add({}),
      prometheus::BuildCounter()
          .Name("arfuse_instream_stale_launches_total")
          .Help("In-stream launches refused for a stale workspace generation or launch ABI")
          .Labels(constant)
          .Register(r)
          .Add({}),
      prometheus::BuildCounter()
          .Name("arfuse_instream_ops_total")
          .Help("In-stream ops: fused (by pattern and token bucket; on CUDA every launch the "
                "kernels counted, graph replays included) or declined by the client library, the "
                "framework running its own path (by reason)")
          .Labels(constant)
          .Register(r),
      prometheus::BuildCounter()
          .Name("arfuse_instream_divergence_total")
          .Help("Times the group's sidecars found a rank declining in-stream ops its peers fused "
                "(a hang), by the rank that declined")
          .Labels(constant)
          .Register(r),
  });
  // Every rank's series from the first scrape, so that a dashboard's increase() sees the zero.
  for (int q = 0; q < world_size; ++q) {
    instream_->divergence.Add({{"diverged_rank", std::to_string(q)}});
  }
  for (uint32_t p = 0; p < instream::kOpPatterns; ++p) {
    for (uint32_t b = 0; b < instream::kOpTokenBuckets; ++b) {
      instream_->fused[p][b] =
          &instream_->ops.Add({{"path", "fused"},
                               {"reason", "none"},
                               {"pattern", p == 0 ? "allreduce" : "allreduce_residual_rmsnorm"},
                               {"tokens", instream::kOpTokenBucketNames[b]}});
    }
  }
  for (uint32_t q = 0; q < instream::kDeclineReasons; ++q) {
    instream_->declined[q] =
        &instream_->ops.Add({{"path", "declined"}, {"reason", instream::kDeclineReasonNames[q]}});
  }
  prometheus::BuildGauge()
      .Name("arfuse_build_info")
      .Help("Build and group information")
      .Labels(constant)
      .Register(r)
      .Add({{"version", build.version},
            {"revision", build.revision},
            {"api_version", build.api_version},
            {"device", device},
            {"world_size", std::to_string(world_size)}})
      .Set(1);
  // The group's size as a number, so that an alert compares arfuse_peers_ready with it
  // (`arfuse_peers_ready < arfuse_world_size`) whatever the tensor-parallel size.
  prometheus::BuildGauge()
      .Name("arfuse_world_size")
      .Help("Ranks in this sidecar's group (--world-size)")
      .Labels(constant)
      .Register(r)
      .Add({})
      .Set(world_size);
  generation_ = &prometheus::BuildGauge()
                     .Name("arfuse_workspace_generation")
                     .Help("Workspace generation this rank serves (0 before the first)")
                     .Labels(constant)
                     .Register(r)
                     .Add({});
}

Metrics::~Metrics() = default;

absl::Status Metrics::Serve(const std::string& host, int port) {
  // civetweb's listening_ports: "a.b.c.d:port" or "[v6]:port".
  const bool v6 = host.find(':') != std::string::npos && host.front() != '[';
  const std::string address = absl::StrCat(v6 ? "[" : "", host, v6 ? "]" : "", ":", port);
  try {
    exposer_ = std::make_unique<prometheus::Exposer>(address);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, ": ", e.what()));
  }
  exposer_->RegisterCollectable(registry_);
  auto ports = exposer_->GetListeningPorts();
  port_ = ports.empty() ? 0 : ports.front();
  return absl::OkStatus();
}

void Metrics::RecordOp(const OpSample& s) {
  // The label values never hold '|' (fixed names), so the joined key is unambiguous.
  const std::string key =
      absl::StrCat(s.plane, "|", s.backend, "|", s.path, "|", s.reason, "|", s.ok ? "ok" : "error");
  Families::OpSeries series;
  {
    std::lock_guard<std::mutex> lock(families_->series_mu);
    auto [it, added] = families_->series.try_emplace(key);
    if (added) {
      it->second.ops = &families_->ops.Add({{"plane", s.plane},
                                            {"backend", s.backend},
                                            {"path", s.path},
                                            {"reason", s.reason},
                                            {"result", s.ok ? "ok" : "error"}});
      it->second.latency =
          &families_->latency.Add({{"plane", s.plane}, {"path", s.path}}, LatencyBuckets());
      if (s.ok) it->second.bytes = &families_->bytes.Add({{"path", s.path}});
    }
    series = it->second;
  }
  series.ops->Increment();
  series.latency->Observe(s.latency_s);
  if (series.bytes != nullptr) series.bytes->Increment(static_cast<double>(s.bytes));
  // Relaxed: each counter is a tally on its own; no reader infers anything from their order.
  if (!s.ok) {
    ops_failed_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  ops_ok_.fetch_add(1, std::memory_order_relaxed);
  bytes_reduced_.fetch_add(s.bytes, std::memory_order_relaxed);
  const bool fused = s.path == "oneshot" || s.path == "twoshot";
  (fused ? ops_fused_ : ops_unfused_).fetch_add(1, std::memory_order_relaxed);
}

OpTotals Metrics::op_totals() const {
  OpTotals t;
  t.ok = ops_ok_.load(std::memory_order_relaxed);
  t.failed = ops_failed_.load(std::memory_order_relaxed);
  t.fused = ops_fused_.load(std::memory_order_relaxed);
  t.unfused = ops_unfused_.load(std::memory_order_relaxed);
  t.bytes_reduced = bytes_reduced_.load(std::memory_order_relaxed);
  return t;
}

void Metrics::SetRegions(uint64_t count, uint64_t bytes) {
  families_->regions.Set(static_cast<double>(count));
  families_->region_bytes.Set(static_cast<double>(bytes));
}

void Metrics::SetWorkspaceBytes(uint64_t bytes) {
  families_->workspace_bytes.Set(static_cast<double>(bytes));
}

void Metrics::SetBackend(const std::string& backend, bool fusion_enabled) {
  std::lock_guard<std::mutex> lock(families_->backend_mu);
  if (families_->backend_gauge != nullptr) families_->backend_gauge->Set(0);
  families_->backend_gauge = &families_->backend.Add(
      {{"backend", backend}, {"fusion_enabled", fusion_enabled ? "true" : "false"}});
  families_->backend_gauge->Set(1);
}

void Metrics::IncPoisonings() { families_->poisonings.Increment(); }
void Metrics::IncReinitializations() { families_->reinits.Increment(); }
void Metrics::SetPeersReady(int ready) { families_->peers_ready.Set(ready); }
void Metrics::SetMps(bool detected, double hop_s) {
  families_->mps.Set(detected ? 1 : 0);
  families_->doorbell_hop.Set(hop_s);
}
void Metrics::SetReady(bool ready) { families_->ready.Set(ready ? 1 : 0); }
void Metrics::SetGeneration(uint64_t generation) {
  generation_->Set(static_cast<double>(generation));
}

void Metrics::SetInStream(uint64_t attachments, uint64_t launches, uint64_t stale) {
  instream_->attachments.Set(static_cast<double>(attachments));
  std::lock_guard<std::mutex> lock(instream_->mu);
  if (launches > instream_->launches_seen) {
    instream_->launches.Increment(static_cast<double>(launches - instream_->launches_seen));
    instream_->launches_seen = launches;
  }
  if (stale > instream_->stale_seen) {
    instream_->stale.Increment(static_cast<double>(stale - instream_->stale_seen));
    instream_->stale_seen = stale;
  }
}

void Metrics::SetInStreamOps(const InStreamOpCounts& counts) {
  std::lock_guard<std::mutex> lock(instream_->mu);
  auto add = [](prometheus::Counter* c, uint64_t now, uint64_t& seen) {
    if (now > seen) {
      c->Increment(static_cast<double>(now - seen));
      seen = now;
    }
  };
  InStreamOpCounts& seen = instream_->ops_seen;
  for (uint32_t p = 0; p < instream::kOpPatterns; ++p) {
    for (uint32_t b = 0; b < instream::kOpTokenBuckets; ++b) {
      add(instream_->fused[p][b], counts.fused[p][b], seen.fused[p][b]);
    }
  }
  for (uint32_t q = 0; q < instream::kDeclineReasons; ++q) {
    add(instream_->declined[q], counts.declined[q], seen.declined[q]);
  }
}

void Metrics::IncInStreamDivergence(uint32_t diverged_rank) {
  instream_->divergence.Add({{"diverged_rank", std::to_string(diverged_rank)}}).Increment();
}

std::string Metrics::Render() const {
  prometheus::TextSerializer serializer;
  return serializer.Serialize(registry_->Collect());
}

}  // namespace arfuse
