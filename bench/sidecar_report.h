// arfuse-bench sidecar: what the gathered rows say. The targets (docs/performance.md) each row is
// held to, and the report: the table on stdout and the same figures as JSON in --json.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "bench/sidecar_flags.h"
#include "bench/sidecar_rows.h"

namespace arfuse::bench::sidecar {

struct Check {
  std::string what;
  uint32_t tokens = 0, hidden = 0;
  double value = NAN;  // ratio or difference
  double target = NAN;
  std::string unit;  // "x" or "us"
  bool met = false;
};

// The targets the rows of every shape are held to, met or not; fills `vs_out` with the table's
// "vs" column of the rows they compare.
std::vector<Check> CheckTargets(const SidecarFlags& f, const std::vector<RowResult>& rows,
                                std::map<const RowResult*, std::string>* vs_out);

// Prints the table and the targets to stdout and writes --json, whose "ok" is rc == 0. Returns rc,
// or 1 when the JSON cannot be written.
int Report(const SidecarFlags& f, const Gathered& g, const std::vector<Check>& checks,
           const std::map<const RowResult*, std::string>& vs, int rc);

}  // namespace arfuse::bench::sidecar
