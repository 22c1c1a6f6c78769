// doorbell-ring-client: a client process for the two-process doorbell test. It opens one slot of a
// sidecar's doorbell block by CUDA IPC through libarfuse_ring (as a framework would: its own
// CUDA runtime for streams and graphs, the library's for the ring), captures ring kernels in
// CUDA graphs and replays them on commands read from stdin:
//   ring T K      replay a graph of one ring of T tokens K times, wait; prints "done <error>"
//   bench T K N   replay a graph of N rings of T tokens K times (after a warm-up), timed with
//                 events; prints "bench <us per op> <error>"
//   quit
// usage: doorbell-ring-client --device=D --handle=<128 hex digits> --offset=O [--timeout_ms=M]
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <utility>

#include "client/ring/arfuse_ring.h"

namespace {

bool ParseHex(const std::string& hex, unsigned char* out, size_t n) {
  if (hex.size() != 2 * n) return false;
  for (size_t i = 0; i < n; ++i) {
    char* end = nullptr;
    const std::string byte = hex.substr(2 * i, 2);
    const long v = std::strtol(byte.c_str(), &end, 16);
    if (end != byte.c_str() + 2) return false;
    out[i] = static_cast<unsigned char>(v);
  }
  return true;
}

int Fail(const char* what, int rc) {
  std::printf("error %s: %s\n", what, arfuse_ring_strerror(rc));
  std::fflush(stdout);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  int device = 0;
  unsigned char handle[64];
  bool have_handle = false;
  unsigned long long offset = 0;
  unsigned long long timeout_ns = 10'000'000'000ull;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--device=", 0) == 0) {
      device = std::atoi(a.c_str() + 9);
    } else if (a.rfind("--handle=", 0) == 0) {
      have_handle = ParseHex(a.substr(9), handle, sizeof(handle));
    } else if (a.rfind("--offset=", 0) == 0) {
      offset = std::strtoull(a.c_str() + 9, nullptr, 10);
    } else if (a.rfind("--timeout_ms=", 0) == 0) {
      timeout_ns = std::strtoull(a.c_str() + 13, nullptr, 10) * 1'000'000ull;
    }
  }
  if (!have_handle) {
    std::printf("error usage: --device=D --handle=<128 hex digits> --offset=O\n");
    return 2;
  }
  if (cudaSetDevice(device) != cudaSuccess) return Fail("cudaSetDevice", 1);
  void* slot = nullptr;
  if (int rc = arfuse_open_doorbell(handle, offset, &slot); rc != ARFUSE_RING_OK) {
    return Fail("arfuse_open_doorbell", rc);
  }
  cudaStream_t stream = nullptr;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  cudaEvent_t start = nullptr, stop = nullptr;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::map<std::pair<unsigned, int>, cudaGraphExec_t> graphs;  // (tokens, rings) -> graph
  auto graph_for = [&](unsigned tokens, int rings, int* rc) -> cudaGraphExec_t {
    auto it = graphs.find({tokens, rings});
    if (it != graphs.end()) return it->second;
    cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
    for (int i = 0; i < rings && *rc == ARFUSE_RING_OK; ++i) {
      *rc = arfuse_ring(stream, slot, tokens, timeout_ns);
    }
    cudaGraph_t graph = nullptr;
    const cudaError_t end = cudaStreamEndCapture(stream, &graph);
    cudaGraphExec_t exec = nullptr;
    if (*rc == ARFUSE_RING_OK && end == cudaSuccess &&
        cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) {
      exec = nullptr;
    }
    if (graph != nullptr) cudaGraphDestroy(graph);
    if (exec == nullptr && *rc == ARFUSE_RING_OK) *rc = static_cast<int>(cudaErrorUnknown);
    graphs[{tokens, rings}] = exec;
    return exec;
  };
  std::printf("ready\n");
  std::fflush(stdout);
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "quit") break;
    unsigned tokens = 0;
    int replays = 0, rings = 1;
    in >> tokens >> replays;
    if (cmd == "bench") in >> rings;
    int rc = ARFUSE_RING_OK;
    cudaGraphExec_t exec = graph_for(tokens, rings, &rc);
    if (rc != ARFUSE_RING_OK) return Fail("capture", rc);
    if (cmd == "bench") {
      cudaGraphLaunch(exec, stream);  // warm-up
      cudaEventRecord(start, stream);
    }
    for (int i = 0; i < replays; ++i) cudaGraphLaunch(exec, stream);
    if (cmd == "bench") cudaEventRecord(stop, stream);
    if (cudaError_t err = cudaStreamSynchronize(stream); err != cudaSuccess) {
      return Fail("replay", static_cast<int>(err));
    }
    uint32_t code = 0;
    if (int e = arfuse_doorbell_error(slot, &code); e != ARFUSE_RING_OK) {
      return Fail("arfuse_doorbell_error", e);
    }
    if (cmd == "bench") {
      float ms = 0;
      cudaEventElapsedTime(&ms, start, stop);
      std::printf("bench %.3f %u\n", ms * 1000.0 / (static_cast<double>(replays) * rings), code);
    } else {
      std::printf("done %u\n", code);
    }
    std::fflush(stdout);
  }
  for (auto& [key, exec] : graphs) {
    if (exec != nullptr) cudaGraphExecDestroy(exec);
  }
  const int rc = arfuse_close_doorbell(slot);
  return rc == ARFUSE_RING_OK ? 0 : Fail("arfuse_close_doorbell", rc);
}
