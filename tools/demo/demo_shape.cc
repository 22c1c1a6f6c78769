#include "tools/demo/demo_shape.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "kernels/host/reference_op.h"

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

const char* PlaneName(Plane p) {
  switch (p) {
    case Plane::kInStream:
      return "instream";
    case Plane::kEager:
      return "eager";
    case Plane::kDoorbell:
      return "doorbell";
  }
  return "?";
}

std::vector<Plane> PlaneChoice::planes() const {
  std::vector<Plane> out;
  for (Plane p : kAllPlanes) {
    if (runs(p)) out.push_back(p);
  }
  return out;
}

absl::StatusOr<PlaneChoice> ParsePlanes(const std::string& planes, const std::string& device,
                                        const std::string& doorbell) {
  PlaneChoice c;
  const bool cuda = device == "cuda";
  if (planes.empty()) {
    c.run[static_cast<int>(Plane::kInStream)] = true;
    c.run[static_cast<int>(Plane::kEager)] = true;
    c.run[static_cast<int>(Plane::kDoorbell)] = cuda && doorbell != "off";
    c.required[static_cast<int>(Plane::kDoorbell)] = doorbell == "on";
    return c;
  }
  std::vector<std::string> names;
  for (Plane p : kAllPlanes) names.push_back(PlaneName(p));
  for (absl::string_view part : absl::StrSplit(planes, ',')) {
    part = absl::StripAsciiWhitespace(part);
    auto it = std::find(names.begin(), names.end(), part);
    if (it == names.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--planes: ",
                       part.empty() ? std::string("an empty plane name")
                                    : absl::StrCat("unknown plane \"", std::string(part), "\""),
                       " in \"", planes, "\"; the planes are ", absl::StrJoin(names, ", ")));
    }
    const int i = static_cast<int>(it - names.begin());
    c.run[i] = true;
    c.required[i] = true;  // asked for by name: a refusal fails the demo
  }
  if (c.runs(Plane::kDoorbell) && !cuda) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--planes: the doorbell plane needs --device=cuda (a ring kernel captured in a CUDA "
        "graph); this run is --device=",
        device, ", where the planes are instream and eager"));
  }
  return c;
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
float VariantInput(int rank, uint64_t i, int k) { return InputValue(rank + 3 * k, i); }

absl::StatusOr<std::string> Agree(const std::string& dir, int rank, int world,
                                  const std::string& tag, const std::string& why_not,
                                  double deadline_s) {
  const std::filesystem::path votes = std::filesystem::path(dir) / "votes";
  std::error_code ec;
  std::filesystem::create_directories(votes, ec);
  auto file = [&](int r) { return votes / absl::StrCat(tag, ".", r); };
  {
    // Written aside and renamed, so that a peer never reads half a vote.
    const std::filesystem::path tmp = votes / absl::StrCat(tag, ".", rank, ".tmp");
    std::ofstream out(tmp);
    out << (why_not.empty() ? "1" : absl::StrCat("0 ", why_not)) << "\n";
    out.close();
    if (!out || std::rename(tmp.c_str(), file(rank).c_str()) != 0) {
      return absl::InternalError(absl::StrCat("cannot write the vote ", file(rank).string()));
    }
  }
  const absl::Time until = absl::Now() + absl::Seconds(deadline_s);
  std::string first_no;
  for (int r = 0; r < world; ++r) {
    for (;;) {
      std::ifstream in(file(r));
      std::string line;
      if (in && std::getline(in, line) && !line.empty()) {
        if (line[0] != '1' && first_no.empty()) {
          first_no = absl::StrCat("rank ", r, ": ", line.size() > 2 ? line.substr(2) : "no");
        }
        break;
      }
      if (absl::Now() > until) {
        return absl::DeadlineExceededError(
            absl::StrCat("rank ", r, " did not say whether it can run ", tag));
      }
      absl::SleepFor(absl::Milliseconds(2));
    }
  }
  return first_no;
}

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
