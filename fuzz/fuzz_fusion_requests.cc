// libFuzzer: sequences of arfuse.v1 Fusion requests (RegisterRegion, UnregisterRegion,
// CreatePlan, DestroyPlan, Execute, ListRegions, Session) as raw bytes -> ParseFromArray -> the
// service's proto->struct conversion -> validation -> the registry, over a fake opener (no real
// handle or shm object is ever opened). See fusion_driver.h for the format and the oracles.
#include <cstddef>
#include <cstdint>

#include "fuzz/fusion_driver.h"
#include "spdlog/spdlog.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);  // the registry logs every session and region
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  arfuse::fuzz::RunInput(data, size);
  return 0;
}
