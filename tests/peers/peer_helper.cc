// A rank of a peer group, run as its own process by peers_process_test. Prints one line per
// result on stdout ("KEY value...") so the test can check it; flags are --key=value.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/peers/peer_exchange.h"

namespace {

void Say(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

void SayStatus(const std::string& key, const absl::Status& s, absl::Time start) {
  Say(absl::StrCat(key, " ", absl::StatusCodeToString(s.code()), " ",
                   absl::ToInt64Milliseconds(absl::Now() - start), " ", s.message()));
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> flags;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    size_t eq = a.find('=');
    if (a.rfind("--", 0) != 0 || eq == std::string::npos) {
      std::fprintf(stderr, "bad flag %s\n", a.c_str());
      return 2;
    }
    flags[a.substr(2, eq - 2)] = a.substr(eq + 1);
  }
  arfuse::PeerOptions o;
  o.rank = std::stoi(flags["rank"]);
  o.world_size = std::stoi(flags["world"]);
  o.nnodes = flags.count("nnodes") ? std::stoi(flags["nnodes"]) : 1;
  o.peer_dir = flags["dir"];
  o.rank0_address = flags["tcp"];
  o.group = flags.count("group") ? flags["group"] : "test";
  // The TCP channel's mutual TLS (peer_tls.h): files made by the test.
  o.tls.cert = flags["tls_cert"];
  o.tls.key = flags["tls_key"];
  o.tls.ca = flags["tls_ca"];
  o.timeout = absl::Milliseconds(std::stoi(flags["join_ms"]));
  // Heartbeats: the library's defaults unless given (--hb_ms=0 turns them off).
  if (flags.count("hb_ms")) o.heartbeat_timeout = absl::Milliseconds(std::stoi(flags["hb_ms"]));
  if (flags.count("hb_interval_ms")) {
    o.heartbeat_interval = absl::Milliseconds(std::stoi(flags["hb_interval_ms"]));
  }
  const std::string mode = flags["mode"];
  const absl::Duration op_timeout =
      absl::Milliseconds(flags.count("op_ms") ? std::stoi(flags["op_ms"]) : 60000);

  absl::Time start = absl::Now();
  auto ex = arfuse::ConnectPeers(o);
  if (!ex.ok()) {
    SayStatus("JOIN", ex.status(), start);
    return 0;
  }
  Say(absl::StrCat("JOINED ", (*ex)->epoch()));
  if (mode == "close") {
    // Joined; then leaves on purpose (as a sidecar re-forming its group does) and stays alive.
    ex->reset();
    Say("CLOSED");
    for (;;) ::pause();
  }
  arfuse::Exchange& x = **ex;
  const int rank = o.rank;

  if (mode == "basic") {
    auto deadline = [&] { return absl::Now() + op_timeout; };
    auto all = x.Allgather("hello", absl::StrCat("payload-from-", rank), deadline());
    if (!all.ok()) return SayStatus("ALLGATHER", all.status(), start), 1;
    Say(absl::StrCat("ALLGATHER ", absl::StrJoin(*all, "|")));
    bool yes = rank != o.world_size - 1;
    auto vote = x.Vote("vote", yes, yes ? "" : "not enough memory", deadline());
    if (!vote.ok()) return SayStatus("VOTE", vote.status(), start), 1;
    Say(absl::StrCat("VOTE ", vote->all_yes ? "yes" : "no", " ",
                     absl::StrJoin(vote->reasons, "|")));
    for (int i = 0; i < 3; ++i) {  // a tag reused call after call
      absl::Status b = x.Barrier("step", deadline());
      if (!b.ok()) return SayStatus("BARRIER", b, start), 1;
    }
    Say("BARRIER ok");
    if (!o.peer_dir.empty()) {
      int mfd = ::memfd_create("peer-helper", MFD_CLOEXEC);
      std::string content = absl::StrCat("fd-of-rank-", rank);
      if (mfd < 0 ||
          ::write(mfd, content.data(), content.size()) != static_cast<ssize_t>(content.size())) {
        Say("FD memfd failed");
        return 1;
      }
      auto fds = x.AllgatherFd("fds", mfd, deadline());
      ::close(mfd);
      if (!fds.ok()) return SayStatus("FD", fds.status(), start), 1;
      std::vector<std::string> contents;
      for (int fd : *fds) {
        char buf[64] = {};
        ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
        contents.push_back(n > 0 ? std::string(buf, n) : "?");
        ::close(fd);
      }
      Say(absl::StrCat("FD ", absl::StrJoin(contents, "|")));
    }
    Say("DONE");
    return 0;
  }
  if (mode == "victim") {
    // Joined; stays in the group without calling anything until the test kills or stops it.
    Say("READY");
    for (;;) ::pause();
  }
  if (mode == "survivor") {
    Say("ENTER");
    absl::Time t0 = absl::Now();
    absl::Status s = x.Barrier("mid", absl::Now() + op_timeout);
    SayStatus("RESULT", s, t0);
    // A later collective must fail at once too (the group is broken), not wait again.
    absl::Time t1 = absl::Now();
    SayStatus("AFTER", x.Barrier("after", absl::Now() + op_timeout), t1);
    // Stay up (rank 0 hosts the coordinator) until the test has read every rank's answers.
    for (;;) ::pause();
  }
  if (mode == "watch") {
    // Joined; checks the link the way the daemon's watch loop does (no collective, every 20 ms)
    // and prints LINK_OK once it has held for a while, then LINK <status> when it is lost.
    Say("READY");
    const absl::Time t0 = absl::Now();
    bool said_ok = false;
    for (;;) {
      absl::Status s = x.LinkStatus();
      if (!s.ok()) {
        SayStatus("LINK", s, t0);
        break;
      }
      if (!said_ok && absl::Now() - t0 > absl::Milliseconds(200)) {
        Say("LINK_OK");
        said_ok = true;
      }
      absl::SleepFor(absl::Milliseconds(20));  // the watch loop's tick, not a synchronization
    }
    // A lost link stays lost, and a collective after it fails at once with the same status.
    absl::Status again = x.LinkStatus();
    absl::Time t1 = absl::Now();
    SayStatus("AFTER", x.Barrier("after", absl::Now() + op_timeout), t1);
    Say(absl::StrCat("STILL_LOST ", again.ok() ? "no" : "yes"));
    for (;;) ::pause();
  }
  if (mode == "slow") {
    // One collective that rank --slow_rank joins --delay_ms late (it is busy, not stopped), so
    // the others wait in it the whole time; then --idle_ms with no collective. A second thread
    // checks the link as the daemon's watch does, throughout: it must hold.
    std::atomic<bool> done{false};
    std::atomic<bool> lost{false};
    std::thread watcher([&] {
      while (!done.load()) {
        absl::Status s = x.LinkStatus();
        if (!s.ok()) {
          SayStatus("LINK", s, start);
          lost.store(true);
          return;
        }
        absl::SleepFor(absl::Milliseconds(20));  // the watch loop's tick, not a synchronization
      }
    });
    Say("READY");
    if (rank == std::stoi(flags["slow_rank"])) {
      absl::SleepFor(absl::Milliseconds(std::stoi(flags["delay_ms"])));  // the slowness tested
    }
    absl::Time t0 = absl::Now();
    SayStatus("BARRIER", x.Barrier("slow", absl::Now() + op_timeout), t0);
    absl::SleepFor(absl::Milliseconds(std::stoi(flags["idle_ms"])));  // idle time under test
    done.store(true);
    watcher.join();
    Say(lost.load() ? "LINK_LOST" : "LINK_HELD");
    for (;;) ::pause();
  }
  Say("UNKNOWN_MODE");
  return 2;
}
