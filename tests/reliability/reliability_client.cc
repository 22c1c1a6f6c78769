// A client process the fault tests kill: connects to one sidecar, registers regions, and either
// holds them (--mode=hold) or starts an op that waits in the sidecar for the other ranks
// (--mode=execute). It prints one line when it is in that state, then waits to be killed.
//
//   reliability_client --socket=S --rank=R --world=N --mode=hold|execute [--regions=K]
//                      [--device=host|cuda]
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/reliability/harness.h"

namespace {

std::string Arg(int argc, char** argv, const std::string& name, const std::string& def) {
  const std::string prefix = "--" + name + "=";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (absl::StartsWith(a, prefix)) return a.substr(prefix.size());
  }
  return def;
}

int Fail(const std::string& what, const absl::Status& s) {
  std::printf("error %s: %s\n", what.c_str(), s.ToString().c_str());
  std::fflush(stdout);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace arfuse;
  using namespace arfuse::reliability;
  const std::string socket = Arg(argc, argv, "socket", "");
  const std::string mode = Arg(argc, argv, "mode", "hold");
  const Device device = Arg(argc, argv, "device", "host") == "cuda" ? Device::kCuda : Device::kHost;
  int rank = 0, world = 1, regions = 1;
  if (!absl::SimpleAtoi(Arg(argc, argv, "rank", "0"), &rank) ||
      !absl::SimpleAtoi(Arg(argc, argv, "world", "1"), &world) ||
      !absl::SimpleAtoi(Arg(argc, argv, "regions", "1"), &regions) || socket.empty()) {
    std::fprintf(stderr, "usage: reliability_client --socket=S --rank=R --world=N --mode=M\n");
    return 2;
  }
  ShapeConfig shape;
  auto rc = RankClient::Create(socket, rank, world, shape, /*salt=*/0, "victim", device);
  if (!rc.ok()) return Fail("create", rc.status());
  RankClient& c = **rc;
  // Extra regions: more mappings for the sidecar to release when this process dies.
  std::vector<std::unique_ptr<TensorMemory>> extra;
  for (int i = 1; i < regions; ++i) {
    auto b = MakeTensorMemory(device, rank, 4096);
    if (!b.ok()) return Fail("memory", b.status());
    auto r = (*b)->Register(c.client(), absl::StrCat("extra-", i));
    if (!r.ok()) return Fail("register", r.status());
    extra.push_back(std::move(*b));
  }
  if (mode == "hold") {
    std::printf("holding %d regions\n", regions);
    std::fflush(stdout);
    for (;;) pause();
  }
  if (mode != "execute") return 2;
  c.Prepare(7);
  std::thread op([&] {
    auto r = c.Run(absl::Seconds(60));
    std::printf("op ended: %s\n", r.ok() ? "OK" : r.status().ToString().c_str());
    std::fflush(stdout);
  });
  // The op is accepted (and holds its region) once ListRegions counts it in flight.
  const absl::Time until = absl::Now() + absl::Seconds(30);
  for (;;) {
    auto list = c.client().ListRegions();
    bool in_flight = false;
    if (list.ok()) {
      for (const auto& r : *list) in_flight = in_flight || r.in_flight() > 0;
    }
    if (in_flight) break;
    if (absl::Now() > until) return Fail("in-flight", absl::DeadlineExceededError("never"));
    absl::SleepFor(absl::Milliseconds(5));
  }
  std::printf("in-flight\n");
  std::fflush(stdout);
  for (;;) pause();
}
