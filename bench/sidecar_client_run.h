// arfuse-bench sidecar: what a client process measures, shape by shape. ClientMain
// (sidecar_client.cc) sets up the process and hands a ClientRun its connections; the eager and
// host rows are in sidecar_client_rows.cc, the CUDA rows (in-process, doorbell, in-stream, the
// layer loop) in sidecar_gpu_rows.cc, so that a row's code sits with the rows it is compared with.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/sidecar_flags.h"
#include "bench/sidecar_memory.h"
#include "bench/sidecar_rows.h"
#include "client/cpp/client.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "server/engine_api/engine.h"
#include "server/peers/peer_exchange.h"

#if defined(ARFUSE_BENCH_CUDA)
#include "bench/sidecar_gpu.h"
#endif

namespace arfuse::bench::sidecar {

struct ClientRun {
  ClientRun(const SidecarFlags& f, int rank, bool cuda, client::Client& c, PeerExchange& ex,
            grpc::health::v1::Health::Stub& health, std::vector<RowResult>& out)
      : f(f), rank(rank), cuda(cuda), c(c), ex(ex), health(health), out(out) {}

  const SidecarFlags& f;
  int rank;
  bool cuda;
  client::Client& c;
  PeerExchange& ex;
  grpc::health::v1::Health::Stub& health;
  std::vector<RowResult>& out;
  // Host mode: the host engine run by the client processes themselves (the in-process op).
  Engine* host_engine = nullptr;
  std::string host_engine_note;
#if defined(ARFUSE_BENCH_CUDA)
  Gpu* gpu = nullptr;
#endif

  // Every row of one shape, in table order.
  absl::Status Shape(uint32_t tokens, uint32_t hidden);

  // Keeps a finished row; rank 0 also prints it to stderr, one progress line per row (its own
  // figures: the table takes the slowest rank's).
  void Record(const RowResult& r);
  absl::Status Echo();
  // An Execute the sidecar refuses after the session and plan lookup (one token more than the
  // plan's maximum): the gRPC round trip plus the service's front, no engine. Same request shape
  // as an eager op's.
  absl::Status Refused(const client::Plan& plan, uint32_t max_tokens);
  // One eager op as a client would issue it. Returns the reply's path. `rpc_us` (optional) gets
  // the time of the Execute call alone, `cuda_us` that of the client's event record and wait.
  // `events` false: no wait_event, and the client's stream does not wait on done_event (the
  // inputs do not change between calls, so only the timing differs).
  absl::StatusOr<v1::ExecPath> Eager(const client::Plan& plan, uint32_t tokens, bool sync,
                                     double* rpc_us = nullptr, double* cuda_us = nullptr,
                                     bool events = true);
  // Echo and Execute in alternating blocks; adds the echo (asynchronous pass only) and eager rows.
  absl::Status EagerRows(const client::Plan& plan, uint32_t tokens, uint32_t hidden, bool sync,
                         const std::string& tag);
  // Host mode: the same op on the host engine, run by this process (no RPC, no sidecar).
  absl::Status HostInprocRow(const client::OpDesc& desc, uint32_t tokens, uint32_t hidden,
                             const Layout& L, const std::string& tag);

#if defined(ARFUSE_BENCH_CUDA)
  void AddGraphRow(const std::string& row, uint32_t tokens, uint32_t hidden,
                   const absl::StatusOr<std::vector<double>>& per_op, const std::string& path,
                   const std::string& note);
  void AddSkippedRow(const std::string& row, uint32_t tokens, uint32_t hidden,
                     const std::string& why);
  // The rows that run on the GPU without an RPC per op: the fused kernel in-process, the busy
  // client kernels beside the sidecar's planes, the doorbell, the in-stream op and the layer loop
  // with each, and NCCL's unfused layer. `base`: the shape's tensors, registered with the sidecar.
  absl::Status GpuRows(const client::OpDesc& desc, uint32_t tokens, uint32_t hidden, char* base,
                       const std::string& eager_path, const std::string& tag);
#endif
};

}  // namespace arfuse::bench::sidecar
