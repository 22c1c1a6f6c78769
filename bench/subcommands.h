// arfuse-bench subcommands, one file each. To add one (e.g. `sidecar`), write
// bench/<name>_bench.cc with an entry point of this signature, list the file in
// bench/CMakeLists.txt and add a row to kSubcommands in main.cc.
#pragma once

namespace arfuse::bench {

// argv[0] is the subcommand name; flags follow as --key=value. Returns the process exit code.
using SubcommandMain = int (*)(int argc, char** argv);

struct Subcommand {
  const char* name;
  const char* summary;
  SubcommandMain run;
};

int KernelsMain(int argc, char** argv);
int EpilogueMain(int argc, char** argv);
int SidecarMain(int argc, char** argv);

}  // namespace arfuse::bench
