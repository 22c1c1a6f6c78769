#include "tools/arfusectl/top.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "arfuse/v1/admin.grpc.pb.h"
#include "arfuse/v1/fusion.grpc.pb.h"
#include "common/json.h"
#include "common/version.h"
#include "tools/arfusectl/commands.h"

namespace arfuse::cli {

// ---- the text exposition ----

namespace {

// Reads a label value after its opening quote; `i` ends after the closing one.
bool ReadQuoted(const std::string& line, size_t& i, std::string* out) {
  for (; i < line.size(); ++i) {
    const char c = line[i];
    if (c == '"') {
      ++i;
      return true;
    }
    if (c == '\\' && i + 1 < line.size()) {
      const char n = line[++i];
      out->push_back(n == 'n' ? '\n' : n);
    } else {
      out->push_back(c);
    }
  }
  return false;
}

bool ParseValue(absl::string_view text, double* out) {
  if (text == "+Inf" || text == "Inf") {
    *out = std::numeric_limits<double>::infinity();
    return true;
  }
  if (text == "-Inf") {
    *out = -std::numeric_limits<double>::infinity();
    return true;
  }
  if (text == "NaN") {
    *out = std::numeric_limits<double>::quiet_NaN();
    return true;
  }
  return absl::SimpleAtod(text, out);
}

}  // namespace

absl::StatusOr<std::vector<MetricSample>> ParseExposition(const std::string& text) {
  std::vector<MetricSample> out;
  int number = 0;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    ++number;
    const std::string line(absl::StripAsciiWhitespace(raw));
    if (line.empty() || line[0] == '#') continue;
    auto bad = [&](const char* why) {
      return absl::InvalidArgumentError(
          absl::StrCat("metrics line ", number, ": ", why, ": ", line.substr(0, 120)));
    };
    MetricSample s;
    size_t i = 0;
    while (i < line.size() && (absl::ascii_isalnum(line[i]) || line[i] == '_' || line[i] == ':')) {
      ++i;
    }
    s.name = line.substr(0, i);
    if (s.name.empty()) return bad("no metric name");
    if (i < line.size() && line[i] == '{') {
      ++i;
      while (true) {
        while (i < line.size() && (line[i] == ' ' || line[i] == ',')) ++i;
        if (i < line.size() && line[i] == '}') {
          ++i;
          break;
        }
        const size_t eq = line.find('=', i);
        if (eq == std::string::npos || eq + 1 >= line.size() || line[eq + 1] != '"') {
          return bad("malformed label");
        }
        std::string key = std::string(absl::StripAsciiWhitespace(line.substr(i, eq - i)));
        i = eq + 2;
        std::string value;
        if (!ReadQuoted(line, i, &value)) return bad("unterminated label value");
        s.labels[key] = std::move(value);
      }
    }
    std::vector<absl::string_view> rest =
        absl::StrSplit(absl::string_view(line).substr(i), ' ', absl::SkipEmpty());
    if (rest.empty() || !ParseValue(rest[0], &s.value)) return bad("no value");
    out.push_back(std::move(s));
  }
  return out;
}

std::optional<double> HistogramQuantile(double q, const std::map<double, double>& cumulative) {
  if (cumulative.empty()) return std::nullopt;
  const double total = cumulative.rbegin()->second;
  if (!(total > 0)) return std::nullopt;
  const double rank = q * total;
  double lower = 0, below = 0;
  for (const auto& [le, count] : cumulative) {
    if (count >= rank) {
      // In the +Inf bucket the best estimate is the largest finite bound, as Prometheus answers.
      if (std::isinf(le)) return lower;
      const double in_bucket = count - below;
      if (in_bucket <= 0) return le;
      return lower + (le - lower) * (rank - below) / in_bucket;
    }
    lower = le;
    below = count;
  }
  return lower;
}

// ---- scraping ----

