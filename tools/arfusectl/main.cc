// arfusectl: see tools/arfusectl/cli.h and docs/config.md.
#include <iostream>
#include <string>
#include <vector>

#include "tools/arfusectl/cli.h"

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  const int code = arfuse::cli::RunArfusectl(args, std::cout, std::cerr);
  std::cout.flush();
  return code;
}
