// Negotiation of the in-stream plane (a client that loads the sidecar's kernels) and of the
// doorbell plane's slot limit for real models (2 call sites per layer).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "config/fusion_config.h"

namespace arfuse::config {
namespace {

Decision Fused(const char* backend = "trtllm", int sm = 90) {
  FusionFlags flags;
  flags.backend = backend;
  absl::StatusOr<Decision> d = ResolveBackend(flags, Topology{sm, 2, 1});
  EXPECT_TRUE(d.ok()) << d.status();
  return d.value_or(Decision{});
}

CaptureRequest Loads(CudaGraphMode mode, uint32_t sites = 0) {
  CaptureRequest c;
  c.mode = mode;
  c.fused_op_in_graph = true;
  c.client_loads_kernels = true;
  c.call_sites = sites;
  return c;
}

bool Mentions(const std::vector<std::string>& lines, const std::string& text) {
  for (const std::string& l : lines) {
    if (l.find(text) != std::string::npos) return true;
  }
  return false;
}

TEST(NegotiateInStream, ClientThatLoadsKernelsGetsInStreamInEveryGraphMode) {
  NegotiationEnvironment cuda;
  cuda.doorbell_slots = 32;
  for (CudaGraphMode mode :
       {CudaGraphMode::kNone, CudaGraphMode::kPiecewise, CudaGraphMode::kFull}) {
    // 80 layers: 160 call sites, far more than the doorbell's slots; in-stream has no limit.
    Decision d = Negotiate(Fused(), Loads(mode, 160), cuda);
    EXPECT_EQ(d.data_plane, DataPlane::kInStream) << CudaGraphModeName(mode);
    EXPECT_EQ(d.cuda_graph_mode, mode);
    EXPECT_TRUE(Mentions(d.reasons, "in-stream plane"));
    EXPECT_FALSE(Mentions(d.warnings, "call sites"));
  }
}

TEST(NegotiateInStream, HostModeOffersInStreamThroughTheCpuImplementation) {
  NegotiationEnvironment host;
  host.doorbell_available = false;
  host.doorbell_unavailable_reason = "host device mode has no CUDA doorbell";
  Decision d = Negotiate(Fused(), Loads(CudaGraphMode::kFull, 64), host);
  EXPECT_EQ(d.data_plane, DataPlane::kInStream);
  EXPECT_EQ(d.cuda_graph_mode, CudaGraphMode::kFull);  // not made piecewise as for the doorbell
}

TEST(NegotiateInStream, CaptureUnsafeMnnvlStillTurnsPiecewiseOff) {
  CaptureRequest c = Loads(CudaGraphMode::kPiecewise);
  c.mnnvl_capture_safe = false;
  Decision d = Negotiate(Fused("mnnvl", 100), c, NegotiationEnvironment{});
  EXPECT_EQ(d.data_plane, DataPlane::kInStream);
  EXPECT_EQ(d.cuda_graph_mode, CudaGraphMode::kNone);
}

TEST(NegotiateInStream, UnavailableInStreamIsAWarningAndFallsToTheOtherPlanes) {
  NegotiationEnvironment env;
  env.instream_available = false;
  env.instream_unavailable_reason = "no kernel image for sm_89";
  Decision d = Negotiate(Fused(), Loads(CudaGraphMode::kFull), env);
  EXPECT_EQ(d.data_plane, DataPlane::kDoorbell);
  EXPECT_TRUE(Mentions(d.warnings, "in-stream plane is unavailable (no kernel image for sm_89)"));
}

TEST(NegotiateInStream, FusionOffIsNeverInStream) {
  FusionFlags off;
  Decision unfused = ResolveBackend(off, Topology{90, 2, 1}).value();
  ASSERT_FALSE(unfused.fusion_enabled);
  Decision d = Negotiate(unfused, Loads(CudaGraphMode::kFull), NegotiationEnvironment{});
  EXPECT_EQ(d.data_plane, DataPlane::kEager);
}

TEST(NegotiateDoorbell, MoreCallSitesThanSlotsIsRefusedUpFrontWithTheReason) {
  NegotiationEnvironment cuda;
  cuda.doorbell_slots = 32;
  CaptureRequest c;
  c.mode = CudaGraphMode::kFull;
  c.fused_op_in_graph = true;
  c.call_sites = 64;  // Llama-3-8B: 32 layers x 2
  Decision d = Negotiate(Fused(), c, cuda);
  EXPECT_NE(d.data_plane, DataPlane::kDoorbell);
  EXPECT_EQ(d.cuda_graph_mode, CudaGraphMode::kPiecewise);
  EXPECT_TRUE(Mentions(d.warnings, "the doorbell plane has 32 slots and the client plans 64"));
  EXPECT_TRUE(Mentions(d.warnings, "eager plane"));
  EXPECT_TRUE(Mentions(d.reasons, "more call sites than slots"));

  c.call_sites = 32;  // fits
  EXPECT_EQ(Negotiate(Fused(), c, cuda).data_plane, DataPlane::kDoorbell);
  c.call_sites = 0;  // not said: as before
  EXPECT_EQ(Negotiate(Fused(), c, cuda).data_plane, DataPlane::kDoorbell);
}

TEST(NegotiatePlanes, NamesParseBack) {
  EXPECT_STREQ(DataPlaneName(DataPlane::kInStream), "instream");
}

}  // namespace
}  // namespace arfuse::config
