// arfuse-bench sidecar: the rows it measures and their figures, the line a client process writes
// per row into its result file, and the launcher's gathering of every rank's file into the table's
// rows (the slowest rank's figures).
#pragma once

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace arfuse::bench::sidecar {

// Rows in table order.
inline constexpr const char* kRows[] = {"echo",
                                        "eager_refused",
                                        "eager",
                                        "eager_rpc",
                                        "eager_client_cuda",
                                        "eager_nowait",
                                        "eager_sync",
                                        "inproc",
                                        "busy",
                                        "busy_sm",
                                        "doorbell",
                                        "busy_idle",
                                        "busy_sm_idle",
                                        "instream",
                                        "busy_instream",
                                        "busy_sm_instream",
                                        "compute",
                                        "layer_inproc",
                                        "layer_doorbell",
                                        "layer_instream",
                                        "layer_nccl"};

struct RowResult {
  std::string row;
  uint32_t tokens = 0;
  uint32_t hidden = 0;
  double p50 = NAN, p99 = NAN, mean = NAN;
  size_t samples = 0;
  std::string path = "-";
  std::string note;  // why a row did not run, or what it ran
  bool failed = false;
};

struct Summary {
  double p50 = NAN, p99 = NAN, mean = NAN;
  size_t n = 0;
};

Summary Summarize(std::vector<double> v);
// A row of one shape, nothing measured yet.
RowResult ShapeRow(const std::string& row, uint32_t tokens, uint32_t hidden);
// The row's figures: those of its samples.
void SetFigures(const Summary& s, RowResult* r);
// `s` with tabs and line breaks as spaces, for one field of a result line.
std::string Clean(std::string s);
// One line per row in the rank's result file: tab-separated, the note last.
std::string Serialize(const RowResult& r);
bool Deserialize(const std::string& line, RowResult* r);

// Rank `rank`'s sidecar socket in the run's directory.
std::string SocketOf(const std::string& dir, int rank);
double MicrosSince(std::chrono::steady_clock::time_point t0);

// What the launcher reads back from the client ranks' result files.
struct Gathered {
  std::map<std::string, std::string> info;  // "info" lines: gpu, mps, backend, ...
  std::vector<RowResult> rows;              // the slowest rank's figures, in table order
  std::vector<std::string> errors;          // the launch's, then every rank's
};

// Reads <dir>/result.<r> of ranks 0..ranks-1 after `launch_errors`; a rank that wrote nothing is
// an error too.
Gathered GatherResults(const std::string& dir, int ranks, std::vector<std::string> launch_errors);

}  // namespace arfuse::bench::sidecar
