// Talking to arfused (one Remote per address) and addressing the ranks of a group, for every
// subcommand that asks a running sidecar.
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/version.h"
#include "tools/arfusectl/commands.h"

namespace arfuse::cli {

int Usage(Io& io, const std::string& message) {
  io.err << "arfusectl: " << message << "\n";
  return kExitUsage;
}

std::unique_ptr<grpc::ClientContext> NewCallContext(int timeout_ms) {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
  context->AddMetadata(kApiVersionMetadataKey, absl::StrCat(kApiMajor, ".", kApiMinor));
  return context;
}

std::string GrpcStatusText(const grpc::Status& status) {
  return absl::StrCat(absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())),
                      ": ", status.error_message());
}

std::string StateText(v1::WorkspaceState state) {
  std::string name = v1::WorkspaceState_Name(state);
  const std::string prefix = "WORKSPACE_STATE_";
  return name.rfind(prefix, 0) == 0 ? name.substr(prefix.size()) : name;
}

void ForEachConcurrently(size_t n, const std::function<void(size_t)>& fn) {
  std::vector<std::thread> threads;
  for (size_t i = 0; i < n; ++i) threads.emplace_back([&fn, i] { fn(i); });
  for (auto& t : threads) t.join();
}

absl::Status ReadPositiveInt(const ParsedArgs& args, const char* name, int* out) {
  return ReadOption(
      args, name,
      [name](const std::string& text) {
        return config::ParsePositiveInt(absl::StrCat("--", name), text);
      },
      out);
}

// ---- one arfused ----

// The status message gRPC's client sets when a call's own deadline passes.
constexpr char kGrpcDeadlineMessage[] = "Deadline Exceeded";

int Remote::Fail(Io& io, const char* what, const grpc::Status& status) const {
  switch (status.error_code()) {
    case grpc::StatusCode::UNAVAILABLE:
      io.err << "arfusectl: cannot reach arfused at " << addr << ": " << status.error_message()
             << "\n";
      return kExitUnreachable;
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      // gRPC's own words when this call's deadline passed; any other text is the sidecar's
      // answer (a collective that timed out waiting for other ranks, say), which it sent
      // before our deadline and which names what went wrong.
      if (status.error_message() == kGrpcDeadlineMessage) {
        io.err << "arfusectl: no answer from arfused at " << addr << " within " << timeout_ms
               << " ms (" << what << ")\n";
        return kExitUnreachable;
      }
      io.err << "arfusectl: " << what << " at " << addr
             << " failed: DEADLINE_EXCEEDED: " << status.error_message() << "\n";
      return kExitFailure;
    case grpc::StatusCode::INVALID_ARGUMENT:
      io.err << "arfusectl: " << status.error_message() << " (from " << addr << ")\n";
      return kExitUsage;
    default:
      io.err << "arfusectl: " << what << " at " << addr << " failed: " << GrpcStatusText(status)
             << "\n";
      return kExitFailure;
  }
}

const OptionSpec kTimeoutOption{
    "timeout-ms", OptionSpec::Kind::kValue, "N",
    absl::StrCat("deadline of each call (default ", kDefaultTimeoutMs, ")")};
const OptionSpec kJsonOption{"json", OptionSpec::Kind::kSwitch, "", "print one JSON object"};

absl::StatusOr<Remote> OpenRemote(const ParsedArgs& args) {
  Remote remote;
  remote.addr = args.Get("addr").value_or(DefaultAddress());
  if (remote.addr.empty()) return absl::InvalidArgumentError("--addr must not be empty");
  if (absl::Status st = ReadPositiveInt(args, "timeout-ms", &remote.timeout_ms); !st.ok()) {
    return st;
  }
  remote.channel = grpc::CreateChannel(remote.addr, grpc::InsecureChannelCredentials());
  return remote;
}

// ---- addressing ranks ----

