#include "bench/graph_timing.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "server/cuda_device/cuda_status.h"
#include "server/cuda_device/fusion_workspace.h"

namespace arfuse::bench {

absl::StatusOr<std::vector<double>> TimeGraphReplays(Exchange& ex, cudaStream_t s,
                                                     const GraphTiming& timing,
                                                     const std::function<absl::Status()>& enqueue,
                                                     const std::string& tag) {
  ARFUSE_RETURN_IF_ERROR(enqueue());
  ARFUSE_RETURN_IF_ERROR(WaitStream(s, absl::Now() + absl::Seconds(60)));
  cudaGraph_t graph = nullptr;
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  absl::Status captured;
  for (int i = 0; i < timing.ops && captured.ok(); ++i) captured = enqueue();
  absl::Status ended = ARFUSE_CUDA_STATUS(cudaStreamEndCapture(s, &graph));
  ARFUSE_RETURN_IF_ERROR(captured);
  ARFUSE_RETURN_IF_ERROR(ended);
  cudaGraphExec_t exec = nullptr;
  absl::Status inst = ARFUSE_CUDA_STATUS(cudaGraphInstantiate(&exec, graph, 0));
  ARFUSE_CUDA_LOG_IF_ERROR(cudaGraphDestroy(graph));
  ARFUSE_RETURN_IF_ERROR(inst);
  cudaEvent_t start = nullptr, stop = nullptr;
  absl::Status st = ARFUSE_CUDA_STATUS(cudaEventCreate(&start));
  if (st.ok()) st = ARFUSE_CUDA_STATUS(cudaEventCreate(&stop));
  std::vector<double> per_op;
  for (int r = 0; r < timing.warmup + timing.repeats && st.ok(); ++r) {
    st = ex.Barrier(absl::StrCat(tag, "/", r), absl::Now() + timing.timeout);
    if (!st.ok()) break;
    st = ARFUSE_CUDA_STATUS(cudaEventRecord(start, s));
    if (st.ok()) st = ARFUSE_CUDA_STATUS(cudaGraphLaunch(exec, s));
    if (st.ok()) st = ARFUSE_CUDA_STATUS(cudaEventRecord(stop, s));
    if (st.ok()) st = WaitEvent(stop, absl::Now() + timing.timeout);
    float ms = 0;
    if (st.ok()) st = ARFUSE_CUDA_STATUS(cudaEventElapsedTime(&ms, start, stop));
    if (st.ok() && r >= timing.warmup) per_op.push_back(1000.0 * ms / timing.ops);
  }
  if (start != nullptr) ARFUSE_CUDA_LOG_IF_ERROR(cudaEventDestroy(start));
  if (stop != nullptr) ARFUSE_CUDA_LOG_IF_ERROR(cudaEventDestroy(stop));
  ARFUSE_CUDA_LOG_IF_ERROR(cudaGraphExecDestroy(exec));
  ARFUSE_RETURN_IF_ERROR(st);
  return per_op;
}

}  // namespace arfuse::bench
