#include "client/instream/cuda_plane.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "client/instream/cuda_driver.h"
#include "kernels/contract/op_contract.h"
#include "kernels/instream/launch_abi.h"

namespace arfuse::instream::lib {

// The in-stream launch's own error codes are the device error table's (one table, one numbering:
// kernels/contract/device_errors.h); the image's kernels write them.
static_assert(kErrorStaleGeneration == static_cast<uint32_t>(DeviceError::kStaleGeneration));
static_assert(kErrorLaunchAbi == static_cast<uint32_t>(DeviceError::kLaunchAbi));

namespace {

WorkspaceLayout LayoutOf(const AttachHeader& h) {
  static_assert(sizeof(WorkspaceLayout) == sizeof(h.layout));
  WorkspaceLayout l;
  std::memcpy(&l, h.layout, sizeof(l));
  return l;
}

plain::Status DriverError(const CudaDriver& d, CUresult r, std::string_view what) {
  const std::string msg = plain::StrCat(what, ": ", d.ErrorName(r));
  switch (r) {
    case CUDA_ERROR_INVALID_VALUE:
    case CUDA_ERROR_INVALID_HANDLE:
    case CUDA_ERROR_INVALID_CONTEXT:
      return plain::InvalidArgumentError(msg);
    case CUDA_ERROR_OUT_OF_MEMORY:
    case CUDA_ERROR_TOO_MANY_PEERS:
      return plain::ResourceExhaustedError(msg);
    case CUDA_ERROR_NO_BINARY_FOR_GPU:
    case CUDA_ERROR_UNSUPPORTED_PTX_VERSION:
    case CUDA_ERROR_NOT_SUPPORTED:
    case CUDA_ERROR_NOT_PERMITTED:
    case CUDA_ERROR_PEER_ACCESS_UNSUPPORTED:
    case CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED:
    case CUDA_ERROR_STREAM_CAPTURE_INVALIDATED:
    case CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD:
      return plain::FailedPreconditionError(msg);
    default:
      return plain::InternalError(msg);
  }
}

std::string UuidText(const uint8_t* u) {
  std::string s;
  for (int i = 0; i < 16; ++i) {
    plain::StrAppend(&s, (i == 4 || i == 6 || i == 8 || i == 10) ? "-" : "", plain::Hex2(u[i]));
  }
  return s;
}

// Makes `ctx` current on this thread for a scope when it is not (and restores the caller's).
class ScopedContext {
 public:
  ScopedContext(const CudaDriver& d, CUcontext ctx) : d_(d) {
    CUcontext cur = nullptr;
    if (d_.CtxGetCurrent(&cur) == CUDA_SUCCESS && cur != ctx) {
      pushed_ = d_.CtxPushCurrent(ctx) == CUDA_SUCCESS;
    }
  }
  ~ScopedContext() {
    if (pushed_) {
      CUcontext popped = nullptr;
      d_.CtxPopCurrent(&popped);
    }
  }
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;

 private:
  const CudaDriver& d_;
  bool pushed_ = false;
};

// RAII owners. Destructors release without synchronizing (arfuse_detach's contract: the caller's
// launches on these mappings have finished).
class PeerMapping {
 public:
  virtual ~PeerMapping() = default;
  CUdeviceptr ptr() const { return ptr_; }

