#include "server/cuda_device/nccl_comm.h"

#include <unistd.h>

#include <cstring>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/collective/group_step.h"
#include "server/cuda_device/cuda_status.h"
#include "server/peers/exchange.h"
#include "spdlog/spdlog.h"

namespace arfuse {
namespace {

static_assert(sizeof(ncclUniqueId) == NCCL_UNIQUE_ID_BYTES, "unique id travels as raw bytes");

ncclDataType_t NcclType(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kFP16:
      return ncclFloat16;
    case DType::kFP32:
      return ncclFloat32;
  }
  return ncclBfloat16;
}

// Device identity as NCCL sees it: two ranks with the same UUID on one host share a GPU.
absl::StatusOr<std::string> DeviceIdentity() {
  int ordinal = 0;
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaGetDevice(&ordinal));
  cudaDeviceProp prop;
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, ordinal));
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  return absl::StrCat(host, "/", std::string(prop.uuid.bytes, sizeof(prop.uuid.bytes)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<NcclComm>> NcclComm::Create(Exchange& exchange,
                                                           absl::Time deadline, bool blocking) {
  const int rank = exchange.rank();
  const int world = exchange.world_size();
  ARFUSE_ASSIGN_OR_RETURN(
      std::vector<std::string> devices,
      AllgatherStep(exchange, blocking ? "nccl.devices.b" : "nccl.devices", DeviceIdentity(), "NCCL device check", deadline));
  for (int a = 0; a < world; ++a) {
    for (int b = a + 1; b < world; ++b) {
      if (devices[a] == devices[b]) {
        return absl::FailedPreconditionError(absl::StrCat(
            "NCCL cannot run: ranks ", a, " and ", b, " share one GPU (NCCL refuses duplicates)"));
      }
    }
  }
  absl::StatusOr<std::string> id_bytes = std::string();
  if (rank == 0) {
    ncclUniqueId id;
    absl::Status made = ARFUSE_CUDA_STATUS(ncclGetUniqueId(&id));
    id_bytes = made.ok() ? absl::StatusOr<std::string>(
                               std::string(reinterpret_cast<const char*>(&id), sizeof(id)))
                         : absl::StatusOr<std::string>(made);
  }
  ARFUSE_ASSIGN_OR_RETURN(
      std::vector<std::string> ids,
      AllgatherStep(exchange, blocking ? "nccl.unique_id.b" : "nccl.unique_id", id_bytes, "NCCL unique id", deadline));
  if (ids[0].size() != sizeof(ncclUniqueId)) {
    return absl::InternalError(absl::StrCat("NCCL unique id has ", ids[0].size(), " bytes"));
  }
  ncclUniqueId id;
  std::memcpy(&id, ids[0].data(), sizeof(id));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  // Nonblocking: initialization and calls return at once and are polled against the deadline.
  config.blocking = blocking ? 1 : 0;
  ncclComm_t raw = nullptr;
  ncclResult_t started = ncclCommInitRankConfig(&raw, world, id, rank, &config);
  if (started != ncclSuccess && started != ncclInProgress) {
    if (raw != nullptr) ncclCommAbort(raw);
    return ARFUSE_CUDA_STATUS(started);
  }
  std::unique_ptr<NcclComm> comm(new NcclComm(raw, rank, world));
  ARFUSE_RETURN_IF_ERROR(comm->WaitReady(started, "communicator init", deadline));
  spdlog::info("event=nccl_comm_ready rank={} world_size={}", rank, world);
  return comm;
}

NcclComm::~NcclComm() {
  if (comm_ != nullptr) ARFUSE_CUDA_LOG_IF_ERROR(ncclCommAbort(comm_));
  for (void* p : symmetric_) ARFUSE_CUDA_LOG_IF_ERROR(ncclMemFree(p));
}

absl::Status NcclComm::WaitReady(ncclResult_t started, const char* what, absl::Time deadline) {
  ncclResult_t state = started;
  const absl::Time start = absl::Now();
  while (state == ncclInProgress) {
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("NCCL ", what, " did not complete before the deadline"));
    }
    if (absl::Now() - start < absl::Milliseconds(1)) {
      std::this_thread::yield();
    } else {
      absl::SleepFor(absl::Microseconds(100));
    }
    ncclResult_t query = ncclCommGetAsyncError(comm_, &state);
    if (query != ncclSuccess) return ARFUSE_CUDA_STATUS(query);
  }
  if (state != ncclSuccess) {
    absl::Status status = ARFUSE_CUDA_STATUS(state);
    return absl::Status(status.code(), absl::StrCat("NCCL ", what, ": ", status.message()));
  }
  return absl::OkStatus();
}

absl::Status NcclComm::AllReduce(const void* send, void* recv, size_t count, DType dtype,
                                 cudaStream_t stream, absl::Time deadline) {
  ncclResult_t started = ncclAllReduce(send, recv, count, NcclType(dtype), ncclSum, comm_, stream);
  if (started != ncclSuccess && started != ncclInProgress) return ARFUSE_CUDA_STATUS(started);
  return WaitReady(started, "allreduce", deadline);
}

absl::StatusOr<void*> NcclComm::AllocSymmetric(size_t bytes, absl::Time deadline) {
  void* ptr = nullptr;
  ARFUSE_CUDA_RETURN_IF_ERROR(ncclMemAlloc(&ptr, bytes));
  symmetric_.push_back(ptr);
  ncclWindow_t window = nullptr;
  ncclResult_t started =
      ncclCommWindowRegister(comm_, ptr, bytes, &window, NCCL_WIN_COLL_SYMMETRIC);
  if (started != ncclSuccess && started != ncclInProgress) return ARFUSE_CUDA_STATUS(started);
  ARFUSE_RETURN_IF_ERROR(WaitReady(started, "symmetric window registration", deadline));
  return ptr;
}

}  // namespace arfuse
