// The C ABI of libarfuse_client (arfuse_client.h) over the blob reader, the op rules and the
// device planes. Nothing here throws across the ABI: every entry point catches and reports
// INTERNAL.
#include "client/instream/arfuse_client.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>

#include "client/instream/blob_reader.h"
#include "client/instream/host_plane.h"
#include "client/instream/op_counts.h"
#include "client/instream/op_rules.h"
#include "client/instream/plane.h"
#include "kernels/common/plain_status.h"
#include "kernels/contract/op_contract.h"
#include "kernels/contract/program_key.h"
#include "kernels/host/host_workspace.h"
#include "kernels/instream/attach_abi.h"
#include "kernels/instream/op_counters.h"
#if ARFUSE_CLIENT_CUDA
#include "client/instream/cuda_plane.h"
#endif

#ifndef ARFUSE_CLIENT_VERSION
#error "ARFUSE_CLIENT_VERSION must be defined by the build"
#endif

namespace lib = ::arfuse::instream::lib;
namespace plain = ::arfuse::plain;

struct arfuse_ctx {
  lib::ParsedBlob blob;  // image cleared: it was loaded at attach and is not kept
  std::unique_ptr<lib::Plane> plane;
  // The attachment's op counter page (kernels/instream/op_counters.h); empty when the sidecar
  // handed out none.
  lib::OpCountsMapping counts;
  // arfuse_disable may come from another thread (a session's drain) than the ops'.
  std::atomic<bool> disabled{false};
  // arfuse_set_program_key's; read at every launch (relaxed: the caller orders the set before
  // its ops).
  std::atomic<uint32_t> program_key{0};
  mutable std::mutex mu;
  std::string disabled_reason;
};

static_assert(ARFUSE_OK == static_cast<int>(plain::StatusCode::kOk));
static_assert(ARFUSE_INVALID_ARGUMENT == static_cast<int>(plain::StatusCode::kInvalidArgument));
static_assert(ARFUSE_DEADLINE_EXCEEDED == static_cast<int>(plain::StatusCode::kDeadlineExceeded));
static_assert(ARFUSE_NOT_FOUND == static_cast<int>(plain::StatusCode::kNotFound));
static_assert(ARFUSE_PERMISSION_DENIED == static_cast<int>(plain::StatusCode::kPermissionDenied));
static_assert(ARFUSE_FAILED_PRECONDITION ==
              static_cast<int>(plain::StatusCode::kFailedPrecondition));
static_assert(ARFUSE_ABORTED == static_cast<int>(plain::StatusCode::kAborted));
static_assert(ARFUSE_OUT_OF_RANGE == static_cast<int>(plain::StatusCode::kOutOfRange));
static_assert(ARFUSE_UNIMPLEMENTED == static_cast<int>(plain::StatusCode::kUnimplemented));
static_assert(ARFUSE_INTERNAL == static_cast<int>(plain::StatusCode::kInternal));
static_assert(ARFUSE_UNAVAILABLE == static_cast<int>(plain::StatusCode::kUnavailable));
static_assert(ARFUSE_DTYPE_BF16 == static_cast<int>(arfuse::DType::kBF16));
static_assert(ARFUSE_DTYPE_FP16 == static_cast<int>(arfuse::DType::kFP16));
static_assert(ARFUSE_DTYPE_FP32 == static_cast<int>(arfuse::DType::kFP32));
// Clients send arfuse_client_abi_version() as AttachRequest.attach_abi_version: the C ABI and the
// blob it reads change together.
static_assert(ARFUSE_CLIENT_ABI_VERSION == arfuse::instream::kAttachAbiVersion);
static_assert(ARFUSE_DECLINE_NOT_CONTIGUOUS ==
              static_cast<int>(arfuse::instream::DeclineReason::kNotContiguous));
static_assert(ARFUSE_DECLINE_OTHER == static_cast<int>(arfuse::instream::DeclineReason::kOther));
static_assert(ARFUSE_PATTERN_FP8_PER_GROUP ==
              static_cast<int>(arfuse::Pattern::kAllReduceResidualRmsNormFp8PerGroup));