 protected:
  CUdeviceptr ptr_ = 0;
};

class IpcMapping final : public PeerMapping {
 public:
  static plain::StatusOr<std::unique_ptr<PeerMapping>> Open(const CudaDriver& d,
                                                            const RankMemory& m, uint32_t rank) {
    CUipcMemHandle handle;
    static_assert(sizeof(handle) == sizeof(m.handle));
    std::memcpy(&handle, m.handle, sizeof(handle));
    auto out = std::unique_ptr<IpcMapping>(new IpcMapping(d));
    if (CUresult r = d.IpcOpenMemHandle(&out->ptr_, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
        r != CUDA_SUCCESS) {
      out->ptr_ = 0;
      return DriverError(d, r,
                         plain::StrCat("rank ", rank, "'s workspace (CUDA IPC) cannot be opened"));
    }
    return std::unique_ptr<PeerMapping>(std::move(out));
  }
  ~IpcMapping() override {
    if (ptr_ != 0) d_.IpcCloseMemHandle(ptr_);
  }

 private:
  explicit IpcMapping(const CudaDriver& d) : d_(d) {}
  const CudaDriver& d_;
};

class VmmMapping final : public PeerMapping {
 public:
  static plain::StatusOr<std::unique_ptr<PeerMapping>> Import(const CudaDriver& d,
                                                              const RankMemory& m, uint32_t rank,
                                                              const int* fds, CUdevice device) {
    auto out = std::unique_ptr<VmmMapping>(new VmmMapping(d, m.bytes));
    const bool fabric = static_cast<MemoryKind>(m.kind) == MemoryKind::kVmmFabric;
    const std::string what =
        plain::StrCat("rank ", rank, "'s workspace (VMM ", fabric ? "FABRIC" : "POSIX FD", ")");
    CUresult r;
    if (fabric) {
      CUmemFabricHandle handle;
      static_assert(sizeof(handle) == sizeof(m.handle));
      std::memcpy(&handle, m.handle, sizeof(handle));
      r = d.MemImportFromShareableHandle(&out->handle_, &handle, CU_MEM_HANDLE_TYPE_FABRIC);
    } else {
      // The driver does not take the descriptor: the caller closes its own.
      void* os_handle = reinterpret_cast<void*>(static_cast<uintptr_t>(fds[m.fd_index]));
      r = d.MemImportFromShareableHandle(&out->handle_, os_handle,
                                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    }
    if (r != CUDA_SUCCESS) {
      out->handle_ = 0;
      return DriverError(d, r, plain::StrCat(what, " cannot be imported"));
    }
    out->imported_ = true;
    if (r = d.MemAddressReserve(&out->ptr_, m.bytes, 0, 0, 0); r != CUDA_SUCCESS) {
      out->ptr_ = 0;
      return DriverError(d, r, plain::StrCat(what, ": no address range of ", m.bytes, " bytes"));
    }
    if (r = d.MemMap(out->ptr_, m.bytes, 0, out->handle_, 0); r != CUDA_SUCCESS) {
      return DriverError(d, r, plain::StrCat(what, " cannot be mapped (", m.bytes, " bytes)"));
    }
    out->mapped_ = true;
    CUmemAccessDesc access = {};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (r = d.MemSetAccess(out->ptr_, m.bytes, &access, 1); r != CUDA_SUCCESS) {
      return DriverError(d, r, plain::StrCat(what, ": this GPU may not access it"));
    }
    return std::unique_ptr<PeerMapping>(std::move(out));
  }
  ~VmmMapping() override {
    if (mapped_) d_.MemUnmap(ptr_, bytes_);
    if (ptr_ != 0) d_.MemAddressFree(ptr_, bytes_);
    if (imported_) d_.MemRelease(handle_);
  }

 private:
  VmmMapping(const CudaDriver& d, uint64_t bytes) : d_(d), bytes_(bytes) {}
  const CudaDriver& d_;
  uint64_t bytes_;
  CUmemGenericAllocationHandle handle_ = 0;
  bool imported_ = false;
  bool mapped_ = false;
};

class CudaPlane final : public Plane {
 public:
  CudaPlane(const CudaDriver& d, const ParsedBlob& blob) : d_(d), header_(blob.header) {
    layout_ = LayoutOf(header_);
  }

  // Members are released in the context they were made in, then the caller's is restored
  // (pop_ is declared first, so it is destroyed last).
  ~CudaPlane() override {
    if (ctx_ != nullptr) {
      CUcontext cur = nullptr;
      if (d_.CtxGetCurrent(&cur) == CUDA_SUCCESS && cur != ctx_) {
        pop_.pushed = d_.CtxPushCurrent(ctx_) == CUDA_SUCCESS;
      }
    }
    if (module_ != nullptr) d_.ModuleUnload(module_);
    if (error_host_ != nullptr) d_.MemFreeHost(const_cast<uint32_t*>(error_host_));
  }