absl::StatusOr<std::string> ScrapeMetrics(const std::string& host_port,
                                          std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto left_ms = [&] {
    return static_cast<int>(std::max<int64_t>(
        0, std::chrono::duration_cast<std::chrono::milliseconds>(deadline -
                                                                 std::chrono::steady_clock::now())
               .count()));
  };
  std::string host = host_port, port;
  const size_t colon = host_port.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address \"", host_port.substr(0, 64), "\" is not HOST:PORT"));
  }
  host = host_port.substr(0, colon);
  port = host_port.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &found) != 0 || found == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot resolve ", host_port));
  }
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> owner(found, freeaddrinfo);
  // One descriptor, closed on every return.
  struct Fd {
    int fd;
    ~Fd() {
      if (fd >= 0) ::close(fd);
    }
  } sock{::socket(found->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)};
  if (sock.fd < 0) return absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno)));
  if (::connect(sock.fd, found->ai_addr, found->ai_addrlen) != 0 && errno != EINPROGRESS) {
    return absl::UnavailableError(
        absl::StrCat("cannot reach metrics at ", host_port, ": ", std::strerror(errno)));
  }
  pollfd p{sock.fd, POLLOUT, 0};
  if (::poll(&p, 1, left_ms()) <= 0) {
    return absl::DeadlineExceededError(absl::StrCat("no connection to metrics at ", host_port));
  }
  int so_error = 0;
  socklen_t len = sizeof(so_error);
  ::getsockopt(sock.fd, SOL_SOCKET, SO_ERROR, &so_error, &len);
  if (so_error != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot reach metrics at ", host_port, ": ", std::strerror(so_error)));
  }
  const std::string request = "GET /metrics HTTP/1.0\r\nHost: " + host_port + "\r\n\r\n";
  if (::send(sock.fd, request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    return absl::UnavailableError(absl::StrCat("metrics at ", host_port, ": request not sent"));
  }
  std::string reply;
  char buf[16384];
  while (true) {
    pollfd r{sock.fd, POLLIN, 0};
    const int ready = ::poll(&r, 1, left_ms());
    if (ready <= 0) {
      return absl::DeadlineExceededError(absl::StrCat("metrics at ", host_port, " answered late"));
    }
    const ssize_t n = ::recv(sock.fd, buf, sizeof(buf), 0);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      return absl::UnavailableError(
          absl::StrCat("metrics at ", host_port, ": ", std::strerror(errno)));
    }
    reply.append(buf, static_cast<size_t>(n));
    // Bounded: a scrape of one sidecar is a few kB.
    if (reply.size() > (16u << 20)) {
      return absl::InternalError(absl::StrCat("metrics at ", host_port, ": reply over 16 MiB"));
    }
  }
  const size_t body = reply.find("\r\n\r\n");
  if (reply.rfind("HTTP/1.", 0) != 0 || body == std::string::npos) {
    return absl::InternalError(absl::StrCat("metrics at ", host_port, ": not an HTTP reply"));
  }
  const std::string status_line = reply.substr(0, reply.find("\r\n"));
  if (status_line.find(" 200") == std::string::npos) {
    return absl::InternalError(
        absl::StrCat("metrics at ", host_port, " answered ", status_line.substr(0, 64)));
  }
  return reply.substr(body + 4);
}

// ---- samples and lines ----

