// arfuse_attach's checks of the attach blob, one test per rule: the code and part of the message.
// Blobs come from the blob builder (server/instream/attach_blob.h) and are then broken one
// field at a time. Runs without a GPU: every rule is checked before the driver is loaded.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/instream/blob_reader.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/host/host_collective.h"
#include "kernels/instream/attach_abi.h"
#include "kernels/instream/op_counters.h"
#include "server/instream/attach_blob.h"
#include "tests/instream/instream_test_util.h"

namespace arfuse::instream {
namespace {

using testing::AttachBlob;
using testing::AttachResult;
using testing::Blob;
using testing::CudaExport;
using ::testing::HasSubstr;
using testing::HostExport;
using testing::TestHostWorkspace;

AttachHeader HeaderOf(const std::string& blob) {
  AttachHeader h;
  std::memcpy(&h, blob.data(), sizeof(h));
  return h;
}

std::string WithHeader(std::string blob, const std::function<void(AttachHeader&)>& edit) {
  AttachHeader h = HeaderOf(blob);
  edit(h);
  std::memcpy(blob.data(), &h, sizeof(h));
  return blob;
}

std::string WithEntry(std::string blob, uint32_t i, const std::function<void(KernelEntry&)>& edit) {
  const AttachHeader h = HeaderOf(blob);
  KernelEntry e;
  char* at = blob.data() + h.entries_offset + i * sizeof(KernelEntry);
  std::memcpy(&e, at, sizeof(e));
  edit(e);
  std::memcpy(at, &e, sizeof(e));
  return blob;
}

std::string WithRank(std::string blob, uint32_t r, const std::function<void(RankMemory&)>& edit) {
  const AttachHeader h = HeaderOf(blob);
  RankMemory m;
  char* at = blob.data() + h.ranks_offset + r * sizeof(RankMemory);
  std::memcpy(&m, at, sizeof(m));
  edit(m);
  std::memcpy(at, &m, sizeof(m));
  return blob;
}

class BlobTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto ws = TestHostWorkspace::Create(2, 16, 256, DType::kBF16, 5);
    ASSERT_TRUE(ws.ok()) << ws.status();
    ws_ = std::move(*ws);
    host_ = Blob(HostExport(*ws_, 0));
    vmm_fd_.reset(::memfd_create("arfuse-test-vmm", MFD_CLOEXEC));
    ASSERT_TRUE(vmm_fd_.valid());
    cuda_ = Blob(CudaExport(vmm_fd_.get()));
  }

  // Expects arfuse_attach of `blob` (with the workspace's descriptor, twice for CUDA blobs) to
  // fail with `code` and a message containing `part`.
  void Refused(const std::string& blob, int code, const std::string& part) {
    const bool cuda = HeaderOf(blob).device_kind == static_cast<uint32_t>(DeviceKind::kCuda);
    const std::vector<int> fds =
        cuda ? std::vector<int>{vmm_fd_.get(), vmm_fd_.get()} : std::vector<int>{ws_->fd.get()};
    AttachResult r = AttachBlob(blob, fds);
    EXPECT_EQ(r.rc, code) << r.message;
    EXPECT_THAT(r.message, HasSubstr(part));
    EXPECT_EQ(r.ctx, nullptr);
    arfuse_detach(r.ctx);
  }

  std::unique_ptr<TestHostWorkspace> ws_;
  UniqueFd vmm_fd_;
  std::string host_, cuda_;
};

