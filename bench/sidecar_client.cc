#include "bench/sidecar_client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/sidecar_client_run.h"
#include "bench/sidecar_rows.h"
#include "client/cpp/client.h"
#include "common/log.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "kernels/common/op_types.h"
#include "server/host/host_engine.h"
#include "server/peers/peer_exchange.h"

#if defined(ARFUSE_BENCH_CUDA)
#include <cuda_runtime_api.h>

#include "bench/sidecar_gpu.h"
#include "server/cuda_device/fusion_workspace.h"
#include "server/cuda_device/mps_driver.h"
#include "server/cuda_device/nccl_comm.h"
#include "server/doorbell/doorbell_dispatch.h"
#endif

namespace arfuse::bench::sidecar {

using client::Client;
using client::ClientOptions;

int ClientMain(const SidecarFlags& f) {
  static_cast<void>(InitLogging("error"));
  const int rank = f.client_rank;
  std::ofstream result(absl::StrCat(f.dir, "/result.", rank));
  auto fail = [&](const absl::Status& s) {
    result << "error\t" << Clean(s.ToString()) << "\n";
    std::fprintf(stderr, "arfuse-bench sidecar client %d: %s\n", rank, s.ToString().c_str());
    return 1;
  };
  const bool cuda = f.device == "cuda";
  const absl::Time until = absl::Now() + absl::Seconds(f.timeout_s);

#if defined(ARFUSE_BENCH_CUDA)
  std::unique_ptr<Gpu> gpu;
  if (cuda) {
    gpu = std::make_unique<Gpu>();
    if (absl::Status s = gpu->Init(rank, f.ranks); !s.ok()) return fail(s);
  }
#else
  if (cuda) return fail(absl::UnimplementedError("this arfuse-bench was built without CUDA"));
#endif

  ClientOptions co;
  co.target = SocketOf(f.dir, rank);
  co.client_name = absl::StrCat("arfuse-bench-rank", rank);
  co.default_timeout = absl::Seconds(30);
  co.connect_timeout = absl::Seconds(std::min(120, f.timeout_s));
  auto c = Client::Connect(co);
  if (!c.ok()) return fail(c.status());
  // The sidecars' group forms in the background.
  v1::GetWorkspaceInfoResponse info;
  for (;;) {
    auto i = (*c)->GetWorkspaceInfo();
    if (!i.ok()) return fail(i.status());
    info = *i;
    if (info.state() == v1::WORKSPACE_STATE_READY || info.state() == v1::WORKSPACE_STATE_UNFUSED) {
      break;
    }
    if (absl::Now() > until) {
      return fail(absl::DeadlineExceededError(
          absl::StrCat("the sidecar's workspace is not ready: ", info.reason())));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }

  // The client processes' own group: barriers around timed loops, and the in-process rows'
  // workspace and NCCL communicator.
  PeerOptions po;
  po.rank = rank;
  po.world_size = f.ranks;
  po.peer_dir = f.dir + "/clients";
  po.group = "bench";
  po.timeout = absl::Seconds(std::min(120, f.timeout_s));
  auto ex = ConnectPeers(po);
  if (!ex.ok()) return fail(ex.status());

  std::vector<RowResult> rows;
  auto health = grpc::health::v1::Health::NewStub((*c)->channel());
  ClientRun run(f, rank, cuda, **c, **ex, *health, rows);

#if defined(ARFUSE_BENCH_CUDA)
  if (cuda) {
    run.gpu = gpu.get();
    gpu->ring = RingLib::Load(f.ring_lib);
    const uint32_t max_t = *std::max_element(f.tokens.begin(), f.tokens.end());
    const uint32_t max_h = *std::max_element(f.hidden.begin(), f.hidden.end());
    const std::string& backend = info.backend();
    if (f.ranks < 2) {
      gpu->ws_note = "in-process rows need 2 or more ranks";
    } else if (backend != "trtllm" && backend != "mnnvl") {
      gpu->ws_note = absl::StrCat("the sidecars run backend \"", backend, "\" (", info.reason(),
                                  "): no fused kernel to compare with");
    } else {
      WorkspaceOptions wo;
      wo.backend = backend;
      wo.max_tokens = max_t;
      wo.hidden = max_h;
      wo.dtype = DType::kBF16;
      // Ranks sharing a GPU split its SMs, leaving room for every rank's ring and waiter blocks
      // (docs/doorbell.md), so every rank's grid stays co-resident.
      // The same budget as the sidecars' own workspaces with arfused's default serving blocks
      // (SharedGpuSmBudget), so in-process and in-stream launches have the same grids.
      if (gpu->shared) {
        wo.sm_budget = SharedGpuSmBudget(gpu->sms, gpu->per_gpu, true,
                                         DoorbellServeBlocksFor(kDefaultDoorbellServeBlocks, true));
      }
      auto ws = FusionWorkspace::Create(**ex, wo, gpu->stream, absl::Now() + absl::Seconds(120));
      if (ws.ok()) {
        gpu->ws = std::move(*ws);
      } else {
        gpu->ws_note = absl::StrCat("in-process workspace: ", ws.status().ToString());
      }
    }
    if (f.ranks < 2) {
      gpu->nccl_note = "NCCL rows need 2 or more ranks";
    } else if (gpu->shared) {
      gpu->nccl_note = "NCCL rows need one GPU per rank (ranks share a GPU)";
    } else {
      auto nccl = NcclComm::Create(**ex, absl::Now() + absl::Seconds(120));
      if (nccl.ok()) {
        gpu->nccl = std::move(*nccl);
      } else {
        gpu->nccl_note = absl::StrCat("NCCL: ", nccl.status().ToString());
      }
    }
    if (rank == 0) {
      cudaDeviceProp prop;
      if (cudaGetDeviceProperties(&prop, gpu->device) == cudaSuccess) {
        result << "info\tgpu\t" << Clean(prop.name) << "\n";
      }
      result << "info\tgpus\t" << std::min(gpu->devices, f.ranks) << "\n";
      result << "info\tshared_gpu\t" << (gpu->shared ? 1 : 0) << "\n";
      const MpsInfo mps = DetectMpsOnDevice(gpu->device);
      result << "info\tmps_active\t" << (mps.active() ? 1 : 0) << "\n";
      result << "info\tmps\t" << Clean(mps.Describe()) << "\n";
    }
  }
#endif
  std::unique_ptr<Engine> host_engine;
  if (!cuda) {
    EngineOptions eo;
    eo.rank = rank;
    eo.world_size = f.ranks;
    eo.max_tokens = *std::max_element(f.tokens.begin(), f.tokens.end());
    eo.max_hidden = *std::max_element(f.hidden.begin(), f.hidden.end());
    eo.dtype = DType::kBF16;
    auto e = MakeHostEngine(eo);
    absl::Status st = e.status();
    if (st.ok()) st = (*e)->Initialize(**ex, absl::Now() + absl::Seconds(120));
    if (st.ok()) {
      host_engine = std::move(*e);
      run.host_engine = host_engine.get();
    } else {
      run.host_engine_note = absl::StrCat("in-process host engine: ", st.ToString());
    }
  }
  if (rank == 0) {
    result << "info\tbackend\t" << Clean(info.backend()) << "\n";
    result << "info\tbackend_reason\t" << Clean(info.reason()) << "\n";
  }

  int rc = 0;
  for (uint32_t h : f.hidden) {
    for (uint32_t t : f.tokens) {
      absl::Status s = run.Shape(t, h);
      if (!s.ok()) {
        rc = fail(absl::Status(s.code(), absl::StrCat(t, "x", h, ": ", s.message())));
        break;
      }
    }
    if (rc != 0) break;
  }
  for (const RowResult& r : rows) result << Serialize(r);
  result.flush();
  // The group leaves together: rank 0's coordinator serves the others until they are done.
  static_cast<void>((*ex)->Barrier("done", absl::Now() + absl::Seconds(60)));
  return rc;
}

}  // namespace arfuse::bench::sidecar