  plain::Status Attach(const ParsedBlob& blob, const int* fds) {
    CUresult r = d_.CtxGetCurrent(&ctx_);
    if (r != CUDA_SUCCESS || ctx_ == nullptr) {
      ctx_ = nullptr;
      return plain::FailedPreconditionError(
          "no current CUDA context on this thread: make the rank's GPU current first "
          "(torch.cuda.set_device, or cudaSetDevice + cudaFree(0))");
    }
    if (r = d_.CtxGetDevice(&device_); r != CUDA_SUCCESS) {
      return DriverError(d_, r, "the current context's device cannot be read");
    }
    CUuuid uuid;
    if (r = d_.DeviceGetUuid(&uuid, device_); r != CUDA_SUCCESS) {
      return DriverError(d_, r, "the current GPU's UUID cannot be read");
    }
    static_assert(sizeof(uuid.bytes) == sizeof(header_.gpu_uuid));
    if (std::memcmp(uuid.bytes, header_.gpu_uuid, sizeof(uuid.bytes)) != 0) {
      return plain::FailedPreconditionError(plain::StrCat(
          "the current CUDA context is on another GPU (GPU-",
          UuidText(reinterpret_cast<const uint8_t*>(uuid.bytes)), ") than the sidecar's (GPU-",
          UuidText(header_.gpu_uuid), "): make the rank's GPU current before attaching"));
    }
    int major = 0, minor = 0;
    d_.DeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device_);
    d_.DeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device_);
    sm_ = static_cast<uint32_t>(major * 10 + minor);

    // The error word the kernels mirror their error code into (FusionParams::host_error).
    void* word = nullptr;
    if (r = d_.MemHostAlloc(&word, sizeof(uint32_t),
                            CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE);
        r != CUDA_SUCCESS) {
      return DriverError(d_, r, "the host-mapped error word cannot be allocated");
    }
    error_host_ = static_cast<volatile uint32_t*>(word);
    *error_host_ = 0;
    if (r = d_.MemHostGetDevicePointer(&error_device_, word, 0); r != CUDA_SUCCESS) {
      return DriverError(d_, r, "the host-mapped error word has no device address");
    }

    for (uint32_t q = 0; q < header_.world_size; ++q) {
      const RankMemory& m = blob.ranks[q];
      plain::StatusOr<std::unique_ptr<PeerMapping>> mapped =
          static_cast<MemoryKind>(m.kind) == MemoryKind::kCudaIpc
              ? IpcMapping::Open(d_, m, q)
              : VmmMapping::Import(d_, m, q, fds, device_);
      if (!mapped.ok()) return mapped.status();
      peers_.push_back(std::move(*mapped));
    }

    // cuModuleLoadData reads the fatbin in place: give it 16-byte aligned bytes.
    std::vector<uint64_t> aligned;
    const void* image = blob.image;
    if (reinterpret_cast<uintptr_t>(image) % 16 != 0) {
      aligned.resize((blob.image_bytes + 7) / 8 + 1);
      std::memcpy(aligned.data(), blob.image, blob.image_bytes);
      image = aligned.data();
    }
    if (r = d_.ModuleLoadData(&module_, image); r != CUDA_SUCCESS) {
      module_ = nullptr;
      return DriverError(d_, r,
                         plain::StrCat("the sidecar's kernel image (", blob.image_bytes,
                                       " bytes) cannot be loaded on this GPU (sm_", sm_, ")"));
    }
    // Every function loaded now: with lazy loading, a kernel first launched while another one
    // spins on it could wait for the spinning one to finish (and never run).
    functions_.resize(blob.entries.size());
    for (size_t i = 0; i < blob.entries.size(); ++i) {
      const KernelEntry& e = blob.entries[i];
      if (r = d_.ModuleGetFunction(&functions_[i], module_, e.function); r != CUDA_SUCCESS) {
        return DriverError(
            d_, r,
            plain::StrCat("entry ", i, "'s function ", e.function, " is not in the kernel image"));
      }
      if (d_.FuncLoad != nullptr) {
        if (r = d_.FuncLoad(functions_[i]); r != CUDA_SUCCESS) {
          return DriverError(d_, r, plain::StrCat("entry ", i, "'s function cannot be loaded"));
        }
      }
      int max_threads = 0;
      if (r = d_.FuncGetAttribute(&max_threads, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
                                  functions_[i]);
          r != CUDA_SUCCESS) {
        return DriverError(d_, r, plain::StrCat("entry ", i, "'s function cannot be loaded"));
      }
      if (static_cast<uint32_t>(max_threads) < e.block_threads) {
        return plain::FailedPreconditionError(
            plain::StrCat("entry ", i, "'s function runs at most ", max_threads,
                          " threads per block, the entry asks for ", e.block_threads));
      }
    }
    return plain::OkStatus();
  }

