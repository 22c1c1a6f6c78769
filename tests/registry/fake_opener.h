// A MemoryOpener over plain host buffers, for registry and service tests: it never opens a real
// handle, yet reports an allocation size like the real openers and counts as open mappings.
#pragma once

#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "server/registry/opener.h"

namespace arfuse::testing {

class FakeMapping final : public Mapping {
 public:
  explicit FakeMapping(uint64_t size)
      : base_(std::aligned_alloc(256, (size + 255) / 256 * 256)), size_(size) {
    std::memset(base_, 0, size);
  }
  ~FakeMapping() override { std::free(base_); }
  void* base() const override { return base_; }
  uint64_t allocation_size() const override { return size_; }

 private:
  void* base_;
  uint64_t size_;
};

// Opens any spec; the allocation is `allocation_size` bytes, or byte_size when that is 0.
class FakeOpener final : public MemoryOpener {
 public:
  FakeOpener(MemoryKind kind, int32_t device, uint64_t allocation_size = 0)
      : kind_(kind), device_(device), allocation_size_(allocation_size) {}
  MemoryKind kind() const override { return kind_; }
  int32_t device_id() const override { return device_; }
  absl::StatusOr<std::unique_ptr<Mapping>> Open(const RegionSpec& spec) override {
    if (spec.shm_name == "/fail-open") {
      return absl::InvalidArgumentError("host shared-memory object could not be opened");
    }
    uint64_t size = allocation_size_ != 0 ? allocation_size_ : spec.byte_size;
    return std::unique_ptr<Mapping>(new FakeMapping(size));
  }

 private:
  MemoryKind kind_;
  int32_t device_;
  uint64_t allocation_size_;
};

inline RegionSpec HostSpec(const std::string& name, uint64_t bytes) {
  RegionSpec s;
  s.name = name;
  s.byte_size = bytes;
  s.kind = MemoryKind::kHostShm;
  s.shm_name = "/arfuse-test-" + name;
  // The call came from this process, over a connection the sidecar accepted itself.
  s.caller = OwnCredentials();
  return s;
}

}  // namespace arfuse::testing
