// arfuse-bench sidecar, CUDA builds: a client process's GPU (its stream, the eager plane's
// interprocess events, the in-process rows' workspace and NCCL communicator), the ring library
// the doorbell rows load, and the graph rows' timing.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/sidecar_flags.h"
#include "server/cuda_device/fusion_workspace.h"
#include "server/cuda_device/nccl_comm.h"
#include "server/peers/exchange.h"
#if __has_include("client/ring/arfuse_ring.h")
#include "client/ring/arfuse_ring.h"
#define ARFUSE_BENCH_HAVE_RING_HEADER 1
#endif

namespace arfuse::bench::sidecar {

// libarfuse_ring.so, loaded at run time (as Python's ctypes binding does), so this binary builds
// and runs whether or not the ring library is there.
struct RingLib {
#if defined(ARFUSE_BENCH_HAVE_RING_HEADER)
  decltype(&arfuse_open_doorbell) open = nullptr;
  decltype(&arfuse_close_doorbell) close = nullptr;
  decltype(&arfuse_ring) ring = nullptr;
  decltype(&arfuse_doorbell_error) error = nullptr;
  decltype(&arfuse_doorbell_error_name) error_name = nullptr;
  decltype(&arfuse_doorbell_check_values) check_values = nullptr;
  decltype(&arfuse_ring_strerror) strerror = nullptr;
#endif
  void* handle = nullptr;
  std::string note;  // why it is not loaded
  bool loaded() const { return handle != nullptr; }

  // --ring_lib, else the build tree's, else the loader's search path.
  static RingLib Load(const std::string& flag);
};

struct Gpu {
  int device = 0;
  int devices = 0;
  bool shared = false;  // more ranks than GPUs: ranks share (MPS)
  int per_gpu = 1;
  int sms = 0;
  cudaStream_t stream = nullptr;
  // eager: the client's interprocess event (recorded after "producing" the input) and the
  // sidecar's done events, opened once each (the sidecar reuses a ring of them).
  cudaEvent_t wait_event = nullptr;
  std::string wait_handle;
  std::map<std::string, cudaEvent_t> done_events;
  // in-process rows
  std::unique_ptr<FusionWorkspace> ws;
  std::string ws_note;
  std::unique_ptr<NcclComm> nccl;
  std::string nccl_note;
  RingLib ring;

  ~Gpu();
  // This rank's GPU (rank % visible GPUs, as the sidecar picks it), its stream and wait event.
  absl::Status Init(int rank, int world);
  // The sidecar's done event of `handle`, opened once.
  absl::StatusOr<cudaEvent_t> DoneEvent(const std::string& handle);
};

// Replays a graph of f.graph_ops x enqueue() once as a warm-up and f.repeats times timed; every
// replay starts after a barrier of the client ranks. Returns us per op of each timed replay.
absl::StatusOr<std::vector<double>> TimeGraph(Exchange& ex, cudaStream_t s, const SidecarFlags& f,
                                              const std::function<absl::Status()>& enqueue,
                                              const std::string& tag);

}  // namespace arfuse::bench::sidecar