  plain::Status CheckCapacity(uint32_t tokens, uint32_t hidden, DType dtype) const override {
    return CheckCudaCapacity(header_, tokens, hidden, dtype);
  }

  plain::Status CheckPointer(const void* ptr, const char* name) override {
    CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                   CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                   CU_POINTER_ATTRIBUTE_IS_MANAGED};
    unsigned int memory_type = 0;
    int ordinal = -1;
    unsigned int managed = 0;  // the driver may write a bool: zeroed, any nonzero byte is true
    void* data[] = {&memory_type, &ordinal, &managed};
    if (CUresult r = d_.PointerGetAttributes(3, attrs, data, reinterpret_cast<CUdeviceptr>(ptr));
        r != CUDA_SUCCESS) {
      return plain::InvalidArgumentError(
          plain::StrCat(name, " cannot be checked: cuPointerGetAttributes: ", d_.ErrorName(r)));
    }
    if (managed != 0) {
      return plain::InvalidArgumentError(
          plain::StrCat(name, " is managed memory: the kernels need device memory of this GPU"));
    }
    if (memory_type != CU_MEMORYTYPE_DEVICE) {
      return plain::InvalidArgumentError(plain::StrCat(
          name,
          memory_type == CU_MEMORYTYPE_HOST ? " is pinned host memory"
                                            : " is not CUDA memory (host or unregistered)",
          ": the kernels need device memory of this GPU"));
    }
    if (ordinal != device_) {
      return plain::InvalidArgumentError(plain::StrCat(name, " is memory of GPU ", ordinal,
                                                       ", not of this attachment's GPU ",
                                                       static_cast<int>(device_)));
    }
    return plain::OkStatus();
  }

