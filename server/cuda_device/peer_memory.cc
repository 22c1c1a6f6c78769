#include "server/cuda_device/peer_memory.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <fcntl.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/fd/unique_fd.h"
#include "server/collective/group_step.h"
#include "server/cuda_device/cuda_status.h"
#include "server/peers/exchange.h"
#include "spdlog/spdlog.h"

namespace arfuse {
namespace {

// Handles travel between processes of possibly different builds: pin their sizes.
static_assert(sizeof(cudaIpcMemHandle_t) == 64, "legacy CUDA IPC handle is 64 bytes");
static_assert(sizeof(CUmemFabricHandle) == 64, "VMM fabric handle is 64 bytes");

absl::Status CheckGroup(const Exchange& exchange, size_t bytes) {
  if (exchange.world_size() < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer memory needs at least 2 ranks, got ", exchange.world_size()));
  }
  if (bytes == 0) return absl::InvalidArgumentError("peer memory of 0 bytes");
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// trtllm: cudaMalloc + legacy CUDA IPC.

class IpcPeerMemory final : public PeerMemory {
 public:
  IpcPeerMemory(int rank, int world_size, size_t bytes)
      : rank_(rank), bytes_(bytes), ptrs_(world_size, nullptr) {}
  ~IpcPeerMemory() override {
    for (int r = 0; r < static_cast<int>(ptrs_.size()); ++r) {
      if (r != rank_ && ptrs_[r] != nullptr)
        ARFUSE_CUDA_LOG_IF_ERROR(cudaIpcCloseMemHandle(ptrs_[r]));
    }
    if (ptrs_[rank_] != nullptr) ARFUSE_CUDA_LOG_IF_ERROR(cudaFree(ptrs_[rank_]));
  }
  size_t bytes() const override { return bytes_; }
  int rank() const override { return rank_; }
  int world_size() const override { return static_cast<int>(ptrs_.size()); }
  void* peer(int r) const override { return ptrs_[r]; }
  const char* kind() const override { return "cuda_ipc"; }
  absl::StatusOr<InStreamRankMemory> ExportForClient(int r) const override {
    if (r < 0 || r >= world_size() || handles_.size() != ptrs_.size()) {
      return absl::FailedPreconditionError(absl::StrCat("no CUDA IPC handle of rank ", r));
    }
    InStreamRankMemory m;
    m.kind = instream::MemoryKind::kCudaIpc;
    m.bytes = bytes_;
    m.handle = handles_[r];
    return m;
  }

  absl::StatusOr<std::string> AllocateAndExport() {
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaMalloc(&ptrs_[rank_], bytes_));
    cudaIpcMemHandle_t handle;
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&handle, ptrs_[rank_]));
    return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
  }

  absl::Status Import(const std::vector<std::string>& handles) {
    handles_ = handles;
    for (int r = 0; r < world_size(); ++r) {
      if (r == rank_) continue;
      if (handles[r].size() != sizeof(cudaIpcMemHandle_t)) {
        return absl::InvalidArgumentError(
            absl::StrCat("CUDA IPC handle from rank ", r, " has ", handles[r].size(), " bytes"));
      }
      cudaIpcMemHandle_t handle;
      std::memcpy(&handle, handles[r].data(), sizeof(handle));
      // Lazy peer access: on one GPU (ranks under MPS) there is no peer to enable.
      ARFUSE_CUDA_RETURN_IF_ERROR(
          cudaIpcOpenMemHandle(&ptrs_[r], handle, cudaIpcMemLazyEnablePeerAccess));
    }
    return absl::OkStatus();
  }

 private:
  int rank_;
  size_t bytes_;
  std::vector<void*> ptrs_;
  std::vector<std::string> handles_;  // every rank's, for clients (ExportForClient)
};

// ---------------------------------------------------------------------------------------------
// mnnvl: cuMemCreate + FABRIC or POSIX-FD handles, unicast mappings.

