#include "tests/instream/instream_test_util.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/common/plain_status_absl.h"
#include "kernels/host/reference_op.h"
#include "server/instream/attach_blob.h"

namespace arfuse::instream::testing {

absl::StatusOr<std::unique_ptr<TestHostWorkspace>> TestHostWorkspace::Create(
    int world, uint32_t max_tokens, uint32_t hidden, DType dtype, uint64_t generation) {
  auto ws = std::make_unique<TestHostWorkspace>();
  ws->world = world;
  ws->max_tokens = max_tokens;
  ws->hidden = hidden;
  ws->dtype = dtype;
  ws->generation = generation;
  ws->slot_bytes = host::HostWsSlotBytes(max_tokens, hidden, dtype);
  const size_t total = host::HostWsTotalBytes(world, ws->slot_bytes);
  ws->fd.reset(::memfd_create("arfuse-test-host-ws", MFD_CLOEXEC));
  if (!ws->fd.valid()) return absl::InternalError(absl::StrCat("memfd: ", strerror(errno)));
  if (::ftruncate(ws->fd.get(), static_cast<off_t>(total)) != 0) {
    return absl::InternalError(absl::StrCat("ftruncate: ", strerror(errno)));
  }
  auto m = host::HostWsMapping::Map(ws->fd.get(), total);
  if (!m.ok()) return ToAbsl(m.status());
  ws->mapping = std::move(*m);
  host::InitHostWorkspace(ws->mapping.data(), world, generation, ws->slot_bytes);
  return ws;
}

InStreamExport HostExport(const TestHostWorkspace& ws, uint32_t rank,
                          const std::vector<uint32_t>& hiddens) {
  InStreamExport e;
  e.device = DeviceKind::kHost;
  e.rank = rank;
  e.world_size = static_cast<uint32_t>(ws.world);
  e.generation = ws.generation;
  e.spin_timeout_ns = 2'000'000'000ull;
  e.dtype = ws.dtype;
  e.oneshot_max_bytes = e.twoshot_max_bytes =
      uint64_t{ws.max_tokens} * ws.hidden * DTypeSize(ws.dtype);
  e.max_tokens = ws.max_tokens;
  e.hidden = ws.hidden;
  e.host_slot_bytes = ws.slot_bytes;
  // The host engine's entries: both patterns, and the FP8 patterns of a bf16 or fp16 workspace.
  const bool fp8 = ws.dtype == DType::kBF16 || ws.dtype == DType::kFP16;
  for (uint32_t h : hiddens.empty() ? std::vector<uint32_t>{ws.hidden} : hiddens) {
    for (uint8_t p = 1; p <= (fp8 ? kMaxPattern : 2); ++p) {
      KernelEntry k{};
      k.hidden = h;
      k.pattern = p;
      k.algo = 1;
      k.dtype = static_cast<uint8_t>(ws.dtype);
      e.entries.push_back(k);
    }
  }
  e.ranks.resize(e.world_size);
  for (auto& m : e.ranks) {
    m.kind = MemoryKind::kHostShm;
    m.bytes = host::HostWsTotalBytes(ws.world, ws.slot_bytes);
  }
  e.ranks[rank].fd.reset(::fcntl(ws.fd.get(), F_DUPFD_CLOEXEC, 0));
  return e;
}

InStreamExport CudaExport(int fd) {
  static const uint8_t kImage[64] = {0x50, 0xed, 0x55, 0xba};
  InStreamExport e;
  e.device = DeviceKind::kCuda;
  e.rank = 1;
  e.world_size = 2;
  e.generation = 3;
  e.sm = 90;
  e.spin_timeout_ns = 1'000'000'000ull;
  e.dtype = DType::kBF16;
  e.oneshot_max_bytes = 64 * 1024;
  e.twoshot_max_bytes = 1024 * 1024;
  e.max_tokens = 512;
  e.hidden = 1024;
  // WorkspaceLayout's fields at their pinned offsets (allreduce_fusion.h): the slots of 512
  // tokens x 1024 bf16, world 2.
  auto put64 = [&](size_t off, uint64_t v) { std::memcpy(e.layout + off, &v, 8); };
  auto put32 = [&](size_t off, uint32_t v) { std::memcpy(e.layout + off, &v, 4); };
  put64(0, 0);              // control_offset
  put64(8, 1ull << 20);     // lamport_offset
  put64(16, 2ull << 20);    // lamport_buffer_bytes
  put64(24, 1ull << 20);    // lamport_slot_bytes
  put64(32, 7ull << 20);    // scatter_offset
  put64(40, 512ull << 10);  // scatter_slot_bytes
  put64(48, 8ull << 20);    // gather_offset
  put64(56, 10ull << 20);   // total_bytes
  put32(64, 512);           // max_tokens
  put32(68, 1024);          // hidden
  put32(72, 2);             // world_size
  e.layout[76] = static_cast<uint8_t>(DType::kBF16);
  for (uint8_t p : {1, 2}) {
    for (uint8_t algo : {1, 2}) {
      KernelEntry k{};
      k.hidden = 1024;
      k.pattern = p;
      k.algo = algo;
      k.dtype = static_cast<uint8_t>(DType::kBF16);
      k.block_threads = 128;
      k.max_grid = 66;
      k.rows_divisor = algo == 1 ? 1 : 2;
      std::snprintf(k.function, sizeof(k.function), "arfuse_test_p%u_a%u", p, algo);
      e.entries.push_back(k);
    }
  }
  e.ranks.resize(2);
  for (auto& m : e.ranks) {
    m.kind = MemoryKind::kVmmPosixFd;
    m.bytes = 10ull << 20;
  }
  e.ranks[0].fd.reset(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
  e.ranks[1].fd.reset(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
  e.image = kImage;
  e.image_bytes = sizeof(kImage);
  return e;
}

std::string Blob(const InStreamExport& e, uint64_t attach_id, bool counters) {
  absl::StatusOr<std::string> b = BuildAttachBlob(e, attach_id, counters);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? *b : std::string();
}

AttachResult AttachBlob(const std::string& blob, const std::vector<int>& fds) {
  AttachResult r;
  r.rc = arfuse_attach(blob.data(), blob.size(), fds.data(), fds.size(), &r.ctx);
  r.message = r.rc == ARFUSE_OK ? "" : arfuse_last_error();
  return r;
}

RankTensors::RankTensors(DType dtype, int rank, int call, uint32_t tokens, uint32_t hidden) {
  const size_t n = size_t{tokens} * hidden, es = DTypeSize(dtype);
  tensor_bytes = n * es;
  gamma_bytes = hidden * es;
  const size_t words = (std::max(tensor_bytes, gamma_bytes) + 15) / 8 + 2;
  storage_.assign(6, std::vector<uint64_t>(words, 0));
  std::memset(residual_out(), 0xee, tensor_bytes);
  std::memset(norm_out(), 0xee, tensor_bytes);
  std::memset(output(), 0xee, tensor_bytes);
  for (size_t i = 0; i < n; ++i) {
    StoreFromFloat(dtype, input(), i,
                   static_cast<float>((i * 7 + rank * 13 + call * 5) % 33) / 8.0f - 2.0f);
    StoreFromFloat(dtype, residual_in(), i, static_cast<float>((i + call) % 9) / 4.0f - 1.0f);
  }
  for (size_t i = 0; i < hidden; ++i) {
    StoreFromFloat(dtype, gamma(), i, 0.5f + static_cast<float>(i % 5) / 4.0f);
  }
}

std::vector<uint8_t> RankTensors::bytes(int which, size_t n) const {
  const auto* p = reinterpret_cast<const uint8_t*>(storage_[which].data());
  return std::vector<uint8_t>(p, p + n);
}

void Reference(Pattern pattern, DType dtype, uint32_t tokens, uint32_t hidden,
               std::vector<RankTensors>& ranks, RankTensors& want) {
  std::vector<const void*> ins;
  for (auto& r : ranks) ins.push_back(r.input());
  CpuOpArgs a;
  a.pattern = pattern;
  a.dtype = dtype;
  a.world_size = static_cast<int>(ranks.size());
  a.hidden = hidden;
  a.num_tokens = tokens;
  a.eps = 1e-5f;
  a.rank_inputs = ins.data();
  a.output = want.output();
  a.residual_in = want.residual_in();
  a.residual_out = want.residual_out();
  a.norm_out = want.norm_out();
  a.gamma = want.gamma();
  absl::Status s = ReferenceFusedOp(a);
  ASSERT_TRUE(s.ok()) << s;
}

}  // namespace arfuse::instream::testing
