#include "server/doorbell/self_test.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "kernels/doorbell/doorbell.h"
#include "server/cuda_device/cuda_status.h"
#include "server/doorbell/scoped_device.h"
#include "spdlog/spdlog.h"

namespace arfuse {
namespace {

// Everything the self-test allocates. Teardown sets the stop word (queued waiters leave at once),
// waits a bounded time for both streams and leaks rather than blocks.
struct SelfTestResources {
  ~SelfTestResources() {
    if (control_host != nullptr) __atomic_store_n(&control_host->stop, 1u, __ATOMIC_RELEASE);
    const absl::Time deadline = absl::Now() + absl::Milliseconds(500);
    bool drained = false;
    while (absl::Now() < deadline) {
      const bool busy = (sidecar != nullptr && cudaStreamQuery(sidecar) == cudaErrorNotReady) ||
                        (client != nullptr && cudaStreamQuery(client) == cudaErrorNotReady);
      if (!busy) {
        drained = true;
        break;
      }
      absl::SleepFor(absl::Microseconds(100));
    }
    cudaGetLastError();
    if (!drained) {
      spdlog::warn("event=doorbell_self_test_leak reason=\"kernels still running at teardown\"");
      return;
    }
    if (ring_exec != nullptr) cudaGraphExecDestroy(ring_exec);
    if (reference_exec != nullptr) cudaGraphExecDestroy(reference_exec);
    for (cudaEvent_t e : {start, stop}) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    for (cudaStream_t s : {sidecar, client}) {
      if (s != nullptr) cudaStreamDestroy(s);
    }
    for (void* p : {static_cast<void*>(block), static_cast<void*>(plans), static_cast<void*>(op),
                    static_cast<void*>(idle_params)}) {
      if (p != nullptr) cudaFree(p);
    }
    if (control_host != nullptr) cudaFreeHost(control_host);
    cudaGetLastError();
  }

  cudaStream_t sidecar = nullptr;
  cudaStream_t client = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  DoorbellBlock* block = nullptr;
  DoorbellPlanEntry* plans = nullptr;
  DoorbellOp* op = nullptr;
  FusionParams* idle_params = nullptr;  // zeroed: num_tokens == 0
  DoorbellControl* control_host = nullptr;
  const DoorbellControl* control_device = nullptr;
  cudaGraphExec_t ring_exec = nullptr;
  cudaGraphExec_t reference_exec = nullptr;
};

absl::Status WaitEventBounded(cudaEvent_t event, absl::Time deadline, const char* what) {
  while (true) {
    const cudaError_t err = cudaEventQuery(event);
    if (err == cudaSuccess) return absl::OkStatus();
    if (err != cudaErrorNotReady) return CudaResultToStatus(err, what, __FILE__, __LINE__);
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(what, " did not finish in time"));
    }
    absl::SleepFor(absl::Microseconds(50));
  }
}

absl::Status WaitStreamBounded(cudaStream_t stream, absl::Time deadline, const char* what) {
  while (true) {
    const cudaError_t err = cudaStreamQuery(stream);
    if (err == cudaSuccess) return absl::OkStatus();
    if (err != cudaErrorNotReady) return CudaResultToStatus(err, what, __FILE__, __LINE__);
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(what, " did not finish in time"));
    }
    absl::SleepFor(absl::Microseconds(50));
  }
}

// Captures `ops` launches made by `launch` on `stream` into an executable graph.
template <typename Launch>
absl::StatusOr<cudaGraphExec_t> Capture(cudaStream_t stream, int ops, Launch launch) {
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  cudaError_t launch_err = cudaSuccess;
  for (int i = 0; i < ops && launch_err == cudaSuccess; ++i) launch_err = launch();
  cudaGraph_t graph = nullptr;
  const cudaError_t end_err = cudaStreamEndCapture(stream, &graph);
  ARFUSE_CUDA_RETURN_IF_ERROR(launch_err);
  ARFUSE_CUDA_RETURN_IF_ERROR(end_err);
  cudaGraphExec_t exec = nullptr;
  const cudaError_t inst_err = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  ARFUSE_CUDA_RETURN_IF_ERROR(inst_err);
  return exec;
}

}  // namespace

