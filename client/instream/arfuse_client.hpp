// C++ view of libarfuse_client (arfuse_client.h): an RAII attachment and absl::Status results.
// Header-only over the C ABI, so a C++ caller links libarfuse_client.so and nothing else of it.
// The control path (Fusion.Attach, the descriptors) is client/cpp/instream_attach.h's.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/instream/arfuse_client.h"
#include "kernels/common/op_types.h"

namespace arfuse::instream {

// The status of a C ABI return code, with arfuse_last_error()'s message when it failed.
inline absl::Status ToStatus(int rc) {
  if (rc == ARFUSE_OK) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(rc), arfuse_last_error());
}

// Whether `s` means "run the framework's own path for this op" (the op is outside what the
// attachment fuses, or the attachment is disabled) rather than a failure.
inline bool IsFusionUnavailable(const absl::Status& s) {
  return absl::IsOutOfRange(s) || absl::IsUnavailable(s);
}

// One attachment (arfuse_ctx). Move-only; detaches in its destructor, so it must outlive every
// launch it made and every graph that captured one (arfuse_detach's contract).
class InStreamContext {
 public:
  // arfuse_attach: `blob` is Fusion.AttachResponse.attach_blob, `fds` the descriptors picked up
  // with its ticket, in order (the caller keeps and closes them).
  static absl::StatusOr<InStreamContext> Attach(std::string_view blob,
                                                const std::vector<int>& fds = {}) {
    arfuse_ctx* ctx = nullptr;
    if (absl::Status s =
            ToStatus(arfuse_attach(blob.data(), blob.size(), fds.data(), fds.size(), &ctx));
        !s.ok()) {
      return s;
    }
    return InStreamContext(ctx);
  }

  InStreamContext() = default;
  InStreamContext(InStreamContext&& other) noexcept : ctx_(std::exchange(other.ctx_, nullptr)) {}
  InStreamContext& operator=(InStreamContext&& other) noexcept {
    if (this != &other) {
      Reset();
      ctx_ = std::exchange(other.ctx_, nullptr);
    }
    return *this;
  }
  InStreamContext(const InStreamContext&) = delete;
  InStreamContext& operator=(const InStreamContext&) = delete;
  ~InStreamContext() { Reset(); }

  // Detaches now (see the class comment); a no-op when empty.
  void Reset() {
    if (ctx_ != nullptr) arfuse_detach(std::exchange(ctx_, nullptr));
  }

  bool valid() const { return ctx_ != nullptr; }
  arfuse_ctx* get() const { return ctx_; }

  absl::StatusOr<arfuse_ctx_info> Info() const {
    arfuse_ctx_info info{};
    info.struct_bytes = sizeof(info);
    if (absl::Status s = ToStatus(arfuse_ctx_get_info(ctx_, &info)); !s.ok()) return s;
    return info;
  }

  // OK, OUT_OF_RANGE ("fusion unavailable for this op: ...") or UNAVAILABLE (disabled).
  absl::Status Supports(Pattern pattern, uint32_t tokens, uint32_t hidden, DType dtype) const {
    return ToStatus(
        arfuse_supports(ctx_, static_cast<int>(pattern), tokens, hidden, static_cast<int>(dtype)));
  }

  // `stream`: a CUstream / cudaStream_t (ignored in host mode).
  absl::Status FusedAllReduceResidualRmsNorm(void* stream, const void* input,
                                             const void* residual_in, void* residual_out,
                                             void* norm_out, const void* gamma, uint32_t tokens,
                                             uint32_t hidden, DType dtype, float eps) {
    return ToStatus(arfuse_fused_allreduce_residual_rmsnorm(ctx_, stream, input, residual_in,
                                                            residual_out, norm_out, gamma, tokens,
                                                            hidden, static_cast<int>(dtype), eps));
  }

  absl::Status FusedAllReduce(void* stream, const void* input, void* output, uint32_t tokens,
                              uint32_t hidden, DType dtype) {
    return ToStatus(arfuse_fused_allreduce(ctx_, stream, input, output, tokens, hidden,
                                           static_cast<int>(dtype)));
  }

  // arfuse_check: OK while healthy; FAILED_PRECONDITION (attach again) or ABORTED (poisoned).
  // `code` (optional) receives the kernel's error code (arfuse_error_name).
  absl::Status Check(uint32_t* code = nullptr) {
    uint32_t c = 0;
    absl::Status s = ToStatus(arfuse_check(ctx_, &c));
    if (code != nullptr) *code = c;
    return s;
  }

  // arfuse_set_program_key: every rank of the program sets the same key before its first op.
  absl::Status SetProgramKey(uint32_t key) { return ToStatus(arfuse_set_program_key(ctx_, key)); }

  absl::Status Disable(const std::string& reason) {
    return ToStatus(arfuse_disable(ctx_, reason.c_str()));
  }

 private:
  explicit InStreamContext(arfuse_ctx* ctx) : ctx_(ctx) {}
  arfuse_ctx* ctx_ = nullptr;
};

}  // namespace arfuse::instream