TEST_F(BlobTest, AHostBlobFromTheBuilderAttaches) {
  AttachResult r = AttachBlob(host_, {ws_->fd.get()});
  ASSERT_EQ(r.rc, ARFUSE_OK) << r.message;
  arfuse_ctx_info info{};
  info.struct_bytes = sizeof(info);
  ASSERT_EQ(arfuse_ctx_get_info(r.ctx, &info), ARFUSE_OK);
  EXPECT_EQ(info.device_kind, 2u);
  EXPECT_EQ(info.rank, 0u);
  EXPECT_EQ(info.world_size, 2u);
  EXPECT_EQ(info.generation, 5u);
  EXPECT_EQ(info.attach_id, 7u);
  EXPECT_EQ(info.max_tokens, 16u);
  EXPECT_EQ(info.hidden, 256u);
  EXPECT_EQ(info.dtype, static_cast<uint32_t>(ARFUSE_DTYPE_BF16));
  EXPECT_EQ(info.num_entries, 5u);  // the two patterns and the three FP8 ones (bf16)
  EXPECT_EQ(info.sm, 0u);
  EXPECT_EQ(arfuse_detach(r.ctx), ARFUSE_OK);
}

TEST_F(BlobTest, AnOlderCallersShorterInfoGetsTheFieldsItKnows) {
  AttachResult r = AttachBlob(host_, {ws_->fd.get()});
  ASSERT_EQ(r.rc, ARFUSE_OK) << r.message;
  arfuse_ctx_info info;
  std::memset(&info, 0xab, sizeof(info));
  info.struct_bytes = offsetof(arfuse_ctx_info, generation);
  ASSERT_EQ(arfuse_ctx_get_info(r.ctx, &info), ARFUSE_OK);
  EXPECT_EQ(info.world_size, 2u);
  uint64_t untouched;
  std::memset(&untouched, 0xab, sizeof(untouched));
  EXPECT_EQ(info.generation, untouched);
  info.struct_bytes = 0;
  EXPECT_EQ(arfuse_ctx_get_info(r.ctx, &info), ARFUSE_INVALID_ARGUMENT);
  EXPECT_THAT(arfuse_last_error(), HasSubstr("struct_bytes"));
  arfuse_detach(r.ctx);
}

// ARFUSE_INSTREAM_PDL replaces the blob's launch choice for this process; anything but 0, 1 or
// empty refuses the attach, naming the variable and the value.
TEST_F(BlobTest, ThePdlOverrideOfTheEnvironment) {
  struct Case {
    const char* value;
    uint32_t pdl;
  };
  for (const Case& c : {Case{"1", 1u}, Case{"0", 0u}, Case{"", 0u}}) {
    ::setenv("ARFUSE_INSTREAM_PDL", c.value, 1);
    AttachResult r = AttachBlob(host_, {ws_->fd.get()});
    ASSERT_EQ(r.rc, ARFUSE_OK) << c.value << ": " << r.message;
    arfuse_ctx_info info{};
    info.struct_bytes = sizeof(info);
    ASSERT_EQ(arfuse_ctx_get_info(r.ctx, &info), ARFUSE_OK);
    EXPECT_EQ(info.pdl, c.pdl) << "ARFUSE_INSTREAM_PDL=" << c.value;
    arfuse_detach(r.ctx);
  }
  for (const char* bad : {"2", "on", "yes"}) {
    ::setenv("ARFUSE_INSTREAM_PDL", bad, 1);
    AttachResult r = AttachBlob(host_, {ws_->fd.get()});
    EXPECT_EQ(r.rc, ARFUSE_INVALID_ARGUMENT) << bad;
    EXPECT_THAT(r.message, HasSubstr("ARFUSE_INSTREAM_PDL must be 0 or 1"));
    EXPECT_THAT(r.message, HasSubstr(absl::StrCat("got \"", bad, "\"")));
    EXPECT_EQ(r.ctx, nullptr);
  }
  ::unsetenv("ARFUSE_INSTREAM_PDL");
}

