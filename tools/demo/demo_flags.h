// arfuse-demo's flags (ABSL_FLAG, parsed by common/flags.h) and its --help text.
#pragma once

#include <string>

#include "absl/flags/declare.h"
#include "common/flags.h"

ABSL_DECLARE_FLAG(int, ranks);
ABSL_DECLARE_FLAG(std::string, tokens);
ABSL_DECLARE_FLAG(std::string, hidden);
ABSL_DECLARE_FLAG(std::string, dtype);
ABSL_DECLARE_FLAG(std::string, device);
ABSL_DECLARE_FLAG(bool, json);
ABSL_DECLARE_FLAG(std::string, arfused);
ABSL_DECLARE_FLAG(std::string, backend);
ABSL_DECLARE_FLAG(int, iters);
ABSL_DECLARE_FLAG(double, timeout);
ABSL_DECLARE_FLAG(std::string, planes);
ABSL_DECLARE_FLAG(std::string, doorbell);
ABSL_DECLARE_FLAG(int, client_rank);
ABSL_DECLARE_FLAG(std::string, work_dir);

namespace arfuse::demo {

// Every flag of arfuse-demo, the internal ones of its client processes included.
const flags::FlagSet& DemoFlags();

// --help: what the demo does and its user-facing flags, by name, with their defaults.
std::string Usage();

}  // namespace arfuse::demo
