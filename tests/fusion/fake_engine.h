// An Engine for service tests: fp32 only, acting as if `ranks` ranks all sent this rank's input
// (so the sum is input * ranks), with a gate that holds ops in flight and injectable errors.
#pragma once

#include <cmath>
#include <condition_variable>
#include <mutex>

#include "server/engine_api/engine.h"

namespace arfuse::testing {

class FakeEngine final : public Engine {
 public:
  absl::Status Initialize(Exchange&, absl::Time) override { return absl::OkStatus(); }

  absl::StatusOr<OpOutcome> Execute(const OpArgs& op, const ExecContext& ctx) override {
    std::unique_lock<std::mutex> lock(mu_);
    ++calls_;
    last_ctx_ = ctx;
    entered_cv_.notify_all();
    if (!gate_open_) {
      bool opened = gate_cv_.wait_until(lock, absl::ToChronoTime(ctx.deadline),
                                        [&] { return gate_open_; });
      if (!opened) return absl::DeadlineExceededError("fake engine: gate closed past deadline");
    }
    if (!fail_.ok()) return fail_;
    if (op.dtype != DType::kFP32) return absl::InvalidArgumentError("fake engine: fp32 only");
    const size_t n = static_cast<size_t>(op.num_tokens) * op.hidden;
    const float* in = static_cast<const float*>(op.input);
    if (op.pattern == Pattern::kAllReduce) {
      float* out = static_cast<float*>(op.output);
      for (size_t i = 0; i < n; ++i) out[i] = in[i] * ranks_;
    } else {
      const float* res_in = static_cast<const float*>(op.residual_in);
      float* res_out = static_cast<float*>(op.residual_out);
      float* norm = static_cast<float*>(op.norm_out);
      const float* gamma = static_cast<const float*>(op.gamma);
      for (uint32_t t = 0; t < op.num_tokens; ++t) {
        double ss = 0;
        for (uint32_t h = 0; h < op.hidden; ++h) {
          size_t i = static_cast<size_t>(t) * op.hidden + h;
          res_out[i] = in[i] * ranks_ + res_in[i];
          ss += double(res_out[i]) * res_out[i];
        }
        float inv = 1.0f / std::sqrt(float(ss / op.hidden) + op.eps);
        for (uint32_t h = 0; h < op.hidden; ++h) {
          size_t i = static_cast<size_t>(t) * op.hidden + h;
          norm[i] = res_out[i] * inv * gamma[h];
        }
      }
    }
    return OpOutcome{ExecPath::kHost, "fake engine"};
  }

  void Abort() override {}

  EngineStatus Status() const override {
    std::lock_guard<std::mutex> lock(mu_);
    EngineStatus st;
    st.state = WorkspaceState::kReady;
    st.generation = generation_;
    st.backend = "none";
    st.reason = "host mode";
    return st;
  }

  void CloseGate() {
    std::lock_guard<std::mutex> lock(mu_);
    gate_open_ = false;
  }
  void OpenGate() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      gate_open_ = true;
    }
    gate_cv_.notify_all();
  }
  // Waits (bounded) until `n` ops have entered Execute.
  bool WaitEntered(int n, absl::Duration timeout = absl::Seconds(60)) {
    std::unique_lock<std::mutex> lock(mu_);
    return entered_cv_.wait_until(lock, absl::ToChronoTime(absl::Now() + timeout),
                                  [&] { return calls_ >= n; });
  }
  void FailWith(absl::Status s) {
    std::lock_guard<std::mutex> lock(mu_);
    fail_ = std::move(s);
  }
  void set_generation(uint64_t g) {
    std::lock_guard<std::mutex> lock(mu_);
    generation_ = g;
  }
  int calls() const {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }
  ExecContext last_ctx() const {
    std::lock_guard<std::mutex> lock(mu_);
    return last_ctx_;
  }
  static constexpr int ranks_ = 2;

 private:
  mutable std::mutex mu_;
  std::condition_variable gate_cv_;
  std::condition_variable entered_cv_;
  bool gate_open_ = true;
  int calls_ = 0;
  ExecContext last_ctx_;
  absl::Status fail_;
  uint64_t generation_ = 7;
};

}  // namespace arfuse::testing