TEST_F(BlobTest, ArgumentsOfTheCall) {
  arfuse_ctx* ctx = reinterpret_cast<arfuse_ctx*>(0x1);
  EXPECT_EQ(arfuse_attach(nullptr, 10, nullptr, 0, &ctx), ARFUSE_INVALID_ARGUMENT);
  EXPECT_THAT(arfuse_last_error(), HasSubstr("attach blob is NULL"));
  EXPECT_EQ(ctx, nullptr);
  EXPECT_EQ(arfuse_attach(host_.data(), host_.size(), nullptr, 0, nullptr),
            ARFUSE_INVALID_ARGUMENT);
  EXPECT_THAT(arfuse_last_error(), HasSubstr("out is NULL"));
  EXPECT_EQ(arfuse_attach(host_.data(), host_.size(), nullptr, 1, &ctx), ARFUSE_INVALID_ARGUMENT);
  EXPECT_THAT(arfuse_last_error(), HasSubstr("fds is NULL with num_fds 1"));
  EXPECT_EQ(arfuse_detach(nullptr), ARFUSE_OK);
}

TEST_F(BlobTest, ShorterThanItsHeader) {
  Refused(host_.substr(0, sizeof(AttachHeader) - 1), ARFUSE_INVALID_ARGUMENT,
          "287 bytes is shorter than its header (288 bytes)");
}

TEST_F(BlobTest, Magic) {
  Refused(WithHeader(host_, [](AttachHeader& h) { h.magic = 0x12345678; }), ARFUSE_INVALID_ARGUMENT,
          "magic is not AFSI");
}

TEST_F(BlobTest, Versions) {
  // A sidecar of an older attach ABI (no op counter page, no counter slot) is refused, as is a
  // newer one.
  Refused(WithHeader(host_, [](AttachHeader& h) { h.abi_version = 1; }), ARFUSE_FAILED_PRECONDITION,
          "abi_version 1 differs from this library's 4");
  Refused(WithHeader(host_, [](AttachHeader& h) { h.abi_version = 2; }), ARFUSE_FAILED_PRECONDITION,
          "abi_version 2 differs from this library's 4");
  // ABI 3 blobs predate the FP8 patterns' entries.
  Refused(WithHeader(host_, [](AttachHeader& h) { h.abi_version = 3; }), ARFUSE_FAILED_PRECONDITION,
          "abi_version 3 differs from this library's 4");
  Refused(WithHeader(host_, [](AttachHeader& h) { h.abi_version = 5; }), ARFUSE_FAILED_PRECONDITION,
          "abi_version 5 differs from this library's 4");
  // A sidecar of the first launch ABI (no counter_slot in the arguments).
  Refused(WithHeader(host_, [](AttachHeader& h) { h.launch_abi_version = 1; }),
          ARFUSE_FAILED_PRECONDITION, "launch_abi_version 1 of the sidecar's kernels differs");
  Refused(WithHeader(host_, [](AttachHeader& h) { h.launch_args_bytes = 344; }),
          ARFUSE_FAILED_PRECONDITION, "launch_args_bytes 344 of the sidecar's kernels differs");
  Refused(WithHeader(host_, [](AttachHeader& h) { h.launch_abi_version = 9; }),
          ARFUSE_FAILED_PRECONDITION, "launch_abi_version 9 of the sidecar's kernels differs");
  Refused(WithHeader(host_, [](AttachHeader& h) { h.launch_args_bytes = 360; }),
          ARFUSE_FAILED_PRECONDITION, "launch_args_bytes 360 of the sidecar's kernels differs");
  EXPECT_EQ(arfuse_launch_abi_version(), kLaunchAbiVersion);
  EXPECT_EQ(arfuse_launch_args_bytes(), kLaunchArgsBytes);
  EXPECT_EQ(arfuse_client_abi_version(), static_cast<uint32_t>(ARFUSE_CLIENT_ABI_VERSION));
  EXPECT_STRNE(arfuse_client_version(), "");
}

TEST_F(BlobTest, StructSizes) {
  Refused(WithHeader(host_, [](AttachHeader& h) { h.header_bytes = 304; }), ARFUSE_INVALID_ARGUMENT,
          "header_bytes 304 is not 288");
  Refused(WithHeader(host_, [](AttachHeader& h) { h.entry_bytes = 120; }), ARFUSE_INVALID_ARGUMENT,
          "entry_bytes 120 is not 128");
  Refused(WithHeader(host_, [](AttachHeader& h) { h.rank_bytes = 104; }), ARFUSE_INVALID_ARGUMENT,
          "rank_bytes 104 is not 96");
}

