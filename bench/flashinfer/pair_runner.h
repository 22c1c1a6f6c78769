// Runs one op of both ranks at once on one GPU: rank 0's kernel on stream A, rank 1's on stream
// B forked from A by an event and joined back, so the two grids, which spin on each other, run
// concurrently. Before a shape runs, each rank's launch is captured (not run) to read its grid,
// and the two grids must fit the GPU together: a grid waiting on a peer that cannot become
// resident would spin forever. Every wait has a watchdog that ends the process.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <string>
#include <vector>

namespace arfuse::bench_fi {

// Enqueues rank `rank`'s kernel of the op on `stream` (one kernel launch).
using RankEnqueue = std::function<cudaError_t(int rank, cudaStream_t stream)>;

// One rank's launch as the framework's launcher chose it.
struct GridShape {
  const void* func = nullptr;
  unsigned grid = 0;
  unsigned block = 0;
  unsigned cluster = 1;       // blocks per thread-block cluster
  bool cluster_known = true;  // false: the node's cluster attribute could not be read
  size_t smem = 0;            // dynamic shared memory
  // Resident at once on the whole device: blocks (cluster 1) or clusters.
  int capacity = 0;
};

class PairRunner {
 public:
  // `watchdog_s`: how long one pair or one graph replay may take before the process exits.
  explicit PairRunner(double watchdog_s);
  ~PairRunner();
  PairRunner(const PairRunner&) = delete;
  PairRunner& operator=(const PairRunner&) = delete;
  cudaError_t status() const { return status_; }
  cudaStream_t stream_a() const { return a_; }

  // Captures `enqueue(rank)` into a throwaway graph (nothing runs) and reads its one kernel
  // node's launch and the device's capacity for it. `why`: what went wrong.
  cudaError_t Probe(const RankEnqueue& enqueue, int rank, GridShape* shape, std::string* why);

  // Whether both ranks' grids can be resident together: sum over ranks of grid / capacity
  // (in clusters when clustered) at most 1. `detail` describes the grids and the capacity.
  static bool CoResident(const GridShape& r0, const GridShape& r1, std::string* detail);

  // One pair, waited for (watchdog).
  cudaError_t RunOnce(const RankEnqueue& enqueue, const std::string& what);

  // `iters` pairs captured in one CUDA graph, replayed `warmup` times untimed and `repeats`
  // times timed (each waited for with the watchdog): us per op of each timed replay.
  cudaError_t Time(const RankEnqueue& enqueue, int iters, int warmup, int repeats,
                   const std::string& what, std::vector<double>* us_per_op);

 private:
  cudaError_t EnqueuePair(const RankEnqueue& enqueue);
  // Waits for `ev`; past the watchdog, prints what hung and ends the process.
  cudaError_t Wait(cudaEvent_t ev, const std::string& what);

  double watchdog_s_;
  cudaError_t status_ = cudaSuccess;
  cudaStream_t a_ = nullptr, b_ = nullptr;
  cudaEvent_t fork_ = nullptr, join_ = nullptr, done_ = nullptr;  // ordering only
  cudaEvent_t start_ = nullptr, stop_ = nullptr;                  // timing
};

}  // namespace arfuse::bench_fi
