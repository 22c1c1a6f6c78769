// The doorbell self-test's result and how the daemon words it (negotiation, `arfusectl info`,
// logs). CUDA-free, so the config service and the CLI can carry it without the toolkit.
#pragma once

#include <string>

namespace arfuse {

struct DoorbellHopReport {
  bool measured = false;
  int ops = 0;
  // A client graph of `ops` rings served by the sidecar's queued kernels (waiter, an empty fused
  // launch, completion), per op.
  double doorbell_us_per_op = 0;
  // The same fused launch replayed `ops` times from a graph in-process, per op.
  double inprocess_us_per_op = 0;
  // What the doorbell adds per op: doorbell_us_per_op - inprocess_us_per_op.
  double hop_us = 0;
  // Why it was not measured (no GPU, a CUDA error); empty when measured.
  std::string error;
};

// The self-test runs both sides in this process, where they always run concurrently. A real
// client is another process: without MPS its kernels and the sidecar's time-slice the GPU and
// every ring costs hundreds of microseconds (docs/mps.md). So the verdict needs both.
bool DoorbellExpectedFast(const DoorbellHopReport& report, bool mps_active);

// One line: "doorbell self-test: +2.41 us/op over in-process (4.12 vs 1.71 us/op, 200 ops);
// mps=active" or with the reason it is not fast.
std::string DescribeDoorbell(const DoorbellHopReport& report, bool mps_active);

}  // namespace arfuse