TEST_F(BlobTest, DeviceKind) {
  Refused(WithHeader(host_, [](AttachHeader& h) { h.device_kind = 3; }), ARFUSE_INVALID_ARGUMENT,
          "device_kind 3 is not CUDA (1) or host (2)");
}

TEST_F(BlobTest, WorldSizeAndRank) {
  Refused(WithHeader(cuda_, [](AttachHeader& h) { h.world_size = 3; }), ARFUSE_INVALID_ARGUMENT,
          "world_size 3 is not 2, 4, 8 or 16");
  Refused(WithHeader(cuda_, [](AttachHeader& h) { h.world_size = 1; }), ARFUSE_INVALID_ARGUMENT,
          "world_size 1 is not 2, 4, 8 or 16");
  Refused(WithHeader(host_, [](AttachHeader& h) { h.world_size = 17; }), ARFUSE_INVALID_ARGUMENT,
          "world_size 17 is not in 1..16");
  Refused(WithHeader(host_, [](AttachHeader& h) { h.world_size = 0; }), ARFUSE_INVALID_ARGUMENT,
          "world_size 0 is not in 1..16");
  Refused(WithHeader(host_, [](AttachHeader& h) { h.rank = 2; }), ARFUSE_INVALID_ARGUMENT,
          "rank 2 is not below world_size 2");
}

TEST_F(BlobTest, AHostGroupOfOneRankAttaches) {
  auto ws = TestHostWorkspace::Create(1, 4, 64, DType::kFP32, 1);
  ASSERT_TRUE(ws.ok());
  AttachResult r = AttachBlob(Blob(HostExport(**ws, 0)), {(*ws)->fd.get()});
  EXPECT_EQ(r.rc, ARFUSE_OK) << r.message;
  arfuse_detach(r.ctx);
}

TEST_F(BlobTest, NumEntries) {
  Refused(WithHeader(host_, [](AttachHeader& h) { h.num_entries = 0; }), ARFUSE_INVALID_ARGUMENT,
          "num_entries 0 is not in 1..160");
  Refused(WithHeader(host_, [](AttachHeader& h) { h.num_entries = 161; }), ARFUSE_INVALID_ARGUMENT,
          "num_entries 161 is not in 1..160");
}

TEST_F(BlobTest, WorkspaceFields) {
  Refused(WithHeader(host_, [](AttachHeader& h) { h.dtype = 9; }), ARFUSE_INVALID_ARGUMENT,
          "dtype 9 is not bf16 (1), fp16 (2) or fp32 (3)");
  Refused(WithHeader(host_, [](AttachHeader& h) { h.spin_timeout_ns = 0; }),
          ARFUSE_INVALID_ARGUMENT, "spin_timeout_ns is 0");
  Refused(WithHeader(host_, [](AttachHeader& h) { h.max_tokens = 0; }), ARFUSE_INVALID_ARGUMENT,
          "max_tokens is 0");
  Refused(WithHeader(host_, [](AttachHeader& h) { h.hidden = 12; }), ARFUSE_INVALID_ARGUMENT,
          "hidden 12 is not a positive multiple of 8");
  Refused(WithHeader(host_, [](AttachHeader& h) { h.host_slot_bytes -= 64; }),
          ARFUSE_INVALID_ARGUMENT, "host_slot_bytes 8128 is not a multiple of 64 holding");
  Refused(WithHeader(host_, [](AttachHeader& h) { h.host_slot_bytes += 8; }),
          ARFUSE_INVALID_ARGUMENT, "host_slot_bytes 8200 is not a multiple of 64");
}

