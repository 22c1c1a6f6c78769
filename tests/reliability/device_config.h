// The device the reliability tests run on. The same sources build twice: for --device=host
// sidecars (CI, label integration) and, with ARFUSE_RELIABILITY_GPU, for --device=cuda sidecars
// (label gpu; ranks share the GPUs under MPS, or take one each).
#pragma once

#include <cstdlib>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tests/reliability/harness.h"

namespace arfuse::reliability {

#if defined(ARFUSE_RELIABILITY_GPU)
constexpr Device kDevice = Device::kCuda;
// Building a CUDA workspace (IPC exchange, NCCL) takes longer than a host one.
constexpr absl::Duration kFormTimeout = absl::Seconds(180);
#else
constexpr Device kDevice = Device::kHost;
constexpr absl::Duration kFormTimeout = absl::Seconds(60);
#endif

// A sidecar configuration for kDevice: small spin timeout (faults are noticed in 2 s), short
// peer timeout on host (a re-forming group retries every few seconds).
inline SidecarConfig Config() {
  SidecarConfig c;
  c.device = kDevice;
  if (kDevice == Device::kCuda) {
    c.peer_timeout_s = 60;
    // auto, trtllm, mnnvl, or none: fusion disabled, every op on the NCCL path (a GPU per rank).
    const char* backend = std::getenv("ARFUSE_RELIABILITY_BACKEND");
    if (backend != nullptr && std::string(backend) == "none") {
      c.extra_flags.push_back("--enforce-disable-flashinfer-allreduce-fusion");
    } else {
      c.extra_flags.push_back(std::string("--flashinfer-allreduce-fusion-backend=") +
                              (backend != nullptr ? backend : "auto"));
    }
  }
  return c;
}

inline absl::StatusOr<std::unique_ptr<RankClient>> NewClient(const std::string& socket,
                                                             int rank, int world,
                                                             ShapeConfig shape = {},
                                                             uint64_t salt = 0,
                                                             const std::string& name = "rel") {
  return RankClient::Create(socket, rank, world, shape, salt, name, kDevice);
}

}  // namespace arfuse::reliability
