#include "bench/flashinfer/pair_runner.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

namespace arfuse::bench_fi {
namespace {

std::string Err(cudaError_t e) { return cudaGetErrorString(e); }

}  // namespace

PairRunner::PairRunner(double watchdog_s) : watchdog_s_(watchdog_s) {
  for (cudaStream_t* s : {&a_, &b_}) {
    if (status_ == cudaSuccess) status_ = cudaStreamCreateWithFlags(s, cudaStreamNonBlocking);
  }
  for (cudaEvent_t* e : {&fork_, &join_, &done_}) {
    if (status_ == cudaSuccess) status_ = cudaEventCreateWithFlags(e, cudaEventDisableTiming);
  }
  for (cudaEvent_t* e : {&start_, &stop_}) {
    if (status_ == cudaSuccess) status_ = cudaEventCreate(e);
  }
}

PairRunner::~PairRunner() {
  for (cudaEvent_t e : {fork_, join_, done_, start_, stop_}) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  for (cudaStream_t s : {a_, b_}) {
    if (s != nullptr) cudaStreamDestroy(s);
  }
}

cudaError_t PairRunner::Probe(const RankEnqueue& enqueue, int rank, GridShape* shape,
                              std::string* why) {
  // Relaxed: FlashInfer's launcher queries the device and its kernels (cudaFuncGetAttributes,
  // the cluster occupancy) while the stream is capturing.
  cudaError_t e = cudaStreamBeginCapture(a_, cudaStreamCaptureModeRelaxed);
  if (e != cudaSuccess) {
    *why = "begin capture: " + Err(e);
    return e;
  }
  const cudaError_t launched = enqueue(rank, a_);
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(a_, &graph);
  if (launched != cudaSuccess || ended != cudaSuccess) {
    if (graph != nullptr) cudaGraphDestroy(graph);
    (void)cudaGetLastError();
    if (why->empty()) why->assign("launch: " + Err(launched != cudaSuccess ? launched : ended));
    return launched != cudaSuccess ? launched : ended;
  }
  size_t count = 0;
  e = cudaGraphGetNodes(graph, nullptr, &count);
  cudaGraphNode_t node = nullptr;
  cudaGraphNodeType type = cudaGraphNodeTypeEmpty;
  if (e == cudaSuccess && count == 1) e = cudaGraphGetNodes(graph, &node, &count);
  if (e == cudaSuccess && count == 1) e = cudaGraphNodeGetType(node, &type);
  if (e != cudaSuccess || count != 1 || type != cudaGraphNodeTypeKernel) {
    cudaGraphDestroy(graph);
    *why = "the launch is not one kernel node";
    return e != cudaSuccess ? e : cudaErrorUnknown;
  }
  cudaKernelNodeParams kp = {};
  e = cudaGraphKernelNodeGetParams(node, &kp);
  cudaLaunchAttributeValue cluster = {};
  bool cluster_known = true;
  if (e == cudaSuccess && cudaGraphKernelNodeGetAttribute(node, cudaLaunchAttributeClusterDimension,
                                                          &cluster) != cudaSuccess) {
    // Taken as unclustered: the block count check below still holds for it.
    (void)cudaGetLastError();
    cluster = {};
    cluster_known = false;
  }
  cudaGraphDestroy(graph);
  if (e != cudaSuccess) {
    *why = "kernel node: " + Err(e);
    return e;
  }
  GridShape s;
  s.func = kp.func;
  s.grid = kp.gridDim.x * kp.gridDim.y * kp.gridDim.z;
  s.block = kp.blockDim.x * kp.blockDim.y * kp.blockDim.z;
  const unsigned c = cluster.clusterDim.x * cluster.clusterDim.y * cluster.clusterDim.z;
  s.cluster = c == 0 ? 1 : c;
  s.smem = kp.sharedMemBytes;
  s.cluster_known = cluster_known;
  if (s.cluster > 1) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = s.cluster;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.gridDim = dim3(s.grid);
    cfg.blockDim = dim3(s.block);
    cfg.dynamicSmemBytes = s.smem;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    e = cudaOccupancyMaxActiveClusters(&s.capacity, s.func, &cfg);
  } else {
    int device = 0, sms = 0, per_sm = 0;
    e = cudaGetDevice(&device);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (e == cudaSuccess) {
      e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, s.func, static_cast<int>(s.block),
                                                        s.smem);
    }
    s.capacity = per_sm * sms;
  }
  if (e != cudaSuccess) {
    *why = "occupancy: " + Err(e);
    return e;
  }
  *shape = s;
  return cudaSuccess;
}

