// Writes the seed corpora of the fuzz targets: valid requests, built with the same code the
// sidecar runs, so that libFuzzer starts from inputs that reach deep into validation.
//
//   make_seeds OUTDIR    -> OUTDIR/<target>/seed-NNN
//
// Fusion seeds run through the fuzz target's own driver while they are built, so they carry
// the region and plan generations the driver's registry (fixed boot nonce) hands out; every
// step of every seed must succeed, or this program fails.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "arfuse/v1/config.pb.h"
#include "arfuse/v1/peer.pb.h"
#include "common/fd/fd_wire.h"
#include "config/config_convert.h"
#include "config/fusion_config.h"
#include "fuzz/fusion_driver.h"
#include "server/fdpass/ticket_broker.h"
#include "server/instream/attach_blob.h"
#include "server/peers/wire.h"
#include "spdlog/spdlog.h"

namespace arfuse::fuzz {
namespace {

int g_failures = 0;

void Write(const std::string& dir, int n, const std::string& bytes) {
  std::filesystem::create_directories(dir);
  char name[32];
  std::snprintf(name, sizeof(name), "/seed-%03d", n);
  std::ofstream(dir + name, std::ios::binary) << bytes;
}

// Builds a Fusion request sequence while running it, so ids and generations are the real ones.
class SeedBuilder {
 public:
  explicit SeedBuilder(MemoryKind kind) : driver_(kind), cuda_(kind == MemoryKind::kCudaIpc) {}

