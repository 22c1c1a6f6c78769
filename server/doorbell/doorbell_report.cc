#include "server/doorbell/doorbell_report.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace arfuse {

// docs/performance.md: the doorbell may add at most 3 µs per op over the in-process op.
constexpr double kHopTargetUs = 3.0;

bool DoorbellExpectedFast(const DoorbellHopReport& report, bool mps_active) {
  return report.measured && mps_active && report.hop_us <= kHopTargetUs;
}

std::string DescribeDoorbell(const DoorbellHopReport& report, bool mps_active) {
  std::string line;
  if (!report.measured) {
    line = absl::StrCat("doorbell self-test: not measured (",
                        report.error.empty() ? "not run" : report.error, ")");
  } else {
    line = absl::StrFormat(
        "doorbell self-test: %+.2f us/op over in-process (%.2f vs %.2f us/op, %d ops)",
        report.hop_us, report.doorbell_us_per_op, report.inprocess_us_per_op, report.ops);
    if (report.hop_us > kHopTargetUs) {
      absl::StrAppendFormat(&line, ", above the %.1f us target", kHopTargetUs);
    }
  }
  if (mps_active) {
    absl::StrAppend(&line, "; mps=active");
  } else {
    absl::StrAppend(&line,
                    "; mps=inactive: a client process's rings time-slice the GPU with the "
                    "sidecar (hundreds of us per op); run MPS (docs/doorbell.md)");
  }
  return line;
}

}  // namespace arfuse