TEST_F(BlobTest, OffsetsAreAlignedAndInsideTheBlob) {
  Refused(WithHeader(host_, [](AttachHeader& h) { h.entries_offset += 8; }),
          ARFUSE_INVALID_ARGUMENT, "entries_offset 296 is not a multiple of 16");
  Refused(WithHeader(host_, [](AttachHeader& h) { h.ranks_offset = 0; }), ARFUSE_INVALID_ARGUMENT,
          "ranks_offset 0 lies inside the header");
  Refused(WithHeader(host_, [](AttachHeader& h) { h.ranks_offset += 16; }), ARFUSE_INVALID_ARGUMENT,
          "lies outside the blob");
  // Offsets near 2^64: offset + length would wrap; the check never forms it.
  Refused(WithHeader(host_, [](AttachHeader& h) { h.entries_offset = ~uint64_t{15}; }),
          ARFUSE_INVALID_ARGUMENT, "entries_offset 18446744073709551600 + 640 bytes lies outside");
  Refused(WithHeader(cuda_, [](AttachHeader& h) { h.image_bytes = ~uint64_t{0} - 4; }),
          ARFUSE_INVALID_ARGUMENT, "image_offset");
  Refused(WithHeader(cuda_, [](AttachHeader& h) { h.image_offset += 16; }), ARFUSE_INVALID_ARGUMENT,
          "image_offset");
}

// The FP8 patterns' entries are read by their pattern field, whatever the function's name.
TEST_F(BlobTest, Fp8EntriesAreReadByTheirPattern) {
  for (uint8_t p : {3, 4, 5}) {
    for (const std::string* blob : {&host_, &cuda_}) {
      const std::string edited = WithEntry(*blob, 0, [p](KernelEntry& e) { e.pattern = p; });
      const size_t fds = blob == &cuda_ ? 2 : 1;
      plain::StatusOr<lib::ParsedBlob> parsed =
          lib::ParseAttachBlob(edited.data(), edited.size(), fds);
      ASSERT_TRUE(parsed.ok()) << parsed.status().message();
      EXPECT_EQ(parsed->entries[0].pattern, p);
    }
  }
}

TEST_F(BlobTest, TheImage) {
  Refused(WithHeader(cuda_, [](AttachHeader& h) { h.image_bytes = 0; }), ARFUSE_INVALID_ARGUMENT,
          "a CUDA blob needs its image");
  std::string longer = host_ + std::string(16, '\0');
  Refused(WithHeader(longer, [](AttachHeader& h) { h.image_bytes = 16; }), ARFUSE_INVALID_ARGUMENT,
          "image_bytes must be 0 in a host blob");
}

TEST_F(BlobTest, Entries) {
  Refused(WithEntry(host_, 1, [](KernelEntry& e) { std::memset(e.function, 'x', 96); }),
          ARFUSE_INVALID_ARGUMENT, "entry 1's function name is not NUL-terminated");
  Refused(WithEntry(host_, 0, [](KernelEntry& e) { e.dtype = 0; }), ARFUSE_INVALID_ARGUMENT,
          "entry 0's dtype 0 is not bf16");
  Refused(WithEntry(host_, 0, [](KernelEntry& e) { e.pattern = 6; }), ARFUSE_INVALID_ARGUMENT,
          "entry 0's pattern 6 is not 1 to 5");
  Refused(WithEntry(host_, 0, [](KernelEntry& e) { e.pattern = 0; }), ARFUSE_INVALID_ARGUMENT,
          "entry 0's pattern 0 is not 1 to 5");
  Refused(WithEntry(host_, 0, [](KernelEntry& e) { e.algo = 0; }), ARFUSE_INVALID_ARGUMENT,
          "entry 0's algo 0 is not one-shot (1) or two-shot (2)");
  Refused(WithEntry(host_, 0, [](KernelEntry& e) { e.hidden = 12; }), ARFUSE_INVALID_ARGUMENT,
          "entry 0's hidden 12 is not a positive multiple of 8 up to the workspace's 256");
  Refused(WithEntry(host_, 0, [](KernelEntry& e) { e.hidden = 264; }), ARFUSE_INVALID_ARGUMENT,
          "entry 0's hidden 264");
}

