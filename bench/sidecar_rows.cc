#include "bench/sidecar_rows.h"

#include <algorithm>
#include <fstream>
#include <iterator>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace arfuse::bench::sidecar {

Summary Summarize(std::vector<double> v) {
  Summary s;
  s.n = v.size();
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  auto pct = [&](double q) {
    size_t k = static_cast<size_t>(std::ceil(q * static_cast<double>(v.size())));
    return v[std::min(v.size() - 1, k == 0 ? 0 : k - 1)];
  };
  s.p50 = pct(0.50);
  s.p99 = pct(0.99);
  double sum = 0;
  for (double x : v) sum += x;
  s.mean = sum / static_cast<double>(v.size());
  return s;
}

RowResult ShapeRow(const std::string& row, uint32_t tokens, uint32_t hidden) {
  RowResult r;
  r.row = row;
  r.tokens = tokens;
  r.hidden = hidden;
  return r;
}

void SetFigures(const Summary& s, RowResult* r) {
  r->p50 = s.p50;
  r->p99 = s.p99;
  r->mean = s.mean;
  r->samples = s.n;
}

std::string Clean(std::string s) {
  for (char& c : s) {
    if (c == '\t' || c == '\n' || c == '\r') c = ' ';
  }
  return s;
}

std::string Serialize(const RowResult& r) {
  return absl::StrFormat("row\t%s\t%u\t%u\t%.17g\t%.17g\t%.17g\t%u\t%s\t%d\t%s\n", r.row, r.tokens,
                         r.hidden, r.p50, r.p99, r.mean, static_cast<unsigned>(r.samples),
                         Clean(r.path), r.failed ? 1 : 0, Clean(r.note));
}

bool Deserialize(const std::string& line, RowResult* r) {
  std::vector<std::string> p = absl::StrSplit(line, '\t');
  if (p.size() < 11 || p[0] != "row") return false;
  r->row = p[1];
  unsigned n = 0;
  int failed = 0;
  auto dbl = [](const std::string& s) {
    double x = NAN;
    return absl::SimpleAtod(s, &x) ? x : NAN;
  };
  if (!absl::SimpleAtoi(p[2], &r->tokens) || !absl::SimpleAtoi(p[3], &r->hidden) ||
      !absl::SimpleAtoi(p[7], &n) || !absl::SimpleAtoi(p[9], &failed)) {
    return false;
  }
  r->p50 = dbl(p[4]);
  r->p99 = dbl(p[5]);
  r->mean = dbl(p[6]);
  r->samples = n;
  r->path = p[8];
  r->failed = failed != 0;
  r->note = p[10];
  return true;
}

std::string SocketOf(const std::string& dir, int rank) {
  return absl::StrCat(dir, "/rank", rank, ".sock");
}

double MicrosSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

Gathered GatherResults(const std::string& dir, int ranks, std::vector<std::string> launch_errors) {
  Gathered g;
  g.errors = std::move(launch_errors);
  std::map<std::string, std::string>& info = g.info;
  std::vector<RowResult>& rows = g.rows;
  std::vector<std::string>& errors = g.errors;
  int reported = 0;
  for (int r = 0; r < ranks; ++r) {
    std::ifstream in(absl::StrCat(dir, "/result.", r));
    std::string line;
    bool any = false;
    while (std::getline(in, line)) {
      any = true;
      if (line.rfind("error\t", 0) == 0) {
        errors.push_back(absl::StrCat("rank ", r, ": ", line.substr(6)));
        continue;
      }
      if (line.rfind("info\t", 0) == 0) {
        std::vector<std::string> p = absl::StrSplit(line, absl::MaxSplits('\t', 2));
        if (p.size() == 3) info[p[1]] = p[2];
        continue;
      }
      RowResult got;
      if (!Deserialize(line, &got)) continue;
      bool merged = false;
      for (RowResult& have : rows) {
        if (have.row != got.row || have.tokens != got.tokens || have.hidden != got.hidden) continue;
        auto worst = [](double a, double b) {
          return std::isnan(a) ? b : (std::isnan(b) ? a : std::max(a, b));
        };
        have.p50 = worst(have.p50, got.p50);
        have.p99 = worst(have.p99, got.p99);
        have.mean = worst(have.mean, got.mean);
        have.samples = std::min(have.samples, got.samples);
        have.failed = have.failed || got.failed;
        if (got.failed && !have.note.empty() && have.note != got.note) have.note = got.note;
        merged = true;
      }
      if (!merged) rows.push_back(got);
    }
    if (any) ++reported;
  }
  if (reported != ranks) {
    errors.push_back(absl::StrCat(reported, " of ", ranks, " client ranks reported"));
  }
  auto order = [](const std::string& row) {
    for (size_t i = 0; i < std::size(kRows); ++i) {
      if (row == kRows[i]) return i;
    }
    return std::size(kRows);
  };
  std::stable_sort(rows.begin(), rows.end(), [&](const RowResult& a, const RowResult& b) {
    if (a.hidden != b.hidden) return a.hidden < b.hidden;
    if (a.tokens != b.tokens) return a.tokens < b.tokens;
    return order(a.row) < order(b.row);
  });
  return g;
}

}  // namespace arfuse::bench::sidecar
