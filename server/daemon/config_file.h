// arfused's --config file (docs/operations.md): a YAML map of flag names to values, as vLLM's and
// SGLang's --config take it, or the older "name=value" lines (read with a warning). Each value
// goes through `set`, which checks it as the command line would and records where it came from.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace arfuse {

// Sets flag `name` (underscores) to `value`; `where` is "<path>:<line>", for the error.
using ConfigFileSetter = std::function<absl::Status(
    const std::string& name, const std::string& value, const std::string& where)>;

// Reads `path` and sets every flag it names through `set`. INVALID_ARGUMENT names the file and
// line of a file that cannot be read, is not valid YAML or not a map, names a flag twice, gives a
// flag no value or a value of the wrong shape, or names --config, --help or --version. A file in
// the older format adds its warning to `warnings`.
absl::Status ApplyConfigFile(const std::string& path, const ConfigFileSetter& set,
                             std::vector<std::string>& warnings);

}  // namespace arfuse
