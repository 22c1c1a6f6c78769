#include "bench/sidecar_gpu.h"

#include <dlfcn.h>

#include <cstring>
#include <filesystem>
#include <system_error>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "bench/graph_timing.h"
#include "common/status_macros.h"
#include "server/cuda_device/cuda_status.h"

namespace arfuse::bench::sidecar {

RingLib RingLib::Load(const std::string& flag) {
  RingLib lib;
#if !defined(ARFUSE_BENCH_HAVE_RING_HEADER)
  (void)flag;
  lib.note = "this build has no client/ring library";
  return lib;
#else
  std::vector<std::string> candidates;
  if (!flag.empty()) {
    candidates.push_back(flag);
  } else {
    std::error_code ec;
    auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
    if (!ec) {
      // build/bench/arfuse-bench -> build/client/ring/libarfuse_ring.so
      candidates.push_back(
          (self.parent_path().parent_path() / "client" / "ring" / "libarfuse_ring.so").string());
      candidates.push_back((self.parent_path() / "libarfuse_ring.so").string());
    }
    candidates.push_back("libarfuse_ring.so");  // LD_LIBRARY_PATH
  }
  std::string tried;
  for (const std::string& c : candidates) {
    if (c.find('/') != std::string::npos && !std::filesystem::exists(c)) {
      absl::StrAppend(&tried, tried.empty() ? "" : ", ", c, " (absent)");
      continue;
    }
    void* h = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      const char* e = dlerror();
      absl::StrAppend(&tried, tried.empty() ? "" : ", ", c, " (", e ? e : "dlopen failed", ")");
      continue;
    }
    bool ok = true;
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
      if (fn == nullptr) ok = false;
    };
    sym(lib.open, "arfuse_open_doorbell");
    sym(lib.close, "arfuse_close_doorbell");
    sym(lib.ring, "arfuse_ring");
    sym(lib.error, "arfuse_doorbell_error");
    sym(lib.error_name, "arfuse_doorbell_error_name");
    sym(lib.check_values, "arfuse_doorbell_check_values");
    sym(lib.strerror, "arfuse_ring_strerror");
    if (!ok) {
      absl::StrAppend(&tried, tried.empty() ? "" : ", ", c, " (symbols missing)");
      dlclose(h);
      continue;
    }
    lib.handle = h;
    return lib;
  }
  lib.note = absl::StrCat("libarfuse_ring.so not loaded: ", tried, "; pass --ring_lib=PATH");
  return lib;
#endif
}

Gpu::~Gpu() {
  for (auto& [h, e] : done_events) cudaEventDestroy(e);
  if (wait_event != nullptr) cudaEventDestroy(wait_event);
  nccl.reset();
  ws.reset();
  if (stream != nullptr) cudaStreamDestroy(stream);
}

absl::Status Gpu::Init(int rank, int world) {
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&devices));
  if (devices == 0) return absl::FailedPreconditionError("no GPU visible");
  device = rank % devices;  // as the sidecar picks its GPU (arfused --gpu=-1)
  shared = world > devices;
  per_gpu = (world + devices - 1) / devices;
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ARFUSE_CUDA_RETURN_IF_ERROR(
      cudaEventCreateWithFlags(&wait_event, cudaEventInterprocess | cudaEventDisableTiming));
  cudaIpcEventHandle_t h;
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaIpcGetEventHandle(&h, wait_event));
  wait_handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  return absl::OkStatus();
}

absl::StatusOr<cudaEvent_t> Gpu::DoneEvent(const std::string& handle) {
  auto it = done_events.find(handle);
  if (it != done_events.end()) return it->second;
  if (handle.size() != sizeof(cudaIpcEventHandle_t)) {
    return absl::InternalError("done_event is not a 64-byte handle");
  }
  cudaIpcEventHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  cudaEvent_t e = nullptr;
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaIpcOpenEventHandle(&e, h));
  done_events[handle] = e;
  return e;
}

absl::StatusOr<std::vector<double>> TimeGraph(Exchange& ex, cudaStream_t s, const SidecarFlags& f,
                                              const std::function<absl::Status()>& enqueue,
                                              const std::string& tag) {
  // The ranks run the op outside capture together too.
  ARFUSE_RETURN_IF_ERROR(ex.Barrier(tag + "/eager", absl::Now() + absl::Seconds(120)));
  return TimeGraphReplays(ex, s, GraphTiming{f.graph_ops, 1, f.repeats, absl::Seconds(120)},
                          enqueue, tag);
}

}  // namespace arfuse::bench::sidecar