namespace {

// The in-stream client library's counters as the sidecar exports them (added beside the
// launch counter; absent from sidecars that predate them: top shows "-").
constexpr char kInStreamOps[] = "arfuse_instream_ops_total";

struct Sample {
  bool reachable = false;
  std::string error;
  std::chrono::steady_clock::time_point at;
  // Fusion.GetWorkspaceInfo and Admin.GetStats.
  int64_t rank = -1;
  uint32_t world_size = 0;
  std::string backend, state;
  bool fusion_enabled = false;
  uint64_t generation = 0, poisonings = 0, sidecar_ops = 0;
  // The metrics endpoint; metrics_error says why it is missing.
  bool has_metrics = false;
  std::string metrics_error;
  bool has_instream_ops = false;
  double fused = 0, declined = 0;
  std::map<std::string, double> declined_by_reason;
  std::map<std::string, double> ops_by_plane;  // arfuse_ops_total by plane
  double instream_launches = 0, attachments = 0;
  std::map<double, double> latency;  // cumulative, every series summed, by le
};

void ReadMetrics(const std::string& text, Sample* s) {
  absl::StatusOr<std::vector<MetricSample>> parsed = ParseExposition(text);
  if (!parsed.ok()) {
    s->metrics_error = std::string(parsed.status().message());
    return;
  }
  s->has_metrics = true;
  for (const MetricSample& m : *parsed) {
    auto label = [&](const char* key) {
      auto it = m.labels.find(key);
      return it == m.labels.end() ? std::string() : it->second;
    };
    if (m.name == kInStreamOps) {
      s->has_instream_ops = true;
      const std::string path = label("path");
      if (path == "fused") {
        s->fused += m.value;
      } else if (path == "declined") {
        s->declined += m.value;
        s->declined_by_reason[label("reason")] += m.value;
      }
    } else if (m.name == "arfuse_ops_total") {
      s->ops_by_plane[label("plane")] += m.value;
    } else if (m.name == "arfuse_instream_launches_total") {
      s->instream_launches += m.value;
    } else if (m.name == "arfuse_instream_attachments") {
      s->attachments += m.value;
    } else if (m.name == "arfuse_op_latency_seconds_bucket") {
      double le = 0;
      if (ParseValue(label("le"), &le)) s->latency[le] += m.value;
    }
  }
}

std::shared_ptr<grpc::Channel> TopChannel(const std::string& addr, int interval_ms) {
  grpc::ChannelArguments args;
  // A sidecar that went away and came back is found again within about one refresh, not after
  // gRPC's default reconnect back-off (up to two minutes).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, std::clamp(interval_ms, 100, 5000));
  return grpc::CreateCustomChannel(addr, grpc::InsecureChannelCredentials(), args);
}

Sample Take(const std::shared_ptr<grpc::Channel>& channel, const std::string& metrics,
            int timeout_ms) {
  Sample s;
  v1::GetWorkspaceInfoResponse ws;
  grpc::Status st =
      v1::Fusion::NewStub(channel)->GetWorkspaceInfo(NewCallContext(timeout_ms).get(), {}, &ws);
  s.at = std::chrono::steady_clock::now();
  if (!st.ok()) {
    s.error = GrpcStatusText(st);
    return s;
  }
  v1::GetStatsResponse stats;
  st = v1::Admin::NewStub(channel)->GetStats(NewCallContext(timeout_ms).get(), {}, &stats);
  if (!st.ok()) {
    s.error = GrpcStatusText(st);
    return s;
  }
  s.reachable = true;
  s.rank = ws.rank();
  s.world_size = ws.world_size();
  s.backend = ws.backend();
  s.fusion_enabled = ws.fusion_enabled();
  s.state = StateText(ws.state());
  s.generation = ws.generation();
  s.poisonings = stats.poisonings();
  s.sidecar_ops = stats.ops_ok() + stats.ops_failed();
  if (!metrics.empty()) {
    absl::StatusOr<std::string> text =
        ScrapeMetrics(metrics, std::chrono::milliseconds(timeout_ms));
    if (text.ok()) {
      ReadMetrics(*text, &s);
    } else {
      s.metrics_error = std::string(text.status().message());
    }
  }
  return s;
}

// A counter's increase between two samples; a smaller value means the sidecar restarted, and
// then everything it counted since is new.
double Increase(double before, double now) { return now >= before ? now - before : now; }

struct Line {
  std::string addr;
  bool reachable = false;
  std::string error;
  int64_t rank = -1;
  std::string state, plane, backend, top_decline;
  uint64_t generation = 0, poisonings = 0;
  std::optional<double> fused_per_s, declined_per_s, sidecar_per_s, p50_s, p99_s;
  std::map<std::string, double> declined_per_s_by_reason;
  std::string metrics_error;
};

Line MakeLine(const std::string& addr, const Sample& prev, const Sample& cur, int64_t known_rank) {
  Line l;
  l.addr = addr;
  l.rank = cur.reachable ? cur.rank : known_rank;
  l.reachable = cur.reachable;
  l.error = cur.error;
  if (!cur.reachable) return l;
  l.state = cur.state;
  l.backend = cur.backend + (cur.fusion_enabled ? "" : " (off)");
  l.generation = cur.generation;
  l.poisonings = cur.poisonings;
  l.metrics_error = cur.metrics_error;
  // Rates need two answers of one process; after a gap the first answer only sets the base.
  const bool paired = prev.reachable;
  const double dt = std::max(1e-3, std::chrono::duration<double>(cur.at - prev.at).count());
  if (paired) {
    l.sidecar_per_s =
        Increase(static_cast<double>(prev.sidecar_ops), static_cast<double>(cur.sidecar_ops)) / dt;
  }
  if (!cur.has_metrics) {
    l.plane = "-";
    return l;
  }
  const bool metrics_paired = paired && prev.has_metrics;
  std::vector<std::string> planes;
  double instream_increase = 0;
  if (metrics_paired && cur.has_instream_ops && prev.has_instream_ops) {
    const double fused = Increase(prev.fused, cur.fused);
    const double declined = Increase(prev.declined, cur.declined);
    instream_increase = fused + declined;
    l.fused_per_s = fused / dt;
    l.declined_per_s = declined / dt;
    double best = 0;
    for (const auto& [reason, count] : cur.declined_by_reason) {
      auto before = prev.declined_by_reason.find(reason);
      const double inc =
          Increase(before == prev.declined_by_reason.end() ? 0 : before->second, count);
      if (inc <= 0) continue;
      l.declined_per_s_by_reason[reason] = inc / dt;
      if (inc > best) {
        best = inc;
        l.top_decline = reason.empty() ? "?" : reason;
      }
    }
  }
  if (metrics_paired) {
    if (instream_increase > 0 || Increase(prev.instream_launches, cur.instream_launches) > 0) {
      planes.push_back("instream");
    }
    for (const auto& [plane, count] : cur.ops_by_plane) {
      auto before = prev.ops_by_plane.find(plane);
      if (Increase(before == prev.ops_by_plane.end() ? 0 : before->second, count) > 0) {
        planes.push_back(plane.empty() ? "?" : plane);
      }
    }
    // The latency of the ops of this interval: the difference of the cumulative buckets.
    std::map<double, double> window;
    for (const auto& [le, count] : cur.latency) {
      auto before = prev.latency.find(le);
      window[le] = Increase(before == prev.latency.end() ? 0 : before->second, count);
    }
    l.p50_s = HistogramQuantile(0.5, window);
    l.p99_s = HistogramQuantile(0.99, window);
  }
  if (planes.empty()) {
    // Nothing ran: an attached in-stream client is still the plane its ops will take.
    l.plane = cur.attachments > 0 ? "instream (idle)" : "idle";
  } else {
    l.plane = absl::StrJoin(planes, "+");
  }
  return l;
}

std::string Rate(const std::optional<double>& r) {
  if (!r) return "-";
  return *r >= 100 ? absl::StrFormat("%.0f", *r) : absl::StrFormat("%.1f", *r);
}

std::string Micros(const std::optional<double>& s) {
  if (!s) return "-";
  return absl::StrFormat("%.0fus", *s * 1e6);
}

std::string JsonNumber(const std::optional<double>& v, double scale = 1) {
  if (!v) return "null";
  return absl::StrFormat("%.3f", *v * scale);
}

constexpr char kHeaderFormat[] = "%-4s %-12s %-16s %-14s %-5s %9s %10s %-12s %9s %8s %8s %6s  %s";

std::string Header() {
  return absl::StrFormat(kHeaderFormat, "RANK", "STATE", "PLANE", "BACKEND", "GEN", "FUSED/S",
                         "DECLINED/S", "TOP-DECLINE", "SIDECAR/S", "P50", "P99", "POISON", "ADDR");
}

std::string RankText(int64_t rank) { return rank < 0 ? "?" : absl::StrCat(rank); }

std::string Text(const Line& l, int interval_ms) {
  if (!l.reachable) {
    return absl::StrFormat(
        "%-4s %-12s arfused at %s does not answer (%s); trying again every %d ms", RankText(l.rank),
        "UNREACHABLE", l.addr, l.error, interval_ms);
  }
  std::string line = absl::StrFormat(
      kHeaderFormat, RankText(l.rank), l.state, l.plane, l.backend, absl::StrCat(l.generation),
      Rate(l.fused_per_s), Rate(l.declined_per_s), l.top_decline.empty() ? "-" : l.top_decline,
      Rate(l.sidecar_per_s), Micros(l.p50_s), Micros(l.p99_s), absl::StrCat(l.poisonings), l.addr);
  if (!l.metrics_error.empty()) absl::StrAppend(&line, " (metrics: ", l.metrics_error, ")");
  return line;
}

std::string Json(const Line& l, int iteration) {
  std::string out = absl::StrCat("{\"iteration\":", iteration, ",\"addr\":", JsonQuote(l.addr),
                                 ",\"rank\":", l.rank < 0 ? "null" : absl::StrCat(l.rank),
                                 ",\"reachable\":", l.reachable ? "true" : "false");
  if (!l.reachable) return absl::StrCat(out, ",\"error\":", JsonQuote(l.error), "}");
  absl::StrAppend(&out, ",\"state\":", JsonQuote(l.state), ",\"plane\":", JsonQuote(l.plane),
                  ",\"backend\":", JsonQuote(l.backend), ",\"generation\":", l.generation,
                  ",\"fused_per_s\":", JsonNumber(l.fused_per_s),
                  ",\"declined_per_s\":", JsonNumber(l.declined_per_s),
                  ",\"declined_per_s_by_reason\":{");
  bool first = true;
  for (const auto& [reason, rate] : l.declined_per_s_by_reason) {
    absl::StrAppend(&out, first ? "" : ",", JsonQuote(reason), ":", JsonNumber(rate));
    first = false;
  }
  absl::StrAppend(
      &out, "},\"sidecar_ops_per_s\":", JsonNumber(l.sidecar_per_s),
      ",\"p50_us\":", JsonNumber(l.p50_s, 1e6), ",\"p99_us\":", JsonNumber(l.p99_s, 1e6),
      ",\"poisonings\":", l.poisonings,
      ",\"metrics_error\":", l.metrics_error.empty() ? "null" : JsonQuote(l.metrics_error), "}");
  return out;
}

}  // namespace