  plain::Status Run(const OpRequest& op, const Dispatch& d, uint32_t program_key,
                    void* stream) override {
    InStreamLaunchArgs args;
    std::memset(&args, 0, sizeof(args));
    void* peers[kMaxWorldSize] = {};
    for (uint32_t q = 0; q < header_.world_size; ++q) {
      peers[q] = reinterpret_cast<void*>(peers_[q]->ptr());
    }
    FusionLaunchSite site;
    site.peer_workspace = peers;
    site.rank = static_cast<int32_t>(header_.rank);
    site.world_size = static_cast<int32_t>(header_.world_size);
    site.layout = layout_;
    site.spin_timeout_ns = header_.spin_timeout_ns;
    site.sm_budget = header_.sm_budget;
    site.host_abort = nullptr;  // the sidecar aborts through the workspace's own abort word
    site.host_error = reinterpret_cast<uint32_t*>(error_device_);
    args.fusion = MakeFusionParams(op, static_cast<FusionAlgo>(d.algo), site);
    std::memcpy(args.kernel_config, header_.kernel_config, sizeof(args.kernel_config));
    args.abi_version = kLaunchAbiVersion;
    args.generation = header_.generation;
    args.counter_slot = header_.counter_slot;
    args.program_key = program_key;

    const KernelEntry& e = *d.entry;
    const uint32_t blocks = (op.num_tokens + e.rows_divisor - 1) / e.rows_divisor;
    CUlaunchAttribute attr[1];
    std::memset(attr, 0, sizeof(attr));
    attr[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr[0].value.programmaticStreamSerializationAllowed = 1;
    CUlaunchConfig config;
    std::memset(&config, 0, sizeof(config));
    config.gridDimX = std::clamp<uint32_t>(blocks, 1, e.max_grid);
    config.gridDimY = 1;
    config.gridDimZ = 1;
    config.blockDimX = e.block_threads;
    config.blockDimY = 1;
    config.blockDimZ = 1;
    config.sharedMemBytes = 0;
    config.hStream = static_cast<CUstream>(stream);
    config.attrs = header_.pdl != 0 ? attr : nullptr;
    config.numAttrs = header_.pdl != 0 ? 1 : 0;
    void* params[] = {&args};
    const CUfunction fn = functions_[d.entry_index];
    ScopedContext scope(d_, ctx_);
    if (CUresult r = d_.LaunchKernelEx(&config, fn, params, nullptr); r != CUDA_SUCCESS) {
      return DriverError(d_, r, "cuLaunchKernelEx of the fused kernel failed");
    }
    return plain::OkStatus();
  }

  uint32_t ErrorCode() const override { return error_host_ != nullptr ? *error_host_ : 0; }
  uint32_t sm() const override { return sm_; }

 private:
  struct Popper {
    const CudaDriver* d;
    bool pushed = false;
    ~Popper() {
      if (pushed) {
        CUcontext popped = nullptr;
        d->CtxPopCurrent(&popped);
      }
    }
  };

  const CudaDriver& d_;
  Popper pop_{&d_};
  const AttachHeader header_;
  WorkspaceLayout layout_{};
  CUcontext ctx_ = nullptr;
  CUdevice device_ = 0;
  uint32_t sm_ = 0;
  volatile uint32_t* error_host_ = nullptr;
  CUdeviceptr error_device_ = 0;
  std::vector<std::unique_ptr<PeerMapping>> peers_;
  CUmodule module_ = nullptr;
  std::vector<CUfunction> functions_;
};

}  // namespace

plain::Status CheckCudaCapacity(const AttachHeader& h, uint32_t tokens, uint32_t hidden,
                                DType dtype) {
  return contract::CheckFits(LayoutOf(h), contract::OpShape{dtype, hidden, tokens});
}

plain::Status CheckCudaBlob(const ParsedBlob& blob) {
  const AttachHeader& h = blob.header;
  const WorkspaceLayout l = LayoutOf(h);
  auto bad = [](std::string_view what) {
    return plain::InvalidArgumentError(plain::StrCat("attach blob: ", what));
  };
  if (l.total_bytes == 0) return bad("layout.total_bytes is 0 (no workspace layout)");
  if (l.world_size != static_cast<int32_t>(h.world_size)) {
    return bad(plain::StrCat("layout.world_size ", l.world_size, " differs from world_size ",
                             h.world_size));
  }
  if (static_cast<uint32_t>(l.dtype) != h.dtype) {
    return bad(
        plain::StrCat("layout.dtype ", static_cast<int>(l.dtype), " differs from dtype ", h.dtype));
  }
  if (l.max_tokens != h.max_tokens || l.hidden != h.hidden) {
    return bad(plain::StrCat("layout's ", l.max_tokens, " tokens x ", l.hidden,
                             " hidden differ from the header's ", h.max_tokens, " x ", h.hidden));
  }
  for (uint32_t q = 0; q < h.world_size; ++q) {
    if (blob.ranks[q].bytes < l.total_bytes) {
      return bad(plain::StrCat("rank ", q, "'s memory bytes ", blob.ranks[q].bytes,
                               " is below layout.total_bytes ", l.total_bytes));
    }
  }
  return plain::OkStatus();
}

plain::StatusOr<std::unique_ptr<Plane>> AttachCuda(const ParsedBlob& blob, const int* fds) {
  plain::StatusOr<const CudaDriver*> d = CudaDriver::Get();
  if (!d.ok()) return d.status();
  auto plane = std::make_unique<CudaPlane>(**d, blob);
  if (plain::Status s = plane->Attach(blob, fds); !s.ok()) return s;
  return std::unique_ptr<Plane>(std::move(plane));
}

}  // namespace arfuse::instream::lib