absl::StatusOr<DoorbellHopReport> RunDoorbellSelfTest(const DoorbellSelfTestOptions& options) {
  if (options.ops < 1 || options.ops > 100000 || options.repeats < 1 || options.repeats > 100) {
    return absl::InvalidArgumentError("doorbell self-test: ops must be 1..100000, repeats 1..100");
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("doorbell self-test: timeout must be positive");
  }
  const WorkspaceLayout layout = ComputeWorkspaceLayout(2, 64, options.hidden, DType::kBF16);
  if (layout.total_bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("doorbell self-test: hidden ", options.hidden, " is not a valid shape"));
  }
  const uint64_t timeout_ns = static_cast<uint64_t>(absl::ToInt64Nanoseconds(options.timeout));

  ARFUSE_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device));
  SelfTestResources r;
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&r.sidecar, cudaStreamNonBlocking));
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&r.client, cudaStreamNonBlocking));
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaEventCreate(&r.start));
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaEventCreate(&r.stop));
  void* raw = nullptr;
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaMalloc(&raw, sizeof(DoorbellBlock)));
  r.block = static_cast<DoorbellBlock*>(raw);
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaMalloc(&raw, sizeof(DoorbellPlanEntry)));
  r.plans = static_cast<DoorbellPlanEntry*>(raw);
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaMalloc(&raw, sizeof(DoorbellOp)));
  r.op = static_cast<DoorbellOp*>(raw);
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaMalloc(&raw, sizeof(FusionParams)));
  r.idle_params = static_cast<FusionParams*>(raw);
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&raw, sizeof(DoorbellControl), cudaHostAllocMapped));
  r.control_host = static_cast<DoorbellControl*>(raw);
  std::memset(r.control_host, 0, sizeof(DoorbellControl));
  r.control_host->generation = 1;
  void* device_view = nullptr;
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&device_view, r.control_host, 0));
  r.control_device = static_cast<const DoorbellControl*>(device_view);

  // A plan whose ops carry no tokens: the fused launch has its real grid and block for this
  // shape, and every block returns at once (it touches no workspace, so no pointer is needed).
  FusionParams tmpl{};
  tmpl.rank = 0;
  tmpl.world_size = 2;
  tmpl.layout = layout;
  tmpl.hidden = options.hidden;
  tmpl.eps = 1e-6f;
  tmpl.spin_timeout_ns = timeout_ns;
  tmpl.dtype = DType::kBF16;
  tmpl.pattern = Pattern::kAllReduceResidualRmsNorm;
  tmpl.algo = FusionAlgo::kOneShot;
  DoorbellPlanEntry entry{};
  entry.params = tmpl;
  entry.max_tokens = 0;  // rings carry 0 tokens
  entry.twoshot_min_tokens = 0xffffffffu;
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(r.block, 0, sizeof(DoorbellBlock), r.sidecar));
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(r.op, 0, sizeof(DoorbellOp), r.sidecar));
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(r.idle_params, 0, sizeof(FusionParams), r.sidecar));
  ARFUSE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(r.plans, &entry, sizeof(entry), cudaMemcpyHostToDevice, r.sidecar));
  const absl::Time setup_deadline = absl::Now() + options.timeout;
  ARFUSE_RETURN_IF_ERROR(WaitStreamBounded(r.sidecar, setup_deadline, "self-test setup"));

  DoorbellSlot* slot = reinterpret_cast<DoorbellSlot*>(r.block);
  // Load every kernel before capturing (no lazy loading inside a capture) and before the waiter
  // spins: the completion kernel first launched behind a running waiter would be loaded then,
  // and that load may wait for the waiter, which waits for a ring queued behind the load (every
  // self-test in a fresh process failed so, until the waiter's timeout).
  ARFUSE_CUDA_RETURN_IF_ERROR(PrepareDoorbellRing());
  ARFUSE_CUDA_RETURN_IF_ERROR(PrepareDoorbellSidecarKernels());
  ARFUSE_CUDA_RETURN_IF_ERROR(LaunchAllReduceFusionIndirect(tmpl, r.idle_params, r.client));
  ARFUSE_RETURN_IF_ERROR(WaitStreamBounded(r.client, setup_deadline, "self-test setup"));
  ARFUSE_ASSIGN_OR_RETURN(r.ring_exec, Capture(r.client, options.ops, [&] {
                            return LaunchDoorbellRing(slot, 0, timeout_ns, r.client);
                          }));
  ARFUSE_ASSIGN_OR_RETURN(r.reference_exec, Capture(r.client, options.ops, [&] {
                            return LaunchAllReduceFusionIndirect(tmpl, r.idle_params, r.client);
                          }));

  DoorbellWaitParams w{};
  w.slots = slot;
  w.plans = r.plans;
  w.op = r.op;
  w.control = r.control_device;
  w.idle_timeout_ns = timeout_ns;
  w.slot_mask = 1u;
  w.generation = 1;
  DoorbellCompleteParams c{};
  c.slots = slot;
  c.op = r.op;

  // Times one replay of `exec` on the client stream; for the doorbell, first queues one triple
  // per ring on the sidecar stream.
  auto timed_replay = [&](cudaGraphExec_t exec, bool doorbell) -> absl::StatusOr<double> {
    if (doorbell) {
      for (int i = 0; i < options.ops; ++i) {
        const bool pdl = options.programmatic_launch;
        ARFUSE_CUDA_RETURN_IF_ERROR(LaunchDoorbellWait(w, r.sidecar, pdl));
        ARFUSE_CUDA_RETURN_IF_ERROR(LaunchAllReduceFusionIndirect(
            tmpl, reinterpret_cast<const FusionParams*>(r.op), r.sidecar, pdl));
        ARFUSE_CUDA_RETURN_IF_ERROR(LaunchDoorbellComplete(c, r.sidecar, pdl));
      }
    }
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaEventRecord(r.start, r.client));
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec, r.client));
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaEventRecord(r.stop, r.client));
    const absl::Time deadline = absl::Now() + options.timeout;
    ARFUSE_RETURN_IF_ERROR(WaitEventBounded(r.stop, deadline, "self-test replay"));
    ARFUSE_RETURN_IF_ERROR(WaitStreamBounded(r.sidecar, deadline, "self-test sidecar stream"));
    float ms = 0;
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, r.start, r.stop));
    return static_cast<double>(ms) * 1000.0 / options.ops;
  };

  double best_doorbell = 1e30;
  double best_reference = 1e30;
  for (int i = 0; i <= options.repeats; ++i) {  // i == 0: warm-up
    ARFUSE_ASSIGN_OR_RETURN(const double ref_us, timed_replay(r.reference_exec, false));
    ARFUSE_ASSIGN_OR_RETURN(const double bell_us, timed_replay(r.ring_exec, true));
    if (i == 0) continue;
    best_reference = std::min(best_reference, ref_us);
    best_doorbell = std::min(best_doorbell, bell_us);
  }
  DoorbellSlot host_slot;
  ARFUSE_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(&host_slot, slot, sizeof(host_slot), cudaMemcpyDeviceToHost));
  if (host_slot.error != 0) {
    return absl::InternalError(
        absl::StrCat("doorbell self-test: a ring failed: ", DoorbellErrorName(host_slot.error)));
  }
  const uint32_t expected = static_cast<uint32_t>(options.ops * (options.repeats + 1));
  if (host_slot.served != expected || host_slot.request != kDoorbellReset ||
      host_slot.complete != kDoorbellReset) {
    return absl::InternalError(absl::StrCat("doorbell self-test: the sidecar served ",
                                            host_slot.served, " ops of ", expected,
                                            " or left the slot unarmed"));
  }
  DoorbellHopReport report;
  report.measured = true;
  report.ops = options.ops;
  report.doorbell_us_per_op = best_doorbell;
  report.inprocess_us_per_op = best_reference;
  report.hop_us = best_doorbell - best_reference;
  spdlog::info("event=doorbell_self_test hop_us={:.2f} doorbell_us={:.2f} inprocess_us={:.2f}",
               report.hop_us, report.doorbell_us_per_op, report.inprocess_us_per_op);
  return report;
}

}  // namespace arfuse
