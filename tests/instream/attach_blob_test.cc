// The attach blob builder (server/instream/attach_blob.h): the layout it writes, the descriptor
// order, and every export it refuses (code and part of the message).
#include "server/instream/attach_blob.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <functional>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/instream/attach_abi.h"
#include "tests/instream/instream_test_util.h"

namespace arfuse::instream {
namespace {

using testing::CudaExport;
using ::testing::HasSubstr;
using testing::HostExport;
using testing::TestHostWorkspace;

class AttachBlobTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto ws = TestHostWorkspace::Create(4, 8, 64, DType::kFP32, 9);
    ASSERT_TRUE(ws.ok()) << ws.status();
    ws_ = std::move(*ws);
    fd_.reset(::memfd_create("arfuse-test-vmm", MFD_CLOEXEC));
    ASSERT_TRUE(fd_.valid());
  }

  void Refused(const std::function<void(InStreamExport&)>& edit, bool cuda,
               const std::string& part) {
    InStreamExport e = cuda ? CudaExport(fd_.get()) : HostExport(*ws_, 2);
    edit(e);
    absl::StatusOr<std::string> b = BuildAttachBlob(e, 1);
    EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << part;
    EXPECT_THAT(b.status().message(), HasSubstr(part));
  }

  std::unique_ptr<TestHostWorkspace> ws_;
  UniqueFd fd_;
};

TEST_F(AttachBlobTest, AHostBlobsLayout) {
  InStreamExport e = HostExport(*ws_, 2, {32, 64});
  absl::StatusOr<std::string> b = BuildAttachBlob(e, 42);
  ASSERT_TRUE(b.ok()) << b.status();
  AttachHeader h;
  std::memcpy(&h, b->data(), sizeof(h));
  EXPECT_EQ(h.magic, kAttachMagic);
  EXPECT_EQ(h.abi_version, kAttachAbiVersion);
  EXPECT_EQ(h.launch_abi_version, kLaunchAbiVersion);
  EXPECT_EQ(h.launch_args_bytes, kLaunchArgsBytes);
  EXPECT_EQ(h.header_bytes, sizeof(AttachHeader));
  EXPECT_EQ(h.device_kind, static_cast<uint32_t>(DeviceKind::kHost));
  EXPECT_EQ(h.rank, 2u);
  EXPECT_EQ(h.world_size, 4u);
  EXPECT_EQ(h.generation, 9u);
  EXPECT_EQ(h.attach_id, 42u);
  EXPECT_EQ(h.num_entries, 4u);
  EXPECT_EQ(h.dtype, static_cast<uint32_t>(DType::kFP32));
  EXPECT_EQ(h.host_slot_bytes, ws_->slot_bytes);
  EXPECT_EQ(h.entries_offset, 288u);
  EXPECT_EQ(h.ranks_offset, 288u + 4 * 128);
  EXPECT_EQ(h.image_offset, 288u + 4 * 128 + 4 * 96);
  EXPECT_EQ(h.image_bytes, 0u);
  EXPECT_EQ(b->size(), h.image_offset);
  for (uint32_t r = 0; r < 4; ++r) {
    RankMemory m;
    std::memcpy(&m, b->data() + h.ranks_offset + r * sizeof(m), sizeof(m));
    EXPECT_EQ(m.kind, static_cast<uint32_t>(MemoryKind::kHostShm));
    EXPECT_EQ(m.fd_index, 0) << "every rank names the group's one object";
  }
  const std::vector<int> fds = AttachBlobFds(e);
  ASSERT_EQ(fds.size(), 1u);
  EXPECT_EQ(fds[0], e.ranks[2].fd.get());
  EXPECT_STREQ(AttachMemoryKindName(e), "host_shm");
}

TEST_F(AttachBlobTest, ACudaBlobCarriesItsImageAndOneDescriptorPerVmmRank) {
  InStreamExport e = CudaExport(fd_.get());
  absl::StatusOr<std::string> b = BuildAttachBlob(e, 5);
  ASSERT_TRUE(b.ok()) << b.status();
  AttachHeader h;
  std::memcpy(&h, b->data(), sizeof(h));
  EXPECT_EQ(h.image_offset % 16, 0u);
  ASSERT_EQ(h.image_bytes, e.image_bytes);
  EXPECT_EQ(std::memcmp(b->data() + h.image_offset, e.image, e.image_bytes), 0);
  EXPECT_EQ(std::memcmp(h.layout, e.layout, sizeof(h.layout)), 0);
  KernelEntry k;
  std::memcpy(&k, b->data() + h.entries_offset + 3 * sizeof(k), sizeof(k));
  EXPECT_STREQ(k.function, e.entries[3].function);
  EXPECT_EQ(k.rows_divisor, 2u);
  for (uint32_t r = 0; r < 2; ++r) {
    RankMemory m;
    std::memcpy(&m, b->data() + h.ranks_offset + r * sizeof(m), sizeof(m));
    EXPECT_EQ(m.fd_index, static_cast<int32_t>(r));
  }
  const std::vector<int> fds = AttachBlobFds(e);
  ASSERT_EQ(fds.size(), 2u);
  EXPECT_EQ(fds[1], e.ranks[1].fd.get());
  EXPECT_STREQ(AttachMemoryKindName(e), "vmm_posix_fd");
}