static_assert(ARFUSE_PROGRAM_KEY_MAX == arfuse::kProgramKeyMax);
static_assert(ARFUSE_PATTERN_FP8_STATIC ==
              static_cast<int>(arfuse::Pattern::kAllReduceResidualRmsNormFp8Static));
static_assert(ARFUSE_SCALE_FP32_ROW_MAJOR ==
              static_cast<int>(arfuse::fp8::GroupScaleLayout::kFp32RowMajor));
static_assert(ARFUSE_SCALE_FP32_MN_MAJOR ==
              static_cast<int>(arfuse::fp8::GroupScaleLayout::kFp32MnMajor));
static_assert(ARFUSE_SCALE_UE8M0_PACKED ==
              static_cast<int>(arfuse::fp8::GroupScaleLayout::kUe8m0Packed));

namespace {

thread_local std::string g_last_error;

int Report(const plain::Status& s) {
  if (s.ok()) return ARFUSE_OK;
  g_last_error.assign(s.message().data(), s.message().size());
  return static_cast<int>(s.code());
}

// Runs `body` (returning plain::Status) with nothing thrown across the C ABI.
template <typename Body>
int Guarded(Body body) {
  try {
    return Report(body());
  } catch (const std::bad_alloc&) {
    return Report(plain::ResourceExhaustedError("out of host memory"));
  } catch (...) {
    return Report(plain::InternalError("unexpected exception in libarfuse_client"));
  }
}

plain::Status CheckUsable(const arfuse_ctx* ctx) {
  if (ctx == nullptr) return plain::InvalidArgumentError("ctx is NULL");
  if (ctx->disabled.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(ctx->mu);
    return plain::UnavailableError(
        plain::StrCat("the in-stream plane is disabled: ", ctx->disabled_reason));
  }
  return plain::OkStatus();
}

// Checks and runs one op, and counts the decision in the attachment's counter page (when it has
// one) before the launch: fused by pattern and token bucket, or declined by reason. A launch that
// fails after the decision counts as fused (the kernels' error word and the sidecar's poisoning
// report it); tokens == 0 runs nothing and counts nothing.
// `enums`: the FP8 entry point's check of its quant and scale_layout arguments (INVALID_ARGUMENT,
// counted as such after the ctx's own checks).
plain::Status RunOp(arfuse_ctx* ctx, void* stream, int pattern, int dtype, lib::OpRequest op,
                    plain::Status enums = plain::OkStatus()) {
  using arfuse::instream::DeclineReason;
  if (ctx == nullptr) return plain::InvalidArgumentError("ctx is NULL");
  auto declined = [ctx](DeclineReason why, plain::Status s) {
    ctx->counts.Declined(why);
    return s;
  };
  if (plain::Status s = CheckUsable(ctx); !s.ok()) {
    return declined(DeclineReason::kDisabled, std::move(s));
  }
  if (!enums.ok()) return declined(DeclineReason::kInvalidArgument, std::move(enums));
  if (plain::Status s = lib::CheckEnums(pattern, dtype); !s.ok()) {
    return declined(DeclineReason::kInvalidArgument, std::move(s));
  }
  op.pattern = static_cast<arfuse::Pattern>(pattern);
  op.dtype = static_cast<arfuse::DType>(dtype);
  if (op.num_tokens == 0) return plain::OkStatus();  // nothing to run, on every rank alike
  DeclineReason why = DeclineReason::kOther;
  plain::StatusOr<lib::Dispatch> d =
      lib::DispatchOp(ctx->blob, *ctx->plane, arfuse::contract::ShapeOf(op), &why);
  if (!d.ok()) return declined(why, d.status());
  if (plain::Status s = lib::CheckTensors(op); !s.ok()) {
    return declined(DeclineReason::kInvalidArgument, std::move(s));
  }
  const std::pair<const void*, const char*> tensors[] = {{op.input, "input"},
                                                         {op.output, "output"},
                                                         {op.residual_in, "residual_in"},
                                                         {op.residual_out, "residual_out"},
                                                         {op.norm_out, "norm_out"},
                                                         {op.gamma, "gamma"},
                                                         {op.quant_out, "quant_out"},
                                                         {op.scale, "scale"}};
  for (const auto& [ptr, name] : tensors) {
    if (ptr == nullptr) continue;  // not a tensor of this pattern (CheckTensors saw the others)
    if (plain::Status s = ctx->plane->CheckPointer(ptr, name); !s.ok()) {
      return declined(DeclineReason::kMemory, std::move(s));
    }
  }
  ctx->counts.Fused(op.pattern, op.num_tokens);
  return ctx->plane->Run(op, *d, ctx->program_key.load(std::memory_order_relaxed), stream);
}

// ARFUSE_INSTREAM_PDL=0|1 replaces the sidecar's choice of programmatic dependent launches for
// this process's launches (unset or empty: the sidecar's). What the overlap saves is measured with
// it; where ranks share a GPU the sidecar chooses off, because a dependent grid launched early
// holds SMs that another rank's grid may need to become resident: forcing it on there is for
// measurement with grids that fit beside each other.
plain::Status ApplyPdlOverride(arfuse::instream::AttachHeader* header) {
  const char* v = std::getenv("ARFUSE_INSTREAM_PDL");
  if (v == nullptr || *v == '\0') return plain::OkStatus();
  const std::string_view value(v);
  if (value != "0" && value != "1") {
    return plain::InvalidArgumentError(
        plain::StrCat("ARFUSE_INSTREAM_PDL must be 0 or 1 (or unset: the sidecar's choice), got \"",
                      value.substr(0, 32), "\""));
  }
  header->pdl = value == "1" ? 1 : 0;
  return plain::OkStatus();
}

plain::Status Attach(const void* blob, size_t blob_bytes, const int* fds, size_t num_fds,
                     arfuse_ctx** out) {
  if (out == nullptr) return plain::InvalidArgumentError("out is NULL");
  *out = nullptr;
  if (num_fds > 0 && fds == nullptr) {
    return plain::InvalidArgumentError(plain::StrCat("fds is NULL with num_fds ", num_fds));
  }
  plain::StatusOr<lib::ParsedBlob> parsed = lib::ParseAttachBlob(blob, blob_bytes, num_fds);
  if (!parsed.ok()) return parsed.status();
  if (plain::Status s = ApplyPdlOverride(&parsed->header); !s.ok()) return s;
  auto ctx = std::make_unique<arfuse_ctx>();
  if (parsed->device() == arfuse::instream::DeviceKind::kHost) {
    plain::StatusOr<std::unique_ptr<lib::HostPlane>> plane = lib::HostPlane::Attach(*parsed, fds);
    if (!plane.ok()) return plane.status();
    ctx->plane = std::move(*plane);
  } else {
#if ARFUSE_CLIENT_CUDA
    if (plain::Status s = lib::CheckCudaBlob(*parsed); !s.ok()) return s;
    plain::StatusOr<std::unique_ptr<lib::Plane>> plane = lib::AttachCuda(*parsed, fds);
    if (!plane.ok()) return plane.status();
    ctx->plane = std::move(*plane);
#else
    return plain::UnimplementedError(
        "this libarfuse_client was built without CUDA: only host-mode sidecars can be attached");
#endif
  }
  if (parsed->header.counters_fd_index >= 0) {
    plain::StatusOr<lib::OpCountsMapping> counts =
        lib::OpCountsMapping::Map(fds[parsed->header.counters_fd_index]);
    if (!counts.ok()) return counts.status();
    ctx->counts = std::move(*counts);
  }
  ctx->blob = std::move(*parsed);
  ctx->blob.image = nullptr;
  *out = ctx.release();
  return plain::OkStatus();
}

}  // namespace

