// The sidecar's attach blob builder (server/instream/attach_blob.h): layout, descriptors, and
// the exports it refuses.
#include "server/instream/attach_blob.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstring>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace arfuse {
namespace {

using instream::AttachHeader;
using instream::KernelEntry;
using instream::MemoryKind;
using instream::RankMemory;
using ::testing::HasSubstr;

UniqueFd DevNull() { return UniqueFd(::open("/dev/null", O_RDONLY | O_CLOEXEC)); }

InStreamExport CudaExport(MemoryKind kind, int world = 2) {
  static const char kImage[64] = "not a real fatbin";
  InStreamExport e;
  e.device = instream::DeviceKind::kCuda;
  e.rank = 1;
  e.world_size = static_cast<uint32_t>(world);
  e.generation = 7;
  e.sm = 90;
  e.sm_budget = 47;
  e.spin_timeout_ns = 5'000'000'000ull;
  e.oneshot_max_bytes = 1 << 20;
  e.twoshot_max_bytes = 32 << 20;
  e.max_tokens = 2048;
  e.hidden = 8192;
  e.image = kImage;
  e.image_bytes = sizeof(kImage);
  KernelEntry entry{};
  entry.hidden = 4096;
  entry.block_threads = 256;
  entry.max_grid = 94;
  entry.rows_divisor = 1;
  std::strcpy(entry.function, "arfuse_is_bf16_arnorm_oneshot_b0");
  e.entries = {entry, entry};
  for (int r = 0; r < world; ++r) {
    InStreamRankMemory m;
    m.kind = kind;
    m.bytes = 1 << 21;
    if (kind == MemoryKind::kVmmPosixFd) {
      m.fd = DevNull();
    } else {
      m.handle.assign(64, static_cast<char>('a' + r));
    }
    e.ranks.push_back(std::move(m));
  }
  return e;
}

TEST(AttachBlob, LaysOutHeaderEntriesRanksAndImage) {
  absl::StatusOr<AttachBlob> blob = BuildAttachBlob(CudaExport(MemoryKind::kCudaIpc), 42);
  ASSERT_TRUE(blob.ok()) << blob.status();
  AttachHeader h;
  ASSERT_GE(blob->bytes.size(), sizeof(h));
  std::memcpy(&h, blob->bytes.data(), sizeof(h));
  EXPECT_EQ(h.magic, instream::kAttachMagic);
  EXPECT_EQ(h.abi_version, instream::kAttachAbiVersion);
  EXPECT_EQ(h.launch_abi_version, instream::kLaunchAbiVersion);
  EXPECT_EQ(h.launch_args_bytes, instream::kLaunchArgsBytes);
  EXPECT_EQ(h.header_bytes, sizeof(AttachHeader));
  EXPECT_EQ(h.entry_bytes, sizeof(KernelEntry));
  EXPECT_EQ(h.rank_bytes, sizeof(RankMemory));
  EXPECT_EQ(h.attach_id, 42u);
  EXPECT_EQ(h.generation, 7u);
  EXPECT_EQ(h.rank, 1u);
  EXPECT_EQ(h.world_size, 2u);
  EXPECT_EQ(h.num_entries, 2u);
  EXPECT_EQ(h.sm_budget, 47u);
  for (uint64_t off : {h.entries_offset, h.ranks_offset, h.image_offset}) EXPECT_EQ(off % 16, 0u);
  EXPECT_EQ(h.ranks_offset, h.entries_offset + 2 * sizeof(KernelEntry));
  EXPECT_EQ(h.image_offset + h.image_bytes, blob->bytes.size());
  RankMemory r1;
  std::memcpy(&r1, blob->bytes.data() + h.ranks_offset + sizeof(RankMemory), sizeof(r1));
  EXPECT_EQ(r1.kind, static_cast<uint32_t>(MemoryKind::kCudaIpc));
  EXPECT_EQ(r1.fd_index, -1);
  EXPECT_EQ(r1.handle[0], 'b');
  EXPECT_EQ(std::memcmp(blob->bytes.data() + h.image_offset, "not a real fatbin", 17), 0);
  EXPECT_TRUE(blob->fds.empty());
  EXPECT_EQ(blob->memory_kind, "cuda_ipc");
}

TEST(AttachBlob, PosixFdRanksIndexTheirDescriptorsInOrder) {
  absl::StatusOr<AttachBlob> blob = BuildAttachBlob(CudaExport(MemoryKind::kVmmPosixFd, 4), 1);
  ASSERT_TRUE(blob.ok()) << blob.status();
  ASSERT_EQ(blob->fds.size(), 4u);
  AttachHeader h;
  std::memcpy(&h, blob->bytes.data(), sizeof(h));
  for (int r = 0; r < 4; ++r) {
    RankMemory m;
    std::memcpy(&m, blob->bytes.data() + h.ranks_offset + r * sizeof(RankMemory), sizeof(m));
    EXPECT_EQ(m.fd_index, r);
    EXPECT_TRUE(blob->fds[r]);
  }
  EXPECT_EQ(blob->memory_kind, "vmm_posix_fd");
}

TEST(AttachBlob, HostWorkspaceIsOneDescriptorForEveryRank) {
  InStreamExport e;
  e.device = instream::DeviceKind::kHost;
  e.world_size = 2;
  e.host_slot_bytes = 4096;
  for (int r = 0; r < 2; ++r) {
    InStreamRankMemory m;
    m.kind = MemoryKind::kHostShm;
    m.bytes = 1 << 16;
    if (r == 1) m.fd = DevNull();
    e.ranks.push_back(std::move(m));
  }
  absl::StatusOr<AttachBlob> blob = BuildAttachBlob(std::move(e), 3);
  ASSERT_TRUE(blob.ok()) << blob.status();
  ASSERT_EQ(blob->fds.size(), 1u);
  AttachHeader h;
  std::memcpy(&h, blob->bytes.data(), sizeof(h));
  EXPECT_EQ(h.image_bytes, 0u);
  EXPECT_EQ(h.host_slot_bytes, 4096u);
  for (int r = 0; r < 2; ++r) {
    RankMemory m;
    std::memcpy(&m, blob->bytes.data() + h.ranks_offset + r * sizeof(RankMemory), sizeof(m));
    EXPECT_EQ(m.fd_index, 0);
  }
}

TEST(AttachBlob, RefusesInconsistentExports) {
  InStreamExport few = CudaExport(MemoryKind::kCudaIpc);
  few.ranks.pop_back();
  EXPECT_THAT(BuildAttachBlob(std::move(few), 1).status().message(), HasSubstr("1 ranks"));

  InStreamExport short_handle = CudaExport(MemoryKind::kVmmFabric);
  short_handle.ranks[1].handle.resize(10);
  absl::Status s = BuildAttachBlob(std::move(short_handle), 1).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("rank 1's vmm_fabric handle has 10 bytes"));

