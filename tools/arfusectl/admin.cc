// The arfusectl commands that change a sidecar: drain (each addressed one), and the collective
// set-backend and reinitialize (every rank of the group at once, checked before anything changes).
#include <algorithm>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "arfuse/v1/admin.grpc.pb.h"
#include "arfuse/v1/fusion.grpc.pb.h"
#include "tools/arfusectl/commands.h"

namespace arfuse::cli {
namespace {

// A collective call (set-backend, reinitialize) reaches every rank of the group at about the same
// time, or none: a rank asked alone waits for the others until its deadline and leaves the switch
// half done. Asks each addressed sidecar for its rank and group first, and refuses (exit 2, before
// anything changes) when the addressed ranks are not the whole group, or (several nodes) not
// every rank of one node. Returns the exit status on refusal, nullopt to go ahead.
std::optional<int> CheckCollective(const std::vector<Remote>& remotes, Io& io, const char* verb) {
  struct Seen {
    uint32_t rank, world_size, nnodes;
  };
  std::vector<Seen> seen(remotes.size());
  std::vector<grpc::Status> statuses(remotes.size());
  ForEachConcurrently(remotes.size(), [&](size_t i) {
    Remote quick = remotes[i];
    quick.timeout_ms = std::min(quick.timeout_ms, kDefaultTimeoutMs);
    v1::GetWorkspaceInfoResponse ws;
    statuses[i] =
        v1::Fusion::NewStub(quick.channel)->GetWorkspaceInfo(quick.Context().get(), {}, &ws);
    seen[i] = {ws.rank(), ws.world_size(), ws.nnodes()};
  });
  int worst = kExitOk;
  for (size_t i = 0; i < remotes.size(); ++i) {
    if (!statuses[i].ok())
      worst = std::max(worst, remotes[i].Fail(io, "Fusion.GetWorkspaceInfo", statuses[i]));
  }
  if (worst != kExitOk) return worst;
  std::vector<uint32_t> ranks;
  for (size_t i = 0; i < remotes.size(); ++i) {
    if (seen[i].world_size != seen[0].world_size || seen[i].nnodes != seen[0].nnodes) {
      return Usage(
          io, absl::StrCat(remotes[i].addr, " is rank ", seen[i].rank, " of ", seen[i].world_size,
                           " but ", remotes[0].addr, " is rank ", seen[0].rank, " of ",
                           seen[0].world_size, ": these sidecars are not one group"));
    }
    if (std::find(ranks.begin(), ranks.end(), seen[i].rank) != ranks.end()) {
      return Usage(
          io, absl::StrCat("rank ", seen[i].rank, " is addressed twice (", remotes[i].addr, ")"));
    }
    ranks.push_back(seen[i].rank);
  }
  std::sort(ranks.begin(), ranks.end());
  const uint32_t world = seen[0].world_size, nnodes = std::max<uint32_t>(seen[0].nnodes, 1);
  // Several nodes: each node's ranks are asked from that node; here, one node's share.
  const uint32_t expected = nnodes > 1 ? world / nnodes : world;
  if (ranks.size() < expected) {
    std::vector<std::string> missing;
    for (uint32_t r = 0; r < world && nnodes == 1; ++r) {
      if (!std::binary_search(ranks.begin(), ranks.end(), r)) missing.push_back(std::to_string(r));
    }
    return Usage(io, absl::StrCat(verb,
                                  " is collective: every rank of the group must be asked at once, "
                                  "but ",
                                  ranks.size(), " of ", nnodes > 1 ? expected : world, " ranks",
                                  nnodes > 1 ? " of this node" : "", " were addressed",
                                  missing.empty() ? ""
                                                  : absl::StrCat(" (missing: rank ",
                                                                 absl::StrJoin(missing, ", "), ")"),
                                  "; nothing was changed. Address every rank: arfusectl ", verb,
                                  " --all (sockets next to rank 0's) or --addr A,B,..."));
  }
  if (nnodes > 1) {
    io.err << "arfusectl: the group spans " << nnodes << " nodes: run the same " << verb
           << " on every node at about the same time (each node's ranks wait for the others)\n";
  }
  return std::nullopt;
}

constexpr int kCollectiveTimeoutMs = 30000;

// One id for the calls of one collective command on every rank: the sidecars match the calls by
// it, so a call that failed earlier on one rank only cannot pair with a later one.
std::string NewCollectiveId() {
  std::random_device rd;
  return absl::StrFormat("%08x%08x", rd(), rd());
}

// Addresses the ranks (every local one by default), refuses when they are not the whole group
// (CheckCollective), then runs `call` on all of them at once.
int RunCollective(const ParsedArgs& args, Io& io, const char* verb, const char* what,
                  const std::function<grpc::Status(const Remote&, std::string*)>& call) {
  absl::StatusOr<Addressed> to =
      OpenRemotes(args, kCollectiveTimeoutMs, /*collective_default=*/true);
  if (!to.ok()) return Usage(io, std::string(to.status().message()));
  if (std::optional<int> refused = CheckCollective(to->remotes, io, verb)) return *refused;
  return RunOnAll(to->remotes, io, what, call);
}

}  // namespace

int RunSetBackend(const ParsedArgs& args, Io& io) {
  std::optional<std::string> backend = args.Get("backend");
  if (!backend)
    return Usage(io, "set-backend needs a backend: arfusectl set-backend auto|trtllm|mnnvl|none");
  if (*backend != "auto" && *backend != "trtllm" && *backend != "mnnvl" && *backend != "none") {
    return Usage(io, absl::StrCat("unknown backend \"", backend->substr(0, 64),
                                  "\": expected auto, trtllm, mnnvl or none"));
  }
  const std::string id = NewCollectiveId();
  return RunCollective(
      args, io, "set-backend", "Admin.SetBackend", [&](const Remote& r, std::string* line) {
        v1::SetBackendRequest req;
        req.set_backend(*backend);
        req.set_collective_id(id);
        v1::SetBackendResponse resp;
        grpc::Status st = v1::Admin::NewStub(r.channel)->SetBackend(r.Context().get(), req, &resp);
        if (st.ok()) {
          *line = absl::StrCat("backend ", resp.previous_backend(), " -> ", resp.backend(),
                               ", fusion ", resp.fusion_enabled() ? "enabled" : "disabled",
                               ", generation ", resp.generation());
        }
        return st;
      });
}

int RunReinitialize(const ParsedArgs& args, Io& io) {
  return RunCollective(
      args, io, "reinitialize", "Admin.Reinitialize", [&](const Remote& r, std::string* line) {
        v1::ReinitializeResponse resp;
        grpc::Status st = v1::Admin::NewStub(r.channel)->Reinitialize(r.Context().get(), {}, &resp);
        if (st.ok()) {
          *line = absl::StrCat("re-initialized, generation ", resp.generation(), ", state ",
                               StateText(resp.state()));
        }
        return st;
      });
}

int RunDrain(const ParsedArgs& args, Io& io) {
  absl::StatusOr<Addressed> to = OpenRemotes(args, kDefaultTimeoutMs, /*collective_default=*/false);
  if (!to.ok()) return Usage(io, std::string(to.status().message()));
  return RunOnAll(to->remotes, io, "Admin.Drain", [&](const Remote& r, std::string* line) {
    v1::DrainRequest req;
    req.set_timeout_ms(static_cast<uint32_t>(r.timeout_ms));
    v1::DrainResponse resp;
    grpc::Status st = v1::Admin::NewStub(r.channel)->Drain(r.Context().get(), req, &resp);
    if (st.ok()) *line = absl::StrCat("drained (waited for ", resp.ops_waited(), " op(s))");
    return st;
  });
}

}  // namespace arfuse::cli