class VmmPeerMemory final : public PeerMemory {
 public:
  VmmPeerMemory(int rank, int world_size, size_t bytes)
      : rank_(rank), world_size_(world_size), bytes_(bytes), imported_(world_size, 0) {}
  ~VmmPeerMemory() override {
    for (int r = 0; r < mapped_; ++r)
      ARFUSE_CUDA_LOG_IF_ERROR(cuMemUnmap(base_ + r * stride_, stride_));
    ReleaseImported();
    if (own_ != 0) ARFUSE_CUDA_LOG_IF_ERROR(cuMemRelease(own_));
    if (base_ != 0) ARFUSE_CUDA_LOG_IF_ERROR(cuMemAddressFree(base_, stride_ * world_size_));
  }
  size_t bytes() const override { return stride_; }
  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  void* peer(int r) const override { return reinterpret_cast<void*>(base_ + r * stride_); }
  const char* kind() const override { return fabric_ ? "vmm_fabric" : "vmm_posix_fd"; }
  absl::StatusOr<InStreamRankMemory> ExportForClient(int r) const override {
    if (r < 0 || r >= world_size_) {
      return absl::InvalidArgumentError(absl::StrCat("rank ", r, " is outside the group"));
    }
    InStreamRankMemory m;
    m.bytes = stride_;
    if (fabric_) {
      if (fabric_handles_.size() != static_cast<size_t>(world_size_)) {
        return absl::FailedPreconditionError(absl::StrCat("no FABRIC handle of rank ", r));
      }
      m.kind = instream::MemoryKind::kVmmFabric;
      m.handle = fabric_handles_[r];
      return m;
    }
    if (fds_.size() != static_cast<size_t>(world_size_) || !fds_[r]) {
      return absl::FailedPreconditionError(absl::StrCat("no descriptor of rank ", r));
    }
    m.kind = instream::MemoryKind::kVmmPosixFd;
    m.fd.reset(::fcntl(fds_[r].get(), F_DUPFD_CLOEXEC, 0));
    if (!m.fd) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot duplicate rank ", r, "'s descriptor: ", std::strerror(errno)));
    }
    return m;
  }

  // Creates this rank's allocation; `want_fabric` asks for a FABRIC-exportable one as well.
  absl::Status Create(bool want_fabric, bool fabric_required) {
    int ordinal = 0;
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaGetDevice(&ordinal));
    // Makes the runtime's primary context current, so driver calls below use it.
    ARFUSE_CUDA_RETURN_IF_ERROR(cudaFree(nullptr));
    ARFUSE_CUDA_RETURN_IF_ERROR(cuDeviceGet(&device_, ordinal));
    int fabric_supported = 0;
    ARFUSE_CUDA_RETURN_IF_ERROR(cuDeviceGetAttribute(
        &fabric_supported, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, device_));
    if (fabric_required && !fabric_supported) {
      return absl::FailedPreconditionError("this GPU does not support FABRIC memory handles");
    }
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device_;
    auto types = static_cast<unsigned>(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (want_fabric && fabric_supported) types |= CU_MEM_HANDLE_TYPE_FABRIC;
    prop.requestedHandleTypes = static_cast<CUmemAllocationHandleType>(types);
    size_t granularity = 0;
    ARFUSE_CUDA_RETURN_IF_ERROR(
        cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    stride_ = (bytes_ + granularity - 1) / granularity * granularity;
    granularity_ = granularity;
    CUresult created = cuMemCreate(&own_, stride_, &prop, 0);
    if (created != CUDA_SUCCESS && (types & CU_MEM_HANDLE_TYPE_FABRIC) && !fabric_required) {
      // FABRIC needs the IMEX service on some systems: fall back to POSIX FDs alone.
      spdlog::info("event=vmm_fabric_unavailable stage=create action=posix_fd");
      static_cast<void>(ARFUSE_CUDA_STATUS(created));
      types = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
      prop.requestedHandleTypes = static_cast<CUmemAllocationHandleType>(types);
      created = cuMemCreate(&own_, stride_, &prop, 0);
    }
    ARFUSE_CUDA_RETURN_IF_ERROR(created);
    fabric_capable_ = (types & CU_MEM_HANDLE_TYPE_FABRIC) != 0;
    return absl::OkStatus();
  }

  bool fabric_capable() const { return fabric_capable_; }

  absl::StatusOr<std::string> ExportFabric() {
    CUmemFabricHandle handle;
    ARFUSE_CUDA_RETURN_IF_ERROR(
        cuMemExportToShareableHandle(&handle, own_, CU_MEM_HANDLE_TYPE_FABRIC, 0));
    return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
  }

  absl::Status ImportFabric(const std::vector<std::string>& handles) {
    fabric_handles_ = handles;
    for (int r = 0; r < world_size_; ++r) {
      if (r == rank_) continue;
      if (handles[r].size() != sizeof(CUmemFabricHandle)) {
        return absl::InvalidArgumentError(
            absl::StrCat("fabric handle from rank ", r, " has ", handles[r].size(), " bytes"));
      }
      CUmemFabricHandle handle;
      std::memcpy(&handle, handles[r].data(), sizeof(handle));
      ARFUSE_CUDA_RETURN_IF_ERROR(
          cuMemImportFromShareableHandle(&imported_[r], &handle, CU_MEM_HANDLE_TYPE_FABRIC));
    }
    fabric_ = true;
    return absl::OkStatus();
  }

  absl::StatusOr<int> ExportFd() {
    int fd = -1;
    ARFUSE_CUDA_RETURN_IF_ERROR(
        cuMemExportToShareableHandle(&fd, own_, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    return fd;
  }

  // Takes ownership of the descriptors (kept for clients, closed with this object).
  absl::Status ImportFds(std::vector<int> fds) {
    std::vector<UniqueFd> owned;
    for (int fd : fds) owned.emplace_back(fd);
    if (static_cast<int>(owned.size()) != world_size_) {
      return absl::InternalError(
          absl::StrCat("expected ", world_size_, " descriptors, got ", owned.size()));
    }
    for (int r = 0; r < world_size_; ++r) {
      if (r == rank_) continue;
      void* os_handle = reinterpret_cast<void*>(static_cast<uintptr_t>(owned[r].get()));
      ARFUSE_CUDA_RETURN_IF_ERROR(cuMemImportFromShareableHandle(
          &imported_[r], os_handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    }
    fds_ = std::move(owned);
    fabric_ = false;
    return absl::OkStatus();
  }

  void ReleaseImported() {
    for (CUmemGenericAllocationHandle& h : imported_) {
      if (h != 0) ARFUSE_CUDA_LOG_IF_ERROR(cuMemRelease(h));
      h = 0;
    }
  }

  // Maps every rank's allocation (own and imported) into one VA range, readable and writable
  // from this GPU. Unicast only.
  absl::Status MapAll() {
    ARFUSE_CUDA_RETURN_IF_ERROR(
        cuMemAddressReserve(&base_, stride_ * world_size_, granularity_, 0, 0));
    for (int r = 0; r < world_size_; ++r) {
      CUmemGenericAllocationHandle h = r == rank_ ? own_ : imported_[r];
      ARFUSE_CUDA_RETURN_IF_ERROR(cuMemMap(base_ + r * stride_, stride_, 0, h, 0));
      mapped_ = r + 1;
    }
    CUmemAccessDesc access = {};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device_;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    ARFUSE_CUDA_RETURN_IF_ERROR(cuMemSetAccess(base_, stride_ * world_size_, &access, 1));
    return absl::OkStatus();
  }

 private:
  int rank_;
  int world_size_;
  size_t bytes_;
  size_t stride_ = 0;
  size_t granularity_ = 0;
  CUdevice device_ = 0;
  CUmemGenericAllocationHandle own_ = 0;
  std::vector<CUmemGenericAllocationHandle> imported_;
  CUdeviceptr base_ = 0;
  int mapped_ = 0;
  bool fabric_capable_ = false;
  bool fabric_ = false;
  // Every rank's handle as the group exchanged it, for clients (ExportForClient).
  std::vector<std::string> fabric_handles_;
  std::vector<UniqueFd> fds_;
};

// The FABRIC attempt of kAuto/kFabric. Returns true when every rank imported every peer's
// FABRIC handle; false (kAuto) when any rank could not, with imports released.
absl::StatusOr<bool> TryFabric(VmmPeerMemory& mem, Exchange& exchange, bool required,
                               absl::Time deadline) {
  absl::StatusOr<std::string> exported =
      mem.fabric_capable() ? mem.ExportFabric()
                           : absl::StatusOr<std::string>(absl::FailedPreconditionError(
                                 "allocation is not FABRIC-exportable"));
  if (required) {
    ARFUSE_ASSIGN_OR_RETURN(std::vector<std::string> handles,
                            AllgatherStep(exchange, "vmm.fabric.handles", exported,
                                          "FABRIC handle exchange", deadline));
    ARFUSE_RETURN_IF_ERROR(mem.ImportFabric(handles));
    return true;
  }
  ARFUSE_ASSIGN_OR_RETURN(
      VoteResult can_export,
      exchange.Vote("vmm.fabric.export", exported.ok(),
                    exported.ok() ? "" : std::string(exported.status().message()), deadline));
  if (!can_export.all_yes) return false;
  ARFUSE_ASSIGN_OR_RETURN(
      std::vector<std::string> handles,
      AllgatherStep(exchange, "vmm.fabric.handles", exported, "FABRIC handle exchange", deadline));
  absl::Status imported = mem.ImportFabric(handles);
  ARFUSE_ASSIGN_OR_RETURN(
      VoteResult all_imported,
      exchange.Vote("vmm.fabric.import", imported.ok(),
                    imported.ok() ? "" : std::string(imported.message()), deadline));
  if (!all_imported.all_yes) {
    mem.ReleaseImported();
    spdlog::info("event=vmm_fabric_unavailable stage=import action=posix_fd");
    return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<VmmHandleType> ParseVmmHandleType(absl::string_view name) {
  if (name == "auto") return VmmHandleType::kAuto;
  if (name == "posix_fd") return VmmHandleType::kPosixFd;
  if (name == "fabric") return VmmHandleType::kFabric;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown VMM handle type \"", name, "\" (expected auto, posix_fd or fabric)"));
}

absl::StatusOr<std::unique_ptr<PeerMemory>> CreateIpcPeerMemory(Exchange& exchange, size_t bytes,
                                                                absl::Time deadline) {
  ARFUSE_RETURN_IF_ERROR(CheckGroup(exchange, bytes));
  if (exchange.nnodes() != 1) {
    return absl::FailedPreconditionError("CUDA IPC (trtllm) workspaces need all ranks on one node");
  }
  auto mem = std::make_unique<IpcPeerMemory>(exchange.rank(), exchange.world_size(), bytes);
  absl::StatusOr<std::string> handle = mem->AllocateAndExport();
  ARFUSE_ASSIGN_OR_RETURN(
      std::vector<std::string> handles,
      AllgatherStep(exchange, "ipc.handles", handle, "CUDA IPC handle exchange", deadline));
  absl::Status imported = mem->Import(handles);
  ARFUSE_RETURN_IF_ERROR(StatusStep(exchange, "ipc.opened", imported, "CUDA IPC open", deadline));
  spdlog::info("event=peer_memory_ready kind=cuda_ipc rank={} world_size={} bytes={}",
               exchange.rank(), exchange.world_size(), mem->bytes());
  return std::unique_ptr<PeerMemory>(std::move(mem));
}

absl::StatusOr<std::unique_ptr<PeerMemory>> CreateVmmPeerMemory(Exchange& exchange, size_t bytes,
                                                                VmmHandleType handle_type,
                                                                absl::Time deadline) {
  ARFUSE_RETURN_IF_ERROR(CheckGroup(exchange, bytes));
  if (handle_type == VmmHandleType::kPosixFd && exchange.nnodes() != 1) {
    return absl::FailedPreconditionError(
        "POSIX-FD VMM handles need all ranks on one node; use FABRIC handles across nodes");
  }
  auto mem = std::make_unique<VmmPeerMemory>(exchange.rank(), exchange.world_size(), bytes);
  const bool want_fabric = handle_type != VmmHandleType::kPosixFd;
  const bool fabric_required = handle_type == VmmHandleType::kFabric || exchange.nnodes() != 1;
  absl::Status created = mem->Create(want_fabric, fabric_required);
  ARFUSE_RETURN_IF_ERROR(StatusStep(exchange, "vmm.created", created, "VMM allocation", deadline));
  bool fabric = false;
  if (want_fabric) {
    ARFUSE_ASSIGN_OR_RETURN(fabric, TryFabric(*mem, exchange, fabric_required, deadline));
  }
  if (!fabric) {
    absl::StatusOr<int> fd = mem->ExportFd();
    UniqueFd own_fd(fd.ok() ? *fd : -1);
    ARFUSE_RETURN_IF_ERROR(AllgatherStep(exchange, "vmm.fd.exported",
                                         fd.ok() ? absl::StatusOr<std::string>("")
                                                 : absl::StatusOr<std::string>(fd.status()),
                                         "VMM POSIX-FD export", deadline)
                               .status());
    ARFUSE_ASSIGN_OR_RETURN(std::vector<int> fds,
                            exchange.AllgatherFd("vmm.fd.handles", own_fd.get(), deadline));
    absl::Status imported = mem->ImportFds(std::move(fds));
    ARFUSE_RETURN_IF_ERROR(
        StatusStep(exchange, "vmm.fd.imported", imported, "VMM POSIX-FD import", deadline));
  }
  absl::Status mapped = mem->MapAll();
  ARFUSE_RETURN_IF_ERROR(StatusStep(exchange, "vmm.mapped", mapped, "VMM mapping", deadline));
  spdlog::info("event=peer_memory_ready kind={} rank={} world_size={} bytes={}", mem->kind(),
               exchange.rank(), exchange.world_size(), mem->bytes());
  return std::unique_ptr<PeerMemory>(std::move(mem));
}

}  // namespace arfuse