  template <typename Msg>
  void Add(RequestType type, const Msg& msg, uint64_t* id = nullptr, uint64_t* gen = nullptr,
           bool must_succeed = true) {
    std::string bytes = msg.SerializeAsString();
    absl::Status st =
        driver_.Step(type, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), id, gen);
    if (must_succeed && !st.ok()) {
      std::fprintf(stderr, "make_seeds: step %d of a seed failed: %s\n", int(type),
                   st.ToString().c_str());
      ++g_failures;
    }
    std::string rec = Record(type, bytes);
    // The first record's high bit selects a CUDA-kind registry in RunInput.
    if (out_.empty() && cuda_) rec[0] = static_cast<char>(rec[0] | 0x80);
    out_ += rec;
  }
  void AddRaw(RequestType type, const std::string& bytes) {
    (void)driver_.Step(type, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    out_ += Record(type, bytes);
  }
  const std::string& bytes() const { return out_; }

 private:
  FusionDriver driver_;
  bool cuda_;
  std::string out_;
};

v1::RegisterRegionRequest HostRegion(const std::string& name, uint64_t size) {
  v1::RegisterRegionRequest r;
  r.set_name(name);
  r.set_byte_size(size);
  r.mutable_host_shm()->set_shm_name("/seed-" + name);
  return r;
}

void Ref(v1::RegionRef* ref, uint64_t id, uint64_t gen, uint64_t offset) {
  ref->set_region_id(id);
  ref->set_generation(gen);
  ref->set_offset(offset);
}

v1::OpSpec NormOp(v1::DType dtype, uint32_t hidden, uint32_t tokens, uint64_t a_id, uint64_t a_gen,
                  uint64_t b_id, uint64_t b_gen, bool in_place) {
  const uint64_t esz = dtype == v1::DTYPE_FP32 ? 4 : 2;
  const uint64_t t = (uint64_t{tokens} * hidden * esz + 255) / 256 * 256;
  v1::OpSpec op;
  op.set_pattern(v1::PATTERN_ALLREDUCE_RESIDUAL_RMSNORM);
  op.set_dtype(dtype);
  op.set_hidden(hidden);
  op.set_max_tokens(tokens);
  op.set_eps(1e-6f);
  Ref(op.mutable_input(), a_id, a_gen, 0);
  Ref(op.mutable_residual_in(), a_id, a_gen, t);
  // Outputs go to region B, after region A's tensors when both are one region.
  const uint64_t b_base = a_id == b_id ? 3 * t : 0;
  if (in_place) {
    Ref(op.mutable_residual_out(), a_id, a_gen, t);
  } else {
    Ref(op.mutable_residual_out(), b_id, b_gen, b_base);
  }
  Ref(op.mutable_norm_out(), b_id, b_gen, b_base + t);
  Ref(op.mutable_gamma(), a_id, a_gen, 2 * t);
  return op;
}

// Executes plan (p, pg) at each of `plan_tokens` tokens, then `op` as an explicit op at
// `op_tokens` (its max_tokens cleared: sized by num_tokens).
void AddExecutes(SeedBuilder& s, uint64_t p, uint64_t pg,
                 std::initializer_list<uint32_t> plan_tokens, const v1::OpSpec& op,
                 uint32_t op_tokens) {
  v1::ExecuteRequest ex;
  ex.set_plan_id(p);
  ex.set_plan_generation(pg);
  for (uint32_t tokens : plan_tokens) {
    ex.set_num_tokens(tokens);
    s.Add(kExecute, ex);
  }
  v1::ExecuteRequest exop;
  *exop.mutable_op() = op;
  exop.mutable_op()->set_max_tokens(0);
  exop.set_num_tokens(op_tokens);
  s.Add(kExecute, exop);
}

void FusionSeeds(const std::string& dir) {
  int n = 0;
  // 1. A whole lifecycle in one region, bf16, by plan and by explicit op.
  for (v1::DType dtype : {v1::DTYPE_BF16, v1::DTYPE_FP16, v1::DTYPE_FP32}) {
    SeedBuilder s(MemoryKind::kHostShm);
    uint64_t a = 0, ag = 0, b = 0, bg = 0, p = 0, pg = 0;
    s.Add(kRegister, HostRegion("a", 65536), &a, &ag);
    s.Add(kRegister, HostRegion("b", 65536), &b, &bg);
    v1::CreatePlanRequest plan;
    *plan.mutable_op() = NormOp(dtype, 256, 8, a, ag, b, bg, /*in_place=*/dtype == v1::DTYPE_FP16);
    s.Add(kCreatePlan, plan, &p, &pg);
    AddExecutes(s, p, pg, {8, 3}, plan.op(), 5);
    s.AddRaw(kListRegions, "");
    v1::DestroyPlanRequest dp;
    dp.set_plan_id(p);
    dp.set_generation(pg);
    s.Add(kDestroyPlan, dp);
    v1::UnregisterRegionRequest ur;
    ur.set_region_id(b);
    ur.set_generation(bg);
    s.Add(kUnregister, ur);
    Write(dir, n++, s.bytes());
  }
  // 2. Allreduce, output in place of the input, then a session that goes away.
  {
    SeedBuilder s(MemoryKind::kHostShm);
    uint64_t a = 0, ag = 0, p = 0, pg = 0;
    s.Add(kRegister, HostRegion("x", 8192), &a, &ag);
    v1::CreatePlanRequest plan;
    v1::OpSpec* op = plan.mutable_op();
    op->set_pattern(v1::PATTERN_ALLREDUCE);
    op->set_dtype(v1::DTYPE_FP32);
    op->set_hidden(64);
    op->set_max_tokens(16);
    Ref(op->mutable_input(), a, ag, 0);
    Ref(op->mutable_output(), a, ag, 0);
    s.Add(kCreatePlan, plan, &p, &pg);
    v1::ExecuteRequest ex;
    ex.set_plan_id(p);
    ex.set_plan_generation(pg);
    ex.set_num_tokens(16);
    s.Add(kExecute, ex);
    s.AddRaw(kNewSession, "second-client");
    v1::SessionRequest hello;
    hello.set_client_name("sglang-rank0");
    s.Add(kSessionHello, hello);
    Write(dir, n++, s.bytes());
  }
  // 3. CUDA IPC regions (a 64-byte handle; the fake opener never opens it).
  {
    SeedBuilder s(MemoryKind::kCudaIpc);
    v1::RegisterRegionRequest r;
    r.set_name("cuda");
    r.set_byte_size(262144);
    r.mutable_cuda_ipc()->set_handle(std::string(64, '\x11'));
    r.mutable_cuda_ipc()->set_device_id(0);
    uint64_t a = 0, ag = 0, p = 0, pg = 0;
    s.Add(kRegister, r, &a, &ag);
    v1::CreatePlanRequest plan;
    *plan.mutable_op() = NormOp(v1::DTYPE_BF16, 1024, 16, a, ag, a, ag, /*in_place=*/true);
    s.Add(kCreatePlan, plan, &p, &pg);
    v1::ExecuteRequest ex;
    ex.set_plan_id(p);
    ex.set_plan_generation(pg);
    ex.set_num_tokens(1);
    s.Add(kExecute, ex);
    Write(dir, n++, s.bytes());
  }
  // 4. Refusals worth starting from: duplicate name, stale generation, overlap, overflow.
  {
    SeedBuilder s(MemoryKind::kHostShm);
    uint64_t a = 0, ag = 0;
    s.Add(kRegister, HostRegion("a", 65536), &a, &ag);
    s.Add(kRegister, HostRegion("a", 65536), nullptr, nullptr, /*must_succeed=*/false);
    v1::CreatePlanRequest plan;
    *plan.mutable_op() = NormOp(v1::DTYPE_BF16, 256, 8, a, ag + 1, a, ag, true);
    s.Add(kCreatePlan, plan, nullptr, nullptr, false);
    *plan.mutable_op() = NormOp(v1::DTYPE_BF16, 256, 8, a, ag, a, ag, true);
    plan.mutable_op()->mutable_norm_out()->set_offset(0);  // overlaps the input
    s.Add(kCreatePlan, plan, nullptr, nullptr, false);
    plan.mutable_op()->mutable_gamma()->set_offset(~0ull - 31);
    s.Add(kCreatePlan, plan, nullptr, nullptr, false);
    Write(dir, n++, s.bytes());
  }
  // 5. The FP8 patterns, by plan and by explicit op: static (with and without norm_out),
  // per-token, and per-group in each scale layout; then a per-group op without a layout and one
  // whose scales overrun their region, refused.
  {
    struct Fp8Case {
      v1::Pattern pattern;
      v1::ScaleLayout layout;
      bool norm_out;
    };
    const Fp8Case cases[] = {
        {v1::PATTERN_ALLREDUCE_RESIDUAL_RMSNORM_FP8_STATIC, v1::SCALE_LAYOUT_UNSPECIFIED, true},
        {v1::PATTERN_ALLREDUCE_RESIDUAL_RMSNORM_FP8_STATIC, v1::SCALE_LAYOUT_UNSPECIFIED, false},
        {v1::PATTERN_ALLREDUCE_RESIDUAL_RMSNORM_FP8_PER_TOKEN, v1::SCALE_LAYOUT_UNSPECIFIED, false},
        {v1::PATTERN_ALLREDUCE_RESIDUAL_RMSNORM_FP8_PER_GROUP, v1::SCALE_LAYOUT_FP32_ROW_MAJOR,
         false},
        {v1::PATTERN_ALLREDUCE_RESIDUAL_RMSNORM_FP8_PER_GROUP, v1::SCALE_LAYOUT_FP32_MN_MAJOR,
         true},
        {v1::PATTERN_ALLREDUCE_RESIDUAL_RMSNORM_FP8_PER_GROUP, v1::SCALE_LAYOUT_UE8M0_PACKED,
         false},
    };
    for (const Fp8Case& c : cases) {
      SeedBuilder s(MemoryKind::kHostShm);
      uint64_t a = 0, ag = 0, b = 0, bg = 0, p = 0, pg = 0;
      s.Add(kRegister, HostRegion("a", 65536), &a, &ag);
      s.Add(kRegister, HostRegion("b", 65536), &b, &bg);
      // bf16, hidden 256 (two groups of 128), 8 tokens: each [8, 256] tensor is 4096 bytes.
      // Region b: residual_out, norm_out, the E4M3 codes (2048 bytes), then the scales.
      v1::CreatePlanRequest plan;
      v1::OpSpec& op = *plan.mutable_op();
      op = NormOp(v1::DTYPE_BF16, 256, 8, a, ag, b, bg, /*in_place=*/false);
      op.set_pattern(c.pattern);
      if (!c.norm_out) op.clear_norm_out();
      Ref(op.mutable_quant_out(), b, bg, 2 * 4096);
      Ref(op.mutable_scale(), b, bg, 3 * 4096);
      op.set_scale_layout(c.layout);
      s.Add(kCreatePlan, plan, &p, &pg);
      AddExecutes(s, p, pg, {8, 1}, op, 3);
      if (c.pattern == v1::PATTERN_ALLREDUCE_RESIDUAL_RMSNORM_FP8_PER_GROUP) {
        op.set_scale_layout(v1::SCALE_LAYOUT_UNSPECIFIED);
        s.Add(kCreatePlan, plan, nullptr, nullptr, /*must_succeed=*/false);
        op.set_scale_layout(c.layout);
        op.mutable_scale()->set_offset(65536 - 16);
        s.Add(kCreatePlan, plan, nullptr, nullptr, /*must_succeed=*/false);
      }
      Write(dir, n++, s.bytes());
    }
  }
  std::printf("make_seeds: %d fuzz_fusion_requests seeds\n", n);
}

void ConfigSeeds(const std::string& dir) {
  int n = 0;
  auto put = [&](uint8_t which, const google::protobuf::Message& m) {
    Write(dir, n++, std::string(1, static_cast<char>(which)) + m.SerializeAsString());
  };
  const std::vector<std::optional<std::string>> backends = {std::nullopt, "auto", "trtllm",
                                                            "mnnvl"};
  const int sms[] = {80, 90, 100, 103, 120};
  int k = 0;
  for (const auto& backend : backends) {
    for (int sm : sms) {
      v1::ResolveRequest r;
      if (backend) r.mutable_flags()->set_flashinfer_allreduce_fusion_backend(*backend);
      r.mutable_flags()->set_enable_flashinfer_allreduce_fusion(k % 3 == 0);
      r.mutable_flags()->set_enable_deterministic_inference(k % 7 == 3);
      r.mutable_topology()->set_sm(sm);
      r.mutable_topology()->set_tp_size(k % 2 ? 8 : 2);
      r.mutable_topology()->set_nnodes(k % 4 == 1 ? 2 : 1);
      r.mutable_capture()->set_cuda_graph_mode(static_cast<v1::CudaGraphMode>(1 + k % 3));
      r.mutable_capture()->set_fused_op_in_graph(k % 2 == 0);
      if (k % 5 == 2) r.mutable_capture()->set_mnnvl_capture_safe(false);
      put(0, r);
      ++k;
    }
  }
  for (int mode = 0; mode < 4; ++mode) {
    v1::NegotiateRequest r;
    r.mutable_capture()->set_cuda_graph_mode(static_cast<v1::CudaGraphMode>(mode));
    r.mutable_capture()->set_fused_op_in_graph(mode >= 2);
    put(1, r);
    put(3, r.capture());
  }
  config::FusionFlags flags;
  flags.backend = "auto";
  for (int sm : sms) {
    auto d = config::Resolve(flags, config::Topology{sm, 2, 1},
                             config::CaptureRequest{config::CudaGraphMode::kPiecewise, true, {}});
    if (d.ok()) put(2, config::DecisionToProto(*d));
  }
  std::printf("make_seeds: %d fuzz_config_requests seeds\n", n);
}

void RankReportSeeds(const std::string& dir) {
  int n = 0;
  for (int sm : {90, 100, 0}) {
    config::RankReport r;
    r.rank = sm == 0 ? 1 : 0;
    r.flags.backend = sm == 100 ? std::optional<std::string>("mnnvl") : std::nullopt;
    r.flags.deterministic = sm == 0;
    r.topology = config::Topology{sm, 2, 1};
    auto d = config::ResolveBackend(r.flags, r.topology);
    if (d.ok()) {
      r.decision = *d;
    } else {
      r.failure = std::string(d.status().message());
    }
    Write(dir, n++, config::EncodeRankReport(r));
  }
  config::RankReport failed;
  failed.topology = config::Topology{90, 4, 1};
  failed.failure = "rank 2: cudaMalloc failed: out of memory\n\"quoted\"";
  Write(dir, n++, config::EncodeRankReport(failed));
  using namespace std::string_literals;
  for (const std::string& text : {"auto"s, "piecewise"s, "100"s, "true"s,
                                  "--flashinfer-allreduce-fusion-backend\0mnnvl\0--tp\0"s + "2"}) {
    Write(dir, n++, text);
  }
  std::printf("make_seeds: %d fuzz_rank_report seeds\n", n);
}

void PeerWireSeeds(const std::string& dir) {
  using peers::EncodeFrame;
  using peers::FrameType;
  int n = 0;
  v1::JoinRequest join;
  join.set_rank(1);
  join.set_world_size(2);
  join.set_nnodes(1);
  join.set_node_id("node-a");
  join.mutable_api()->set_major(1);
  join.set_build_version("0.1.0");
  const std::string join_frame = EncodeFrame(
      FrameType::kJoin, 1, 60000, peers::EncodeJoinBody("arfuse", join.SerializeAsString()));
  Write(dir, n++, join_frame);
  v1::JoinResponse ok;
  ok.set_epoch(1796010527234205000ull);
  *ok.add_members() = join;
  *ok.add_members() = join;
  Write(dir, n++, EncodeFrame(FrameType::kJoinOk, 1, 0, ok.SerializeAsString()));
  v1::CollectiveRequest c;
  c.set_epoch(ok.epoch());
  c.set_tag("config-vote");
  c.set_kind(v1::COLLECTIVE_KIND_ALLGATHER);
  c.set_rank(1);
  c.set_payload("arfuse-rank-report-v1\nrank=1\n");
  const std::string coll = EncodeFrame(FrameType::kCollective, 2, 5000, c.SerializeAsString());
  Write(dir, n++, coll);
  c.set_kind(v1::COLLECTIVE_KIND_VOTE);
  c.set_yes(false);
  c.set_reason("workspace allocation failed");
  Write(dir, n++, EncodeFrame(FrameType::kCollective, 3, 5000, c.SerializeAsString()));
  v1::CollectiveResponse cr;
  cr.add_payloads("a");
  cr.add_payloads("b");
  cr.set_all_yes(true);
  Write(dir, n++, EncodeFrame(FrameType::kCollectiveOk, 2, 0, cr.SerializeAsString()));
  Write(dir, n++,
        EncodeFrame(FrameType::kError, 3, 0,
                    peers::EncodeError(absl::UnavailableError("rank 2 went away"))));
  v1::LeaveRequest leave;
  leave.set_epoch(ok.epoch());
  leave.set_rank(1);
  leave.set_reason("shutdown");
  Write(dir, n++, EncodeFrame(FrameType::kLeave, 4, 0, leave.SerializeAsString()));
  Write(dir, n++, EncodeFrame(FrameType::kHeartbeat, 5, 5000, ""));
  // Two frames back to back, as a stream delivers them.
  Write(dir, n++, join_frame + coll);
  std::printf("make_seeds: %d fuzz_peer_wire seeds\n", n);
}

}  // namespace
}  // namespace arfuse::fuzz