// The C ABI: the only symbols the library exports (default visibility here, exports.map keeps
// everything else local).
#pragma GCC visibility push(default)
extern "C" {

uint32_t arfuse_client_abi_version(void) { return ARFUSE_CLIENT_ABI_VERSION; }
uint32_t arfuse_launch_abi_version(void) { return arfuse::instream::kLaunchAbiVersion; }
uint32_t arfuse_launch_args_bytes(void) { return arfuse::instream::kLaunchArgsBytes; }
const char* arfuse_client_version(void) { return ARFUSE_CLIENT_VERSION; }

const char* arfuse_last_error(void) { return g_last_error.c_str(); }

int arfuse_attach(const void* blob, size_t blob_bytes, const int* fds, size_t num_fds,
                  arfuse_ctx** out) {
  return Guarded([&] { return Attach(blob, blob_bytes, fds, num_fds, out); });
}

int arfuse_detach(arfuse_ctx* ctx) {
  return Guarded([&] {
    delete ctx;
    return plain::OkStatus();
  });
}

int arfuse_ctx_get_info(const arfuse_ctx* ctx, arfuse_ctx_info* info) {
  return Guarded([&]() -> plain::Status {
    if (ctx == nullptr) return plain::InvalidArgumentError("ctx is NULL");
    if (info == nullptr) return plain::InvalidArgumentError("info is NULL");
    if (info->struct_bytes < sizeof(info->struct_bytes)) {
      return plain::InvalidArgumentError("info->struct_bytes must be sizeof(arfuse_ctx_info)");
    }
    const arfuse::instream::AttachHeader& h = ctx->blob.header;
    arfuse_ctx_info full;
    std::memset(&full, 0, sizeof(full));
    full.struct_bytes = info->struct_bytes < sizeof(full) ? info->struct_bytes : sizeof(full);
    full.device_kind = h.device_kind;
    full.rank = h.rank;
    full.world_size = h.world_size;
    full.generation = h.generation;
    full.attach_id = h.attach_id;
    full.max_tokens = h.max_tokens;
    full.hidden = h.hidden;
    full.dtype = h.dtype;
    full.sm = ctx->plane->sm();
    full.oneshot_max_bytes = h.oneshot_max_bytes;
    full.twoshot_max_bytes = h.twoshot_max_bytes;
    full.image_bytes = h.image_bytes;
    full.num_entries = h.num_entries;
    full.pdl = h.pdl;
    // An older caller's shorter struct gets the fields it knows.
    std::memcpy(info, &full, full.struct_bytes);
    return plain::OkStatus();
  });
}

int arfuse_supports(const arfuse_ctx* ctx, int pattern, uint32_t tokens, uint32_t hidden,
                    int dtype) {
  return Guarded([&]() -> plain::Status {
    if (plain::Status s = CheckUsable(ctx); !s.ok()) return s;
    if (plain::Status s = lib::CheckEnums(pattern, dtype); !s.ok()) return s;
    const auto p = static_cast<arfuse::Pattern>(pattern);
    // Every scale layout of the per-group pattern is fused alike: the answer holds for each.
    const uint8_t layout = arfuse::TraitsOf(p).quant == arfuse::QuantKind::kPerGroup
                               ? static_cast<uint8_t>(arfuse::fp8::GroupScaleLayout::kFp32RowMajor)
                               : uint8_t{0};
    return lib::DispatchOp(ctx->blob, *ctx->plane,
                           arfuse::contract::OpShape{static_cast<arfuse::DType>(dtype), hidden,
                                                     tokens, p, layout})
        .status();
  });
}

int arfuse_fused_allreduce_residual_rmsnorm(arfuse_ctx* ctx, void* stream, const void* input,
                                            const void* residual_in, void* residual_out,
                                            void* norm_out, const void* gamma, uint32_t tokens,
                                            uint32_t hidden, int dtype, float eps) {
  return Guarded([&] {
    lib::OpRequest op;
    op.num_tokens = tokens;
    op.hidden = hidden;
    op.eps = eps;
    op.input = input;
    op.residual_in = residual_in;
    op.residual_out = residual_out;
    op.norm_out = norm_out;
    op.gamma = gamma;
    return RunOp(ctx, stream, static_cast<int>(arfuse::Pattern::kAllReduceResidualRmsNorm), dtype,
                 op);
  });
}

int arfuse_fused_allreduce_residual_rmsnorm_fp8(arfuse_ctx* ctx, void* stream, const void* input,
                                                const void* residual_in, void* residual_out,
                                                void* norm_out, void* quant_out, void* scale,
                                                const void* gamma, uint32_t tokens, uint32_t hidden,
                                                int dtype, float eps, int quant, int scale_layout) {
  return Guarded([&] {
    plain::StatusOr<arfuse::Pattern> pattern = lib::Fp8PatternOf(quant, scale_layout);
    lib::OpRequest op;
    op.num_tokens = tokens;
    op.hidden = hidden;
    op.eps = eps;
    op.input = input;
    op.residual_in = residual_in;
    op.residual_out = residual_out;
    op.norm_out = norm_out;
    op.gamma = gamma;
    op.quant_out = quant_out;
    op.scale = scale;
    op.scale_layout = pattern.ok() ? static_cast<uint8_t>(scale_layout) : uint8_t{0};
    return RunOp(ctx, stream, pattern.ok() ? static_cast<int>(*pattern) : 0, dtype, op,
                 pattern.status());
  });
}

int arfuse_fused_allreduce(arfuse_ctx* ctx, void* stream, const void* input, void* output,
                           uint32_t tokens, uint32_t hidden, int dtype) {
  return Guarded([&] {
    lib::OpRequest op;
    op.num_tokens = tokens;
    op.hidden = hidden;
    op.eps = 0.0f;  // unused by the sum; the same on every rank (the ranks' op descriptors agree)
    op.input = input;
    op.output = output;
    return RunOp(ctx, stream, static_cast<int>(arfuse::Pattern::kAllReduce), dtype, op);
  });
}

int arfuse_check(arfuse_ctx* ctx, uint32_t* code) {
  return Guarded([&]() -> plain::Status {
    if (ctx == nullptr) return plain::InvalidArgumentError("ctx is NULL");
    const uint32_t c = ctx->plane->ErrorCode();
    if (code != nullptr) *code = c;
    if (c == 0) return plain::OkStatus();
    if (c == arfuse::instream::kErrorStaleGeneration || c == arfuse::instream::kErrorLaunchAbi) {
      return plain::FailedPreconditionError(plain::StrCat(
          "a launch was refused (", arfuse_error_name(c),
          c == arfuse::instream::kErrorStaleGeneration
              ? "): the workspace was re-initialized; attach again (and capture graphs again)"
              : "): the kernels read another launch ABI; attach again"));
    }
    return plain::AbortedError(
        plain::StrCat("a fused op failed (", arfuse_error_name(c),
                      "): the workspace is poisoned; attach again once the sidecars "
                      "re-initialized it"));
  });
}

int arfuse_set_program_key(arfuse_ctx* ctx, uint32_t key) {
  return Guarded([&]() -> plain::Status {
    if (ctx == nullptr) return plain::InvalidArgumentError("ctx is NULL");
    if (key > arfuse::kProgramKeyMax) {
      return plain::InvalidArgumentError(plain::StrCat("the program key has bits above the low ",
                                                       arfuse::kProgramKeyBits, " (at most ",
                                                       arfuse::kProgramKeyMax, ")"));
    }
    ctx->program_key.store(key, std::memory_order_relaxed);
    return plain::OkStatus();
  });
}

int arfuse_disable(arfuse_ctx* ctx, const char* reason) {
  return Guarded([&]() -> plain::Status {
    if (ctx == nullptr) return plain::InvalidArgumentError("ctx is NULL");
    {
      std::lock_guard<std::mutex> lock(ctx->mu);
      ctx->disabled_reason = reason != nullptr && reason[0] != '\0' ? reason : "disabled";
    }
    ctx->disabled.store(true, std::memory_order_release);
    return plain::OkStatus();
  });
}

int arfuse_note_declined(arfuse_ctx* ctx, int reason) {
  return Guarded([&]() -> plain::Status {
    if (ctx == nullptr) return plain::InvalidArgumentError("ctx is NULL");
    if (reason < 0 || reason >= static_cast<int>(arfuse::instream::kDeclineReasons)) {
      return plain::InvalidArgumentError(plain::StrCat("decline reason ", reason,
                                                       " is not one of ARFUSE_DECLINE_* (0..",
                                                       arfuse::instream::kDeclineReasons - 1, ")"));
    }
    ctx->counts.Declined(static_cast<arfuse::instream::DeclineReason>(reason));
    return plain::OkStatus();
  });
}

const char* arfuse_error_name(uint32_t code) {
  // The one device error table's names (kernels/contract/device_errors.h): the kernels' codes,
  // the host collective's (a subset) and the in-stream launch's own.
  return arfuse::DeviceErrorName(code);
}

}  // extern "C"
#pragma GCC visibility pop
