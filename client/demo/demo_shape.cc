#include "client/demo/demo_shape.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kernels/cpu/reference_op.h"

namespace arfuse::demo {

absl::StatusOr<std::vector<uint32_t>> ParseList(const std::string& s, const char* what) {
  std::vector<uint32_t> out;
  for (absl::string_view part : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    uint32_t v = 0;
    if (!absl::SimpleAtoi(part, &v) || v == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", what, ": \"", std::string(part), "\" is not a positive integer"));
    }
    out.push_back(v);
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat("--", what, " is empty"));
  return out;
}

absl::StatusOr<DType> ParseDType(const std::string& s) {
  if (s == "bf16") return DType::kBF16;
  if (s == "fp16") return DType::kFP16;
  if (s == "fp32") return DType::kFP32;
  return absl::InvalidArgumentError("--dtype must be bf16, fp16 or fp32");
}

float InputValue(int rank, uint64_t i) { return float(int((i * 7 + rank * 13) % 17) - 8) / 8.0f; }
float ResidualValue(uint64_t i) { return float(int((i * 5) % 11) - 5) / 4.0f; }
float GammaValue(uint64_t h) { return 0.5f + float(h % 9) / 8.0f; }

std::string SocketOf(const std::string& dir, int rank) {
  return absl::StrCat(dir, "/rank", rank, ".sock");
}

std::vector<char> RegionImage(const Layout& L, const Shape& s, DType dt,
                              const std::vector<char>& input) {
  std::vector<char> host(L.total, 0);
  std::memcpy(host.data() + L.input, input.data(), input.size());
  const uint64_t n = uint64_t{s.tokens} * s.hidden;
  for (uint64_t i = 0; i < n; ++i)
    StoreFromFloat(dt, host.data() + L.residual_in, i, ResidualValue(i));
  for (uint64_t h = 0; h < s.hidden; ++h)
    StoreFromFloat(dt, host.data() + L.gamma_off, h, GammaValue(h));
  return host;
}

absl::StatusOr<bool> MatchesReference(DType dt, int world, const Shape& s,
                                      const std::vector<const void*>& rank_inputs,
                                      const char* residual_in, const char* gamma,
                                      const char* got_residual, const char* got_norm,
                                      double* max_error) {
  const uint64_t n = uint64_t{s.tokens} * s.hidden;
  std::vector<char> want_res(n * DTypeSize(dt)), want_norm(n * DTypeSize(dt));
  CpuOpArgs ref;
  ref.pattern = Pattern::kAllReduceResidualRmsNorm;
  ref.dtype = dt;
  ref.world_size = world;
  ref.hidden = s.hidden;
  ref.num_tokens = s.tokens;
  ref.eps = 1e-6f;
  ref.rank_inputs = rank_inputs.data();
  ref.residual_in = residual_in;
  ref.residual_out = want_res.data();
  ref.norm_out = want_norm.data();
  ref.gamma = gamma;
  if (absl::Status st = ReferenceFusedOp(ref); !st.ok()) return st;
  const double tol = dt == DType::kFP32 ? 1e-5 : (dt == DType::kFP16 ? 2e-3 : 1.6e-2);
  bool ok = true;
  for (uint64_t i = 0; i < n; ++i) {
    const double er =
        std::fabs(double(LoadAsFloat(dt, got_residual, i)) - LoadAsFloat(dt, want_res.data(), i));
    const float exp_n = LoadAsFloat(dt, want_norm.data(), i);
    const double en = std::fabs(double(LoadAsFloat(dt, got_norm, i)) - exp_n);
    *max_error = std::max({*max_error, er, en});
    if (er != 0 || !(en <= tol * std::max(1.0, std::fabs(double(exp_n))))) ok = false;
  }
  return ok;
}

}  // namespace arfuse::demo
