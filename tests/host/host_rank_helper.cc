// One rank of a host-mode group as its own process (peer channel over a Unix socket + the host
// engine), for host_engine_process_test. Prints "KEY ..." lines; flags are --key=value.
#include <unistd.h>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/host/reference_op.h"
#include "server/host/host_engine.h"
#include "server/peers/peer_exchange.h"

namespace {

void Say(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

// Rank r's input of call c: every rank can build every rank's input, so each checks its result.
std::vector<uint16_t> Input(int rank, int call, size_t n) {
  std::vector<uint16_t> v(n);
  for (size_t i = 0; i < n; ++i) {
    arfuse::StoreFromFloat(arfuse::DType::kBF16, v.data(), i,
                           static_cast<float>((i * 3 + rank * 11 + call * 7) % 29) / 4.0f - 3.0f);
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> f;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    size_t eq = a.find('=');
    if (a.rfind("--", 0) == 0 && eq != std::string::npos) f[a.substr(2, eq - 2)] = a.substr(eq + 1);
  }
  const int rank = std::stoi(f["rank"]), world = std::stoi(f["world"]);
  const std::string mode = f["mode"];
  arfuse::PeerOptions po;
  po.rank = rank;
  po.world_size = world;
  po.peer_dir = f["dir"];
  po.group = f["group"];
  po.timeout = absl::Seconds(60);
  auto ex = arfuse::ConnectPeers(po);
  if (!ex.ok()) return Say(absl::StrCat("JOIN ", ex.status().ToString())), 1;
  arfuse::EngineOptions eo;
  eo.rank = rank;
  eo.world_size = world;
  eo.max_tokens = 8;
  eo.max_hidden = 128;
  eo.spin_timeout = absl::Seconds(60);
  auto eng = arfuse::MakeHostEngine(eo);
  if (!eng.ok()) return Say(absl::StrCat("ENGINE ", eng.status().ToString())), 1;
  absl::Status init = (*eng)->Initialize(**ex, absl::Now() + absl::Seconds(60));
  if (!init.ok()) return Say(absl::StrCat("INIT ", init.ToString())), 1;
  Say("INITIALIZED");

  constexpr uint32_t kTokens = 4, kHidden = 128;
  const size_t n = size_t{kTokens} * kHidden;
  auto run = [&](int call, absl::Time deadline) {
    std::vector<uint16_t> in = Input(rank, call, n), out(n);
    arfuse::OpArgs a;
    a.pattern = arfuse::Pattern::kAllReduce;
    a.dtype = arfuse::DType::kBF16;
    a.hidden = kHidden;
    a.num_tokens = kTokens;
    a.input = in.data();
    a.output = out.data();
    arfuse::ExecContext ctx;
    ctx.deadline = deadline;
    auto r = (*eng)->Execute(a, ctx);
    if (!r.ok()) return r.status();
    std::vector<std::vector<uint16_t>> all;
    std::vector<const void*> ptrs;
    for (int q = 0; q < world; ++q) all.push_back(Input(q, call, n));
    for (auto& v : all) ptrs.push_back(v.data());
    std::vector<uint16_t> want(n);
    arfuse::CpuOpArgs ref;
    ref.pattern = arfuse::Pattern::kAllReduce;
    ref.dtype = arfuse::DType::kBF16;
    ref.world_size = world;
    ref.hidden = kHidden;
    ref.num_tokens = kTokens;
    ref.rank_inputs = ptrs.data();
    ref.output = want.data();
    absl::Status s = arfuse::ReferenceFusedOp(ref);
    if (!s.ok()) return s;
    if (want != out) return absl::InternalError(absl::StrCat("wrong result at call ", call));
    return absl::OkStatus();
  };

  if (mode == "run") {
    const int calls = std::stoi(f["calls"]);
    for (int c = 0; c < calls; ++c) {
      absl::Status s = run(c, absl::Now() + absl::Seconds(60));
      if (!s.ok()) return Say(absl::StrCat("FAILED ", s.ToString())), 1;
    }
    Say(absl::StrCat("OK ", calls));
    return 0;
  }
  if (mode == "victim") {
    Say("READY");
    for (;;) ::pause();
  }
  if (mode == "survivor") {
    Say("ENTER");
    absl::Time t0 = absl::Now();
    absl::Status s = run(0, absl::Now() + absl::Milliseconds(std::stoi(f["op_ms"])));
    Say(absl::StrCat("RESULT ", absl::StatusCodeToString(s.code()), " ",
                     absl::ToInt64Milliseconds(absl::Now() - t0), " ", s.message()));
    Say(absl::StrCat("STATE ", static_cast<int>((*eng)->Status().state)));
    for (;;) ::pause();  // rank 0 hosts the coordinator: stay until the test is done
  }
  return 2;
}