TEST_F(BlobTest, KernelEntriesOfACudaBlob) {
  Refused(WithEntry(cuda_, 2, [](KernelEntry& e) { e.function[0] = '\0'; }),
          ARFUSE_INVALID_ARGUMENT, "entry 2's function name is empty");
  Refused(WithEntry(cuda_, 0, [](KernelEntry& e) { e.max_grid = 0; }), ARFUSE_INVALID_ARGUMENT,
          "entry 0's max_grid 0 is not in 1..1024");
  Refused(WithEntry(cuda_, 0, [](KernelEntry& e) { e.max_grid = 1025; }), ARFUSE_INVALID_ARGUMENT,
          "entry 0's max_grid 1025 is not in 1..1024");
  for (uint32_t threads : {0u, 16u, 100u, 1056u}) {
    Refused(
        WithEntry(cuda_, 3, [&](KernelEntry& e) { e.block_threads = threads; }),
        ARFUSE_INVALID_ARGUMENT,
        absl::StrCat("entry 3's block_threads ", threads, " is not a multiple of 32 in 32..1024"));
  }
  Refused(WithEntry(cuda_, 1, [](KernelEntry& e) { e.rows_divisor = 0; }), ARFUSE_INVALID_ARGUMENT,
          "entry 1's rows_divisor is 0");
}

TEST_F(BlobTest, RankMemory) {
  Refused(WithRank(host_, 1, [](RankMemory& m) { m.kind = 9; }), ARFUSE_INVALID_ARGUMENT,
          "rank 1's memory kind 9 is unknown");
  Refused(WithRank(host_, 0, [](RankMemory& m) { m.kind = 2; }), ARFUSE_INVALID_ARGUMENT,
          "rank 0's memory kind 2 is GPU memory in a host blob");
  Refused(WithRank(cuda_, 0, [](RankMemory& m) { m.kind = 4; }), ARFUSE_INVALID_ARGUMENT,
          "rank 0's memory kind 4 (host) in a CUDA blob");
  Refused(WithRank(host_, 1, [](RankMemory& m) { m.fd_index = 1; }), ARFUSE_INVALID_ARGUMENT,
          "rank 1's memory fd_index 1 is not below num_fds 1");
  Refused(WithRank(cuda_, 1, [](RankMemory& m) { m.fd_index = -1; }), ARFUSE_INVALID_ARGUMENT,
          "rank 1's memory fd_index -1 is not below num_fds 2");
  Refused(WithRank(cuda_, 1,
                   [](RankMemory& m) {
                     m.kind = 1;
                     m.fd_index = 0;
                   }),
          ARFUSE_INVALID_ARGUMENT, "rank 1's memory fd_index 0 must be -1 for a handle");
  Refused(WithRank(cuda_, 0, [](RankMemory& m) { m.bytes = 0; }), ARFUSE_INVALID_ARGUMENT,
          "rank 0's memory bytes is 0");
  Refused(WithRank(host_, 1, [](RankMemory& m) { m.bytes -= 64; }), ARFUSE_INVALID_ARGUMENT,
          "is not the host workspace's");
  // One object for the group: every rank's entry names the same descriptor.
  const std::string two = WithRank(host_, 1, [](RankMemory& m) { m.fd_index = 1; });
  AttachResult r = AttachBlob(two, {ws_->fd.get(), ws_->fd.get()});
  EXPECT_EQ(r.rc, ARFUSE_INVALID_ARGUMENT);
  EXPECT_THAT(r.message, HasSubstr("rank 1's memory fd_index 1 differs from rank 0's 0"));
}