TEST_F(AttachBlobTest, HandlesOfIpcAndFabricMemoryAreCopied) {
  InStreamExport e = CudaExport(fd_.get());
  for (uint32_t r = 0; r < 2; ++r) {
    e.ranks[r].fd.reset();
    e.ranks[r].kind = r == 0 ? MemoryKind::kCudaIpc : MemoryKind::kVmmFabric;
    e.ranks[r].handle = std::string(64, static_cast<char>('a' + r));
  }
  absl::StatusOr<std::string> b = BuildAttachBlob(e, 5);
  ASSERT_TRUE(b.ok()) << b.status();
  AttachHeader h;
  std::memcpy(&h, b->data(), sizeof(h));
  RankMemory m;
  std::memcpy(&m, b->data() + h.ranks_offset + sizeof(m), sizeof(m));
  EXPECT_EQ(m.fd_index, -1);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(m.handle), 64), std::string(64, 'b'));
  EXPECT_TRUE(AttachBlobFds(e).empty());
  EXPECT_STREQ(AttachMemoryKindName(e), "cuda_ipc");
}

TEST_F(AttachBlobTest, Refusals) {
  Refused([](InStreamExport& e) { e.device = static_cast<DeviceKind>(9); }, false,
          "export device_kind 9 is unknown");
  Refused([](InStreamExport& e) { e.world_size = 17; }, false,
          "export world_size 17 is out of range [1, 16]");
  Refused([](InStreamExport& e) { e.rank = 4; }, false,
          "export rank 4 is out of range for world_size 4");
  Refused([](InStreamExport& e) { e.ranks.pop_back(); }, false,
          "export has 3 rank memories for world_size 4");
  Refused([](InStreamExport& e) { e.entries.resize(161); }, false,
          "export has 161 kernel entries, at most 160");
  Refused([](InStreamExport& e) { std::memset(e.entries[1].function, 'f', kFunctionNameBytes); },
          false, "export entry 1's function name is not NUL-terminated");
  Refused([](InStreamExport& e) { e.image_bytes = 0; }, true, "a CUDA export needs a kernel image");
  Refused(
      [&](InStreamExport& e) {
        e.image = &e;
        e.image_bytes = 4;
      },
      false, "a host export has no kernel image");
  Refused([&](InStreamExport& e) { e.ranks[0].fd.reset(::dup(fd_.get())); }, false,
          "more than one host workspace descriptor");
  Refused([](InStreamExport& e) { e.ranks[2].fd.reset(); }, false,
          "host export without the workspace's descriptor");
  Refused([](InStreamExport& e) { e.ranks[1].kind = MemoryKind::kCudaIpc; }, false,
          "export rank 1: GPU memory in a host export");
  Refused([](InStreamExport& e) { e.ranks[0].kind = MemoryKind::kHostShm; }, true,
          "export rank 0: host memory in a CUDA export");
  Refused([](InStreamExport& e) { e.ranks[1].fd.reset(); }, true,
          "export rank 1: a VMM POSIX-FD memory without its descriptor");
  Refused(
      [](InStreamExport& e) {
        e.ranks[0].kind = MemoryKind::kCudaIpc;
        e.ranks[0].handle = std::string(64, 'x');
      },
      true, "export rank 0 holds a descriptor its memory kind does not use");
  Refused(
      [](InStreamExport& e) {
        e.ranks[0].fd.reset();
        e.ranks[0].kind = MemoryKind::kVmmFabric;
        e.ranks[0].handle = "short";
      },
      true, "export rank 0: handle is 5 bytes, not 64");
  Refused([](InStreamExport& e) { e.ranks[1].handle = std::string(64, 'x'); }, true,
          "export rank 1: a handle its memory kind does not use");
  Refused(
      [](InStreamExport& e) {
        e.ranks[0].fd.reset();
        e.ranks[0].kind = static_cast<MemoryKind>(7);
      },
      true, "export rank 0: memory kind 7 is unknown");
}

}  // namespace
}  // namespace arfuse::instream
