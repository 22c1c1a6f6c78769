#include "tools/demo/demo_cuda.h"

#include "absl/strings/str_cat.h"

namespace arfuse::demo {

absl::Status CudaCheck(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

absl::StatusOr<std::vector<double>> ReplayVariants(cudaGraphExec_t exec, cudaStream_t stream,
                                                   char* tensors, const Layout& L,
                                                   const char* variants, char* history,
                                                   size_t tbytes, int iters) {
  // Two events per timed replay, destroyed on every return (after the stream is idle or failed).
  struct Events {
    std::vector<cudaEvent_t> e;
    ~Events() {
      for (cudaEvent_t x : e) cudaEventDestroy(x);
    }
  } events;
  events.e.resize(2 * static_cast<size_t>(iters), nullptr);
  absl::Status st;
  for (size_t i = 0; st.ok() && i < events.e.size(); ++i) {
    st = CudaCheck(cudaEventCreate(&events.e[i]), "cudaEventCreate");
  }
  for (int i = 0; st.ok() && i < kDemoWarmup + iters; ++i) {
    const int k = i % kDemoVariants;
    const int t = i - kDemoWarmup;  // timed replay index, < 0 for warm-up
    st = CudaCheck(cudaMemcpyAsync(tensors + L.input, variants + k * tbytes, tbytes,
                                   cudaMemcpyDeviceToDevice, stream),
                   "input update");
    if (st.ok() && t >= 0) st = CudaCheck(cudaEventRecord(events.e[2 * t], stream), "event");
    if (st.ok()) st = CudaCheck(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
    if (st.ok() && t >= 0) st = CudaCheck(cudaEventRecord(events.e[2 * t + 1], stream), "event");
    if (st.ok()) {
      st = CudaCheck(cudaMemcpyAsync(history + (2 * k) * tbytes, tensors + L.residual_out, tbytes,
                                     cudaMemcpyDeviceToDevice, stream),
                     "output copy");
    }
    if (st.ok()) {
      st = CudaCheck(cudaMemcpyAsync(history + (2 * k + 1) * tbytes, tensors + L.norm_out, tbytes,
                                     cudaMemcpyDeviceToDevice, stream),
                     "output copy");
    }
  }
  // Idle before the events go, on failure too (a queued record must not outlive its event).
  const absl::Status idle = CudaCheck(cudaStreamSynchronize(stream), "replays");
  if (!st.ok()) return st;
  if (!idle.ok()) return idle;
  std::vector<double> us;
  for (int t = 0; t < iters; ++t) {
    float ms = 0;
    if (absl::Status e = CudaCheck(cudaEventElapsedTime(&ms, events.e[2 * t], events.e[2 * t + 1]),
                                   "event time");
        !e.ok()) {
      return e;
    }
    us.push_back(double(ms) * 1e3);
  }
  return us;
}

}  // namespace arfuse::demo