#if ARFUSE_TEST_CUDA
TEST_F(BlobTest, TheWorkspaceLayoutOfACudaBlob) {
  auto layout = [&](size_t off, uint64_t v, size_t n) {
    return WithHeader(cuda_, [&](AttachHeader& h) { std::memcpy(h.layout + off, &v, n); });
  };
  Refused(layout(56, 0, 8), ARFUSE_INVALID_ARGUMENT, "layout.total_bytes is 0");
  Refused(layout(72, 4, 4), ARFUSE_INVALID_ARGUMENT,
          "layout.world_size 4 differs from world_size 2");
  Refused(layout(76, 2, 1), ARFUSE_INVALID_ARGUMENT, "layout.dtype 2 differs from dtype 1");
  Refused(layout(64, 256, 4), ARFUSE_INVALID_ARGUMENT,
          "layout's 256 tokens x 1024 hidden differ from the header's 512 x 1024");
  Refused(WithRank(cuda_, 1, [](RankMemory& m) { m.bytes = 1 << 20; }), ARFUSE_INVALID_ARGUMENT,
          "rank 1's memory bytes 1048576 is below layout.total_bytes 10485760");
}

// Past every blob rule, a CUDA attach needs the driver and a context on the sidecar's GPU:
// never INVALID_ARGUMENT here.
TEST_F(BlobTest, AWellFormedCudaBlobGetsAsFarAsTheDriver) {
  AttachResult r = AttachBlob(cuda_, {vmm_fd_.get(), vmm_fd_.get()});
  EXPECT_TRUE(r.rc == ARFUSE_UNAVAILABLE || r.rc == ARFUSE_FAILED_PRECONDITION) << r.message;
  EXPECT_THAT(r.message, ::testing::AnyOf(HasSubstr("CUDA driver"), HasSubstr("CUDA context"),
                                          HasSubstr("another GPU")));
  arfuse_detach(r.ctx);
}
#else
TEST_F(BlobTest, ACudaBlobNeedsALibraryBuiltWithCuda) {
  Refused(cuda_, ARFUSE_UNIMPLEMENTED, "built without CUDA");
}
#endif

// The host workspace behind the descriptor must be the one the blob describes.
TEST_F(BlobTest, TheHostWorkspaceBehindTheDescriptor) {
  AttachResult r = AttachBlob(host_, {-1});
  EXPECT_EQ(r.rc, ARFUSE_INVALID_ARGUMENT);
  EXPECT_THAT(r.message, HasSubstr("fds[0] (the host workspace) is negative"));

  UniqueFd small(::memfd_create("arfuse-test-small", MFD_CLOEXEC));
  ASSERT_EQ(::ftruncate(small.get(), 4096), 0);
  r = AttachBlob(host_, {small.get()});
  EXPECT_EQ(r.rc, ARFUSE_FAILED_PRECONDITION);
  EXPECT_THAT(r.message, HasSubstr("has 4096 bytes, expected"));

  auto other_gen = TestHostWorkspace::Create(2, 16, 256, DType::kBF16, 6);
  ASSERT_TRUE(other_gen.ok());
  r = AttachBlob(host_, {(*other_gen)->fd.get()});
  EXPECT_EQ(r.rc, ARFUSE_FAILED_PRECONDITION);
  EXPECT_THAT(r.message, HasSubstr("stale generation"));

  host::RetireHostWorkspace(ws_->mapping.data());
  r = AttachBlob(host_, {ws_->fd.get()});
  EXPECT_EQ(r.rc, ARFUSE_FAILED_PRECONDITION);
  EXPECT_THAT(r.message, HasSubstr("stale generation: the sidecar dropped this host workspace"));

  auto* h = reinterpret_cast<host::HostWsHeader*>((*other_gen)->mapping.data());
  h->layout_version = 2;
  r = AttachBlob(WithHeader(host_, [](AttachHeader& x) { x.generation = 6; }),
                 {(*other_gen)->fd.get()});
  EXPECT_EQ(r.rc, ARFUSE_FAILED_PRECONDITION);
  EXPECT_THAT(r.message, HasSubstr(absl::StrCat("layout_version is 2, this build's is ",
                                                host::kHostWsLayoutVersion)));
  h->magic = 0;
  r = AttachBlob(WithHeader(host_, [](AttachHeader& x) { x.generation = 6; }),
                 {(*other_gen)->fd.get()});
  EXPECT_EQ(r.rc, ARFUSE_FAILED_PRECONDITION);
  EXPECT_THAT(r.message, HasSubstr("magic"));
}

}  // namespace
}  // namespace arfuse::instream