  InStreamExport no_fd = CudaExport(MemoryKind::kVmmPosixFd);
  no_fd.ranks[0].fd.reset();
  EXPECT_THAT(BuildAttachBlob(std::move(no_fd), 1).status().message(),
              HasSubstr("rank 0 has no fd"));

  InStreamExport no_image = CudaExport(MemoryKind::kCudaIpc);
  no_image.image = nullptr;
  EXPECT_THAT(BuildAttachBlob(std::move(no_image), 1).status().message(),
              HasSubstr("no kernel image"));

  InStreamExport no_entries = CudaExport(MemoryKind::kCudaIpc);
  no_entries.entries.clear();
  EXPECT_THAT(BuildAttachBlob(std::move(no_entries), 1).status().message(),
              HasSubstr("no kernel entry"));

  InStreamExport bad_rank = CudaExport(MemoryKind::kCudaIpc);
  bad_rank.rank = 2;
  EXPECT_THAT(BuildAttachBlob(std::move(bad_rank), 1).status().message(),
              HasSubstr("for rank 2 of 2"));

  InStreamExport host_without_fd;
  host_without_fd.world_size = 1;
  host_without_fd.ranks.emplace_back();
  host_without_fd.ranks[0].kind = MemoryKind::kHostShm;
  EXPECT_THAT(BuildAttachBlob(std::move(host_without_fd), 1).status().message(),
              HasSubstr("host workspace has no fd"));
}

}  // namespace
}  // namespace arfuse