bool PairRunner::CoResident(const GridShape& r0, const GridShape& r1, std::string* detail) {
  // Units a grid occupies: clusters when clustered (a cluster is placed whole, in one GPC).
  const long long u0 = r0.grid / r0.cluster, u1 = r1.grid / r1.cluster;
  const long long c0 = r0.capacity, c1 = r1.capacity;
  const char* unit = r0.cluster > 1 ? "clusters" : "blocks";
  char buf[256];
  std::snprintf(buf, sizeof(buf), "%u+%u blocks of %u threads (cluster %u%s), capacity %lld %s",
                r0.grid, r1.grid, r0.block, r0.cluster, r0.cluster_known ? "" : ", not readable",
                c0, unit);
  *detail = buf;
  if (c0 <= 0 || c1 <= 0) return false;
  return u0 * c1 + u1 * c0 <= c0 * c1;  // u0 / c0 + u1 / c1 <= 1
}

cudaError_t PairRunner::EnqueuePair(const RankEnqueue& enqueue) {
  cudaError_t e = cudaEventRecord(fork_, a_);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(b_, fork_, 0);
  if (e != cudaSuccess) return e;
  cudaError_t launched = enqueue(0, a_);
  // Rank 1 only when rank 0 launched: a lone rank 1 would spin on a peer that never comes.
  if (launched == cudaSuccess) launched = enqueue(1, b_);
  // B joins A again even after a failed launch, so that a capture ends consistently.
  e = cudaEventRecord(join_, b_);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(a_, join_, 0);
  return launched != cudaSuccess ? launched : e;
}

cudaError_t PairRunner::Wait(cudaEvent_t ev, const std::string& what) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(watchdog_s_));
  for (;;) {
    const cudaError_t e = cudaEventQuery(ev);
    if (e != cudaErrorNotReady) return e;
    if (std::chrono::steady_clock::now() > deadline) {
      std::fflush(stdout);
      std::fprintf(stderr,
                   "arfuse-bench-flashinfer: watchdog: %s did not finish within %.1f s (a grid "
                   "spinning on its peer's?); exiting\n",
                   what.c_str(), watchdog_s_);
      std::fflush(stderr);
      std::_Exit(3);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

cudaError_t PairRunner::RunOnce(const RankEnqueue& enqueue, const std::string& what) {
  cudaError_t e = EnqueuePair(enqueue);
  const cudaError_t rec = cudaEventRecord(done_, a_);
  if (e == cudaSuccess) e = rec;
  const cudaError_t waited = rec == cudaSuccess ? Wait(done_, what) : rec;
  return e != cudaSuccess ? e : waited;
}

cudaError_t PairRunner::Time(const RankEnqueue& enqueue, int iters, int warmup, int repeats,
                             const std::string& what, std::vector<double>* us_per_op) {
  us_per_op->clear();
  cudaError_t e = cudaStreamBeginCapture(a_, cudaStreamCaptureModeRelaxed);
  if (e != cudaSuccess) return e;
  cudaError_t captured = cudaSuccess;
  for (int i = 0; i < iters && captured == cudaSuccess; ++i) captured = EnqueuePair(enqueue);
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(a_, &graph);
  if (captured != cudaSuccess || ended != cudaSuccess) {
    if (graph != nullptr) cudaGraphDestroy(graph);
    (void)cudaGetLastError();
    return captured != cudaSuccess ? captured : ended;
  }
  cudaGraphExec_t exec = nullptr;
  e = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  if (e != cudaSuccess) return e;
  for (int r = 0; r < warmup + repeats && e == cudaSuccess; ++r) {
    e = cudaEventRecord(start_, a_);
    if (e == cudaSuccess) e = cudaGraphLaunch(exec, a_);
    if (e == cudaSuccess) e = cudaEventRecord(stop_, a_);
    if (e == cudaSuccess) e = Wait(stop_, what + " (graph replay)");
    float ms = 0.0f;
    if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, start_, stop_);
    if (e == cudaSuccess && r >= warmup) us_per_op->push_back(1000.0 * ms / iters);
  }
  cudaGraphExecDestroy(exec);
  return e;
}

}  // namespace arfuse::bench_fi