namespace arfuse::instream {
namespace {

// The op counter page's fields (counters_fd_index, counters_bytes): one test per rule.
class CounterBlobTest : public BlobTest {
 protected:
  void SetUp() override {
    BlobTest::SetUp();
    page_fd_.reset(::memfd_create("arfuse-test-counters", MFD_CLOEXEC));
    ASSERT_TRUE(page_fd_.valid());
    ASSERT_EQ(::ftruncate(page_fd_.get(), kOpCounterObjectBytes), 0);
    counted_ = Blob(HostExport(*ws_, 0), 7, /*counters=*/true);
  }
  AttachResult Attach(const std::string& blob, int page_fd) {
    return AttachBlob(blob, {ws_->fd.get(), page_fd});
  }
  void RefusedWithPage(const std::string& blob, const std::string& part) {
    AttachResult r = Attach(blob, page_fd_.get());
    EXPECT_EQ(r.rc, ARFUSE_INVALID_ARGUMENT) << r.message;
    EXPECT_THAT(r.message, HasSubstr(part));
    EXPECT_EQ(r.ctx, nullptr);
  }
  UniqueFd page_fd_;
  std::string counted_;
};

TEST_F(CounterBlobTest, TheBuilderNamesThePageAfterTheWorkspacesDescriptor) {
  const AttachHeader h = HeaderOf(counted_);
  EXPECT_EQ(h.counters_fd_index, 1);
  EXPECT_EQ(h.counters_bytes, sizeof(OpCounterPage));
  EXPECT_EQ(HeaderOf(host_).counters_fd_index, -1);
  EXPECT_EQ(HeaderOf(host_).counters_bytes, 0u);
  AttachResult r = Attach(counted_, page_fd_.get());
  ASSERT_EQ(r.rc, ARFUSE_OK) << r.message;
  arfuse_detach(r.ctx);
}

TEST_F(CounterBlobTest, AnIndexBeyondTheDescriptorsIsRefused) {
  RefusedWithPage(WithHeader(counted_, [](AttachHeader& h) { h.counters_fd_index = 2; }),
                  "counters_fd_index 2 is not -1 or below num_fds 2");
  RefusedWithPage(WithHeader(counted_, [](AttachHeader& h) { h.counters_fd_index = -2; }),
                  "counters_fd_index -2 is not -1 or below num_fds 2");
}

TEST_F(CounterBlobTest, TheWorkspacesDescriptorIsNoCounterPage) {
  RefusedWithPage(WithHeader(counted_, [](AttachHeader& h) { h.counters_fd_index = 0; }),
                  "counters_fd_index 0 is rank 0's workspace descriptor");
}

TEST_F(CounterBlobTest, AnotherPageSizeIsRefused) {
  RefusedWithPage(WithHeader(counted_, [](AttachHeader& h) { h.counters_bytes = 256; }),
                  "counters_bytes 256 is not 512");
  RefusedWithPage(WithHeader(host_, [](AttachHeader& h) { h.counters_bytes = 512; }),
                  "counters_bytes 512 without a counter page");
}

TEST_F(CounterBlobTest, AnObjectSmallerThanAPageIsNotMapped) {
  UniqueFd small(::memfd_create("arfuse-test-small", MFD_CLOEXEC));
  ASSERT_EQ(::ftruncate(small.get(), 100), 0);
  AttachResult r = Attach(counted_, small.get());
  EXPECT_EQ(r.rc, ARFUSE_INVALID_ARGUMENT);
  EXPECT_THAT(r.message, HasSubstr("the op counter page is 100 bytes, not 4096"));
  EXPECT_EQ(r.ctx, nullptr);
}

}  // namespace
}  // namespace arfuse::instream