int RunTop(const TopOptions& o, std::ostream& out, std::ostream& err) {
  const size_t n = o.addrs.size();
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (const std::string& a : o.addrs) channels.push_back(TopChannel(a, o.interval_ms));
  auto sample_all = [&] {
    std::vector<Sample> samples(n);
    ForEachConcurrently(n, [&](size_t i) {
      samples[i] = Take(channels[i], o.metrics.empty() ? "" : o.metrics[i], o.timeout_ms);
    });
    return samples;
  };
  std::vector<Sample> prev = sample_all();
  std::vector<int64_t> known_rank(n, -1);
  if (!o.json && !o.screen) out << Header() << "\n" << std::flush;
  bool all_answered = true;
  for (int it = 1; o.iterations == 0 || it <= o.iterations; ++it) {
    std::this_thread::sleep_for(std::chrono::milliseconds(o.interval_ms));
    std::vector<Sample> cur = sample_all();
    all_answered = true;
    std::string screen;
    if (o.screen) {
      // Home, clear to the end: one screen per refresh.
      screen = absl::StrCat("\033[H\033[J", VersionLine("arfusectl top"), ", every ", o.interval_ms,
                            " ms\n", Header(), "\n");
    }
    for (size_t i = 0; i < n; ++i) {
      if (cur[i].reachable) known_rank[i] = cur[i].rank;
      all_answered = all_answered && cur[i].reachable;
      const Line line = MakeLine(o.addrs[i], prev[i], cur[i], known_rank[i]);
      absl::StrAppend(&screen, o.json ? Json(line, it) : Text(line, o.interval_ms), "\n");
    }
    out << screen << std::flush;
    prev = std::move(cur);
  }
  (void)err;
  return all_answered ? kExitOk : kExitUnreachable;
}

}  // namespace arfuse::cli