namespace {

// unix:/run/arfuse/arfused.sock -> /run/arfuse/arfused.sock; other targets have no path.
std::optional<std::string> UnixPath(const std::string& addr) {
  if (addr.rfind("unix:", 0) == 0) return addr.substr(5);
  if (!addr.empty() && addr[0] == '/') return addr;
  return std::nullopt;
}

std::string RankAddress(const std::string& base_path, int rank) {
  return absl::StrCat("unix:", base_path, rank > 0 ? absl::StrCat(".rank", rank) : "");
}

// The ranks whose sockets exist next to `base_path` (rank 0's name), in rank order.
std::vector<int> LocalRanks(const std::string& base_path) {
  std::vector<int> ranks;
  std::error_code ec;
  const std::filesystem::path base(base_path);
  if (std::filesystem::exists(base, ec)) ranks.push_back(0);
  const std::string prefix = base.filename().string() + ".rank";
  for (const auto& entry : std::filesystem::directory_iterator(base.parent_path(), ec)) {
    const std::string name = entry.path().filename().string();
    int rank = 0;
    if (name.rfind(prefix, 0) == 0 && absl::SimpleAtoi(name.substr(prefix.size()), &rank) &&
        rank > 0 && name == prefix + std::to_string(rank)) {
      ranks.push_back(rank);
    }
  }
  std::sort(ranks.begin(), ranks.end());
  return ranks;
}

// The ranks --rank N or --ranks N,M,... name (one of them is given).
absl::StatusOr<std::vector<int>> NamedRanks(const ParsedArgs& args) {
  std::vector<int> ranks;
  const std::string spec = *args.Get(args.Has("rank") ? "rank" : "ranks");
  for (absl::string_view part : absl::StrSplit(spec, ',')) {
    int rank = -1;
    if (!absl::SimpleAtoi(part, &rank) || rank < 0 || rank >= 1024) {
      return absl::InvalidArgumentError(absl::StrCat("--", args.Has("rank") ? "rank" : "ranks",
                                                     ": \"", std::string(part).substr(0, 16),
                                                     "\" is not a rank (0, 1, ...)"));
    }
    if (std::find(ranks.begin(), ranks.end(), rank) != ranks.end()) {
      return absl::InvalidArgumentError(absl::StrCat("--ranks names rank ", rank, " twice"));
    }
    ranks.push_back(rank);
  }
  if (args.Has("rank") && ranks.size() != 1) {
    return absl::InvalidArgumentError("--rank takes one rank; use --ranks N,M,...");
  }
  return ranks;
}

}  // namespace

absl::StatusOr<Addressed> OpenRemotes(const ParsedArgs& args, int default_timeout_ms,
                                      bool collective_default) {
  absl::StatusOr<Remote> first = OpenRemote(args);
  if (!first.ok()) return first.status();
  if (!args.Has("timeout-ms")) first->timeout_ms = default_timeout_ms;
  const int by_rank = args.Has("rank") + args.Has("ranks") + args.Switch("all");
  if (by_rank > 1) return absl::InvalidArgumentError("give one of --rank, --ranks and --all");
  const bool all = args.Switch("all") || (by_rank == 0 && collective_default && !args.Has("addr"));
  Addressed out;
  std::vector<std::string> addrs;
  if (by_rank == 0 && !all) {
    for (absl::string_view part : absl::StrSplit(first->addr, ',')) {
      if (part.empty()) return absl::InvalidArgumentError("--addr has an empty address");
      addrs.emplace_back(part);
    }
  } else {
    out.by_rank = true;
    std::optional<std::string> base = UnixPath(first->addr);
    if (!base || first->addr.find(',') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--rank, --ranks and --all name sockets next to rank 0's: --addr must be one Unix "
          "socket (unix:/path), got \"",
          first->addr.substr(0, 64), "\"; to name other addresses, list them: --addr A,B,..."));
    }
    std::vector<int> ranks;
    if (all) {
      ranks = LocalRanks(*base);
      if (ranks.empty()) {
        return absl::UnavailableError(absl::StrCat("no arfused socket at ", *base, " or ", *base,
                                                   ".rank<N> (is the group running here?)"));
      }
    } else {
      absl::StatusOr<std::vector<int>> named = NamedRanks(args);
      if (!named.ok()) return named.status();
      ranks = *std::move(named);
    }
    for (int rank : ranks) addrs.push_back(RankAddress(*base, rank));
  }
  for (const std::string& addr : addrs) {
    Remote r = *first;
    r.addr = addr;
    r.channel = grpc::CreateChannel(r.addr, grpc::InsecureChannelCredentials());
    out.remotes.push_back(std::move(r));
  }
  return out;
}

int RunOnAll(const std::vector<Remote>& remotes, Io& io, const char* what,
             const std::function<grpc::Status(const Remote&, std::string*)>& call) {
  std::vector<grpc::Status> statuses(remotes.size());
  std::vector<std::string> lines(remotes.size());
  ForEachConcurrently(remotes.size(), [&](size_t i) { statuses[i] = call(remotes[i], &lines[i]); });
  int worst = kExitOk;
  for (size_t i = 0; i < remotes.size(); ++i) {
    if (statuses[i].ok()) {
      io.out << remotes[i].addr << ": " << lines[i] << "\n";
    } else {
      worst = std::max(worst, remotes[i].Fail(io, what, statuses[i]));
    }
  }
  return worst;
}

int RunEach(const ParsedArgs& args, Io& io,
            const std::function<int(const Remote&, const ParsedArgs&, Io&)>& one) {
  absl::StatusOr<Addressed> to = OpenRemotes(args, kDefaultTimeoutMs, /*collective_default=*/false);
  if (!to.ok()) return Usage(io, std::string(to.status().message()));
  int worst = kExitOk;
  for (const Remote& r : to->remotes) worst = std::max(worst, one(r, args, io));
  return worst;
}

}  // namespace arfuse::cli