namespace arfuse::fuzz {
namespace {

// fuzz_fd_wire: byte 0 = descriptors arriving (low bits) and the real-offer bit; then messages.
void FdWireSeeds(const std::string& dir) {
  int n = 0;
  const std::string deposit = EncodeFdMessage(FdOp::kDeposit, "", 1);
  const std::string pickup = EncodeFdMessage(FdOp::kPickup, NewFdTicket());
  Write(dir, n++, std::string(1, '\x01') + deposit);
  Write(dir, n++, std::string(1, '\x03') + deposit + EncodeFdMessage(FdOp::kDeposit, "", 2));
  Write(dir, n++, std::string(1, '\x80') + pickup);
  Write(dir, n++, std::string(1, '\x81') + deposit + pickup + pickup);
  Write(dir, n++, std::string(1, '\x00') + EncodeFdMessage(FdOp::kDeposit, "", 0));
  Write(dir, n++, std::string(1, '\x00') + EncodeFdMessage(FdOp::kError, "x"));
  Write(dir, n++, std::string(1, '\x05') + deposit + deposit + deposit + deposit + deposit);
  std::printf("make_seeds: %d fuzz_fd_wire seeds\n", n);
}

// fuzz_attach_blob: byte 0 = descriptors picked up; then a blob the sidecar's builder makes
// (host mode, two ranks over one descriptor; and a CUDA one of IPC handles with two entries).
void AttachBlobSeeds(const std::string& dir) {
  int n = 0;
  InStreamExport host;
  host.device = instream::DeviceKind::kHost;
  host.world_size = 2;
  host.generation = 3;
  host.max_tokens = 16;
  host.hidden = 1024;
  host.host_slot_bytes = 65536;
  host.ranks.resize(2);
  for (auto& r : host.ranks) {
    r.kind = instream::MemoryKind::kHostShm;
    r.bytes = 1 << 20;
  }
  host.ranks[0].fd.reset(::dup(0));
  if (auto b = BuildAttachBlob(host, 1); b.ok()) Write(dir, n++, std::string(1, '\x01') + *b);
  static const char kImage[64] = "image";
  InStreamExport cuda;
  cuda.device = instream::DeviceKind::kCuda;
  cuda.world_size = 2;
  cuda.sm = 90;
  cuda.image = kImage;
  cuda.image_bytes = sizeof(kImage);
  cuda.max_tokens = 16;
  cuda.hidden = 1024;
  instream::KernelEntry e{};
  e.hidden = 1024;
  e.pattern = 2;
  e.algo = 1;
  e.dtype = 1;
  e.block_threads = 128;
  e.max_grid = 64;
  e.rows_divisor = 1;
  std::snprintf(e.function, sizeof(e.function), "%s", "arfuse_is_bf16_arnorm_oneshot_b0");
  cuda.entries = {e, e};
  cuda.ranks.resize(2);
  for (auto& r : cuda.ranks) {
    r.kind = instream::MemoryKind::kCudaIpc;
    r.bytes = 1 << 21;
    r.handle.assign(64, 'h');
  }
  if (auto b = BuildAttachBlob(cuda, 2); b.ok()) Write(dir, n++, std::string(1, '\x00') + *b);
  std::printf("make_seeds: %d fuzz_attach_blob seeds\n", n);
}

}  // namespace
}  // namespace arfuse::fuzz

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds OUTDIR\n");
    return 2;
  }
  spdlog::set_level(spdlog::level::off);
  const std::string out = argv[1];
  arfuse::fuzz::FusionSeeds(out + "/fuzz_fusion_requests");
  arfuse::fuzz::ConfigSeeds(out + "/fuzz_config_requests");
  arfuse::fuzz::RankReportSeeds(out + "/fuzz_rank_report");
  arfuse::fuzz::PeerWireSeeds(out + "/fuzz_peer_wire");
  arfuse::fuzz::FdWireSeeds(out + "/fuzz_fd_wire");
  arfuse::fuzz::AttachBlobSeeds(out + "/fuzz_attach_blob");
  return arfuse::fuzz::g_failures == 0 ? 0 : 1;
}
