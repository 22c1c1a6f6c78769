// arfusectl top: one line per rank, refreshed, from what each sidecar exposes without a call per
// op: Fusion.GetWorkspaceInfo (backend, generation, state), Admin.GetStats (poisonings, the ops
// the sidecar ran itself) and, where given, its Prometheus endpoint (the planes that carry ops,
// in-stream fused and declined ops, op latency). Rates come from two samples one interval apart.
#pragma once

#include <chrono>
#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace arfuse::cli {

// One series of a text exposition: name, labels, value.
struct MetricSample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

// Parses the Prometheus text exposition format (version 0.0.4): comment lines are skipped, label
// values unescaped (\\, \", \n). INVALID_ARGUMENT naming the line for a malformed one.
absl::StatusOr<std::vector<MetricSample>> ParseExposition(const std::string& text);

// The q-quantile (0 < q < 1) of a histogram given as cumulative bucket counts by upper bound
// (+Inf included), interpolated linearly within the bucket as Prometheus' histogram_quantile()
// does; nullopt when the histogram holds no observation.
std::optional<double> HistogramQuantile(double q, const std::map<double, double>& cumulative);

// GET http://host:port/metrics with a deadline; the body. UNAVAILABLE when nothing answers,
// DEADLINE_EXCEEDED when the answer is late, INTERNAL for a non-200 reply.
absl::StatusOr<std::string> ScrapeMetrics(const std::string& host_port,
                                          std::chrono::milliseconds timeout);

struct TopOptions {
  std::vector<std::string> addrs;    // gRPC targets, one per rank
  std::vector<std::string> metrics;  // host:port per address, or empty: no metrics endpoint
  int interval_ms = 1000;
  int iterations = 0;  // 0: until interrupted
  int timeout_ms = 2000;
  bool json = false;
  bool screen = false;  // redraw one screen per refresh (a terminal); else lines
};

// Samples every rank, waits one interval, samples again and prints each rank's line; repeats
// `iterations` times (forever with 0). A rank that does not answer gets a line saying so and is
// asked again at the next refresh. Exit status: 0 when every rank answered at the last refresh,
// else kExitUnreachable.
int RunTop(const TopOptions& options, std::ostream& out, std::ostream& err);

}  // namespace arfuse::cli
