// libarfuse_client on a GPU: two ranks of one process sharing the GPU (each grid within SMs / 2,
// the sm_budget), each rank's workspace a VMM allocation exported as a POSIX descriptor and
// initialized here, attached through arfuse_attach with blobs from the blob builder and a kernel
// image (kernels/instream, the one a sidecar hands out). Results against the CPU reference, graph
// capture and replay, the pointer checks, the GPU and context checks, a peer that never launches.
// Run on a GPU machine: ctest --test-dir <build> -L gpu -R InStreamGpu --output-on-failure
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "kernels/allreduce_fusion/fusion_control.h"
#include "kernels/host/reference_op.h"
#include "kernels/instream/instream_image.h"
#include "kernels/quant/fp8_format.h"
#include "server/instream/attach_blob.h"
#include "server/instream/attachments.h"
#include "tests/instream/instream_test_util.h"

namespace arfuse::instream {
namespace {

using testing::AttachBlob;
using testing::AttachResult;
using testing::Blob;
using ::testing::HasSubstr;

#define CUDA_OK(expr)                                                          \
  do {                                                                         \
    const cudaError_t err_ = (expr);                                           \
    ASSERT_EQ(err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(err_); \
  } while (false)
#define CU_OK(expr)                                         \
  do {                                                      \
    const CUresult err_ = (expr);                           \
    ASSERT_EQ(err_, CUDA_SUCCESS) << #expr << ": " << err_; \
  } while (false)

constexpr int kWorld = 2;
constexpr uint32_t kHidden = 4096;
constexpr uint32_t kMaxTokens = 256;

// One rank's workspace, as a VMM sidecar makes it: cuMemCreate with a POSIX descriptor as its
// shareable handle, mapped here for the initialization (the client maps it again from the
// descriptor).
struct VmmWorkspace {
  ~VmmWorkspace() {
    if (ptr != 0) {
      cuMemUnmap(ptr, bytes);
      cuMemAddressFree(ptr, bytes);
    }
    if (handle != 0) cuMemRelease(handle);
  }
  CUmemGenericAllocationHandle handle = 0;
  CUdeviceptr ptr = 0;
  size_t bytes = 0;
  UniqueFd fd;
};

void MakeWorkspace(int device, size_t bytes, VmmWorkspace* ws) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t granularity = 0;
  CU_OK(cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  ws->bytes = (bytes + granularity - 1) / granularity * granularity;
  CU_OK(cuMemCreate(&ws->handle, ws->bytes, &prop, 0));
  int fd = -1;
  CU_OK(cuMemExportToShareableHandle(&fd, ws->handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  ws->fd.reset(fd);
  CU_OK(cuMemAddressReserve(&ws->ptr, ws->bytes, 0, 0, 0));
  CU_OK(cuMemMap(ws->ptr, ws->bytes, 0, ws->handle, 0));
  CUmemAccessDesc access = {};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CU_OK(cuMemSetAccess(ws->ptr, ws->bytes, &access, 1));
}

struct DeviceBuffer {
  explicit DeviceBuffer(size_t n) : bytes(n) {
    if (cudaMalloc(&ptr, n) != cudaSuccess) ptr = nullptr;
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  void* ptr = nullptr;
  size_t bytes;
};

class InStreamGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) GTEST_SKIP() << "no GPU";
    CUDA_OK(cudaSetDevice(0));
    CUDA_OK(cudaFree(nullptr));  // the primary context, current on this thread
    cudaDeviceProp prop{};
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    std::memcpy(uuid_, prop.uuid.bytes, sizeof(uuid_));
    sm_ = static_cast<uint32_t>(prop.major * 10 + prop.minor);
    sm_budget_ = static_cast<uint32_t>(prop.multiProcessorCount / kWorld);
    layout_ = ComputeWorkspaceLayout(kWorld, kMaxTokens, kHidden, DType::kBF16);
    ASSERT_GT(layout_.total_bytes, 0u);
    for (int r = 0; r < kWorld; ++r) {
      ws_[r] = std::make_unique<VmmWorkspace>();
      ASSERT_NO_FATAL_FAILURE(MakeWorkspace(0, layout_.total_bytes, ws_[r].get()));
      CUDA_OK(cudaStreamCreateWithFlags(&streams_[r], cudaStreamNonBlocking));
    }
    ASSERT_NO_FATAL_FAILURE(Reinitialize());
  }

  void TearDown() override {
    for (arfuse_ctx*& c : ctx_) {
      arfuse_detach(c);
      c = nullptr;
    }
    for (cudaStream_t s : streams_) {
      if (s != nullptr) {
        cudaStreamSynchronize(s);
        cudaStreamDestroy(s);
      }
    }
  }

  // Every rank resets its workspace and writes the generation's tag into its control block (as
  // the sidecar's FusionWorkspace does), then the "barrier": the host waits for all.
  void Reinitialize() {
    const uint32_t tag = GenerationTag(generation_);
    for (int r = 0; r < kWorld; ++r) {
      CUDA_OK(LaunchWorkspaceInit(reinterpret_cast<void*>(ws_[r]->ptr), layout_, streams_[r]));
      CUDA_OK(cudaMemcpyAsync(reinterpret_cast<char*>(ws_[r]->ptr) + layout_.control_offset +
                                  offsetof(FusionControl, generation),
                              &tag, sizeof(tag), cudaMemcpyHostToDevice, streams_[r]));
    }
    CUDA_OK(cudaDeviceSynchronize());
  }

  InStreamExport Export(int rank) const {
    InStreamExport e;
    e.device = DeviceKind::kCuda;
    e.rank = static_cast<uint32_t>(rank);
    e.world_size = kWorld;
    e.generation = generation_;
    std::memcpy(e.gpu_uuid, uuid_, sizeof(uuid_));
    e.sm = sm_;
    e.sm_budget = sm_budget_;
    e.spin_timeout_ns = spin_timeout_ns_;
    e.pdl = pdl_;
    e.dtype = DType::kBF16;
    e.oneshot_max_bytes = oneshot_max_bytes_;
    e.twoshot_max_bytes = uint64_t{kMaxTokens} * kHidden * 2;
    const uint32_t config[5] = {1, 24, 64, 1, 3};  // fusion_device.cuh's DefaultKernelConfig()
    std::memcpy(e.kernel_config, config, sizeof(config));
    std::memcpy(e.layout, &layout_, sizeof(layout_));
    e.max_tokens = kMaxTokens;
    e.hidden = kHidden;
    for (uint32_t hidden : {kHidden, 1024u}) {
      for (int pattern_value = 1; pattern_value <= kMaxPattern; ++pattern_value) {
        const auto pattern = static_cast<Pattern>(pattern_value);
        for (FusionAlgo algo : {FusionAlgo::kOneShot, FusionAlgo::kTwoShot}) {
          // The sidecar's own image and entries (kernels/instream): what a client gets.
          KernelEntry k{};
          EXPECT_TRUE(DescribeKernelEntry(DType::kBF16, pattern, algo, hidden, kWorld, &k));
          // One block per SM of the budget is always resident (__launch_bounds__(..., 1)).
          k.max_grid = sm_budget_;
          if (missing_function_) {
            std::snprintf(k.function, sizeof(k.function), "%s", "arfuse_test_missing");
          }
          e.entries.push_back(k);
        }
      }
    }
    e.ranks.resize(kWorld);
    for (int q = 0; q < kWorld; ++q) {
      e.ranks[q].kind = MemoryKind::kVmmPosixFd;
      e.ranks[q].bytes = ws_[q]->bytes;
      e.ranks[q].fd.reset(::dup(ws_[q]->fd.get()));
    }
    size_t image_bytes = 0;
    e.image = KernelImage(static_cast<uint32_t>(sm_), &image_bytes);
    e.image_bytes = image_bytes;
    EXPECT_NE(e.image, nullptr) << "no in-stream image for sm_" << sm_;
    return e;
  }

  AttachResult AttachRank(int rank, const std::function<void(std::string&)>& edit = {}) {
    InStreamExport e = Export(rank);
    std::string blob = Blob(e, 1 + rank);
    if (edit) edit(blob);
    return AttachBlob(blob, AttachBlobFds(e));
  }

  void AttachAll() {
    for (int r = 0; r < kWorld; ++r) {
      AttachResult a = AttachRank(r);
      ASSERT_EQ(a.rc, ARFUSE_OK) << a.message;
      ctx_[r] = a.ctx;
    }
  }

  // One op's tensors on every rank, filled from (rank, call), and their CPU answer.
  struct Op {
    Op(uint32_t tokens, int call) : tokens(tokens), bytes(size_t{tokens} * kHidden * 2) {
      for (int r = 0; r < kWorld; ++r) {
        host.emplace_back(DType::kBF16, r, call, tokens, kHidden);
        for (int i = 0; i < 5; ++i) dev[r].push_back(std::make_unique<DeviceBuffer>(bytes));
      }
      gamma = std::make_unique<DeviceBuffer>(kHidden * 2);
    }
    void Upload(cudaStream_t s, int r) {
      cudaMemcpyAsync(dev[r][0]->ptr, host[r].input(), bytes, cudaMemcpyHostToDevice, s);
      cudaMemcpyAsync(dev[r][1]->ptr, host[r].residual_in(), bytes, cudaMemcpyHostToDevice, s);
      cudaMemcpyAsync(gamma->ptr, host[0].gamma(), kHidden * 2, cudaMemcpyHostToDevice, s);
      for (int i = 2; i < 5; ++i) cudaMemsetAsync(dev[r][i]->ptr, 0xee, bytes, s);
    }
    int Launch(arfuse_ctx* ctx, cudaStream_t s, int r, bool norm) {
      if (!norm) {
        return arfuse_fused_allreduce(ctx, s, dev[r][0]->ptr, dev[r][4]->ptr, tokens, kHidden,
                                      ARFUSE_DTYPE_BF16);
      }
      return arfuse_fused_allreduce_residual_rmsnorm(ctx, s, dev[r][0]->ptr, dev[r][1]->ptr,
                                                     dev[r][2]->ptr, dev[r][3]->ptr, gamma->ptr,
                                                     tokens, kHidden, ARFUSE_DTYPE_BF16, 1e-5f);
    }
    std::vector<uint8_t> Download(int r, int which) {
      std::vector<uint8_t> out(bytes);
      if (cudaMemcpy(out.data(), dev[r][which]->ptr, bytes, cudaMemcpyDeviceToHost) !=
          cudaSuccess) {
        out.clear();
      }
      return out;
    }
    // Sum and residual_out exact, norm_out within two bf16 rounding steps (the GPU adds the sum
    // of squares in another order) and the same on every rank.
    void Verify(bool norm, int call) {
      testing::RankTensors want(DType::kBF16, 0, call, tokens, kHidden);
      testing::Reference(norm ? Pattern::kAllReduceResidualRmsNorm : Pattern::kAllReduce,
                         DType::kBF16, tokens, kHidden, host, want);
      const std::vector<uint8_t> norm0 = Download(0, 3);
      for (int r = 0; r < kWorld; ++r) {
        if (!norm) {
          ASSERT_EQ(Download(r, 4), want.bytes(4, bytes)) << "rank " << r << " call " << call;
          continue;
        }
        ASSERT_EQ(Download(r, 2), want.bytes(2, bytes)) << "rank " << r << " call " << call;
        const std::vector<uint8_t> got = Download(r, 3);
        ASSERT_EQ(got, norm0) << "norm_out differs between ranks, call " << call;
        for (size_t i = 0; i < size_t{tokens} * kHidden; ++i) {
          const float g = LoadAsFloat(DType::kBF16, got.data(), i);
          const float w = LoadAsFloat(DType::kBF16, want.norm_out(), i);
          ASSERT_NEAR(g, w, 2.0 * std::ldexp(1.0, -8) * std::max(std::fabs(w), 1e-3f))
              << "rank " << r << " element " << i << " call " << call;
        }
      }
    }
    uint32_t tokens;
    size_t bytes;
    std::vector<testing::RankTensors> host;
    std::vector<std::unique_ptr<DeviceBuffer>> dev[kWorld];  // input, res_in, res_out, norm, out
    std::unique_ptr<DeviceBuffer> gamma;
  };

  uint8_t uuid_[16] = {};
  uint32_t sm_ = 0, sm_budget_ = 0;
  uint64_t generation_ = 1;
  uint64_t spin_timeout_ns_ = 5'000'000'000ull;
  uint64_t oneshot_max_bytes_ = 4 * kHidden * 2;  // up to 4 tokens one-shot, then two-shot
  bool pdl_ = false;
  bool missing_function_ = false;
  WorkspaceLayout layout_{};
  std::unique_ptr<VmmWorkspace> ws_[kWorld];
  cudaStream_t streams_[kWorld] = {};
  arfuse_ctx* ctx_[kWorld] = {};
};

TEST_F(InStreamGpu, OneShotAndTwoShotMatchTheCpuReference) {
  ASSERT_NO_FATAL_FAILURE(AttachAll());
  arfuse_ctx_info info{};
  info.struct_bytes = sizeof(info);
  ASSERT_EQ(arfuse_ctx_get_info(ctx_[0], &info), ARFUSE_OK);
  EXPECT_EQ(info.sm, sm_);
  int call = 0;
  for (bool norm : {true, false}) {
    for (uint32_t tokens : {1u, 3u, 4u, 5u, 16u, 128u, 255u, 256u}) {
      Op op(tokens, ++call);
      for (int r = 0; r < kWorld; ++r) op.Upload(streams_[r], r);
      for (int r = 0; r < kWorld; ++r) {
        ASSERT_EQ(op.Launch(ctx_[r], streams_[r], r, norm), ARFUSE_OK) << arfuse_last_error();
      }
      CUDA_OK(cudaDeviceSynchronize());
      ASSERT_NO_FATAL_FAILURE(op.Verify(norm, call)) << "tokens " << tokens;
    }
  }
  for (arfuse_ctx* c : ctx_) EXPECT_EQ(arfuse_check(c, nullptr), ARFUSE_OK) << arfuse_last_error();
}

// The FP8 patterns through the C ABI and the image's FP8 entries, one-shot (up to 4 tokens) and
// two-shot: the codes within one E4M3 step of the CPU reference (the GPU adds the sum of squares
// in another order), the scales within an fp32 ulp (UE8M0 bytes exact), every rank's bytes alike.
TEST_F(InStreamGpu, Fp8PatternsMatchTheCpuReference) {
  ASSERT_NO_FATAL_FAILURE(AttachAll());
  auto steps = [](uint8_t a, uint8_t b) {
    auto ordinal = [](uint8_t c) { return (c & 0x80) ? -int{c & 0x7f} : int{c & 0x7f}; };
    return std::abs(ordinal(a) - ordinal(b));
  };
  const float static_scale = 0.03f;
  DeviceBuffer static_dev(sizeof(float));
  CUDA_OK(cudaMemcpy(static_dev.ptr, &static_scale, sizeof(float), cudaMemcpyHostToDevice));
  int call = 100;
  for (int quant :
       {ARFUSE_QUANT_FP8_STATIC, ARFUSE_QUANT_FP8_PER_TOKEN, ARFUSE_QUANT_FP8_PER_GROUP}) {
    const int layout = quant == ARFUSE_QUANT_FP8_PER_GROUP ? ARFUSE_SCALE_UE8M0_PACKED : 0;
    for (uint32_t tokens : {1u, 5u, 128u}) {
      SCOPED_TRACE(::testing::Message() << "quant " << quant << " tokens " << tokens);
      Op op(tokens, ++call);
      const size_t codes = size_t{tokens} * kHidden;
      const size_t scale_bytes = size_t{kHidden / 128 + 1} * (tokens + 4) * sizeof(float);
      std::unique_ptr<DeviceBuffer> q[kWorld], sc[kWorld];
      for (int r = 0; r < kWorld; ++r) {
        op.Upload(streams_[r], r);
        q[r] = std::make_unique<DeviceBuffer>(codes);
        sc[r] = std::make_unique<DeviceBuffer>(scale_bytes);
      }
      for (int r = 0; r < kWorld; ++r) {
        void* scale = quant == ARFUSE_QUANT_FP8_STATIC ? static_dev.ptr : sc[r]->ptr;
        ASSERT_EQ(arfuse_fused_allreduce_residual_rmsnorm_fp8(
                      ctx_[r], streams_[r], op.dev[r][0]->ptr, op.dev[r][1]->ptr, op.dev[r][2]->ptr,
                      op.dev[r][3]->ptr, q[r]->ptr, scale, op.gamma->ptr, tokens, kHidden,
                      ARFUSE_DTYPE_BF16, 1e-5f, quant, layout),
                  ARFUSE_OK)
            << arfuse_last_error();
      }
      CUDA_OK(cudaDeviceSynchronize());
      // The CPU answer.
      std::vector<const void*> inputs;
      for (int r = 0; r < kWorld; ++r) inputs.push_back(op.host[r].input());
      std::vector<uint8_t> res(op.bytes), norm(op.bytes), want_q(codes);
      std::vector<uint8_t> want_scale(scale_bytes, 0);
      float cpu_static = static_scale;
      CpuOpArgs a;
      a.pattern = static_cast<Pattern>(2 + quant);
      a.dtype = DType::kBF16;
      a.world_size = kWorld;
      a.hidden = kHidden;
      a.num_tokens = tokens;
      a.eps = 1e-5f;
      a.rank_inputs = inputs.data();
      a.residual_in = op.host[0].residual_in();
      a.residual_out = res.data();
      a.norm_out = norm.data();
      a.gamma = op.host[0].gamma();
      a.quant_out = want_q.data();
      a.scale = quant == ARFUSE_QUANT_FP8_STATIC ? static_cast<void*>(&cpu_static)
                                                 : static_cast<void*>(want_scale.data());
      a.scale_layout = static_cast<uint8_t>(layout);
      ASSERT_TRUE(ReferenceFusedOp(a).ok());
      const size_t used_scale =
          quant == ARFUSE_QUANT_FP8_PER_TOKEN ? tokens * sizeof(float)
          : quant == ARFUSE_QUANT_FP8_PER_GROUP
              ? fp8::GroupScaleBytes(fp8::GroupScaleLayout::kUe8m0Packed, tokens, kHidden / 128)
              : 0;
      std::vector<uint8_t> q0, s0;
      for (int r = 0; r < kWorld; ++r) {
        std::vector<uint8_t> got_q(codes), got_s(used_scale);
        CUDA_OK(cudaMemcpy(got_q.data(), q[r]->ptr, codes, cudaMemcpyDeviceToHost));
        if (used_scale > 0) {
          CUDA_OK(cudaMemcpy(got_s.data(), sc[r]->ptr, used_scale, cudaMemcpyDeviceToHost));
        }
        ASSERT_EQ(op.Download(r, 2), res) << "rank " << r << ": residual_out";
        if (r == 0) {
          for (size_t i = 0; i < codes; ++i) {
            ASSERT_LE(steps(got_q[i], want_q[i]), 1) << "element " << i;
          }
          if (quant == ARFUSE_QUANT_FP8_PER_GROUP) {
            ASSERT_TRUE(std::equal(got_s.begin(), got_s.end(), want_scale.begin()));
          }
          for (size_t i = 0; quant == ARFUSE_QUANT_FP8_PER_TOKEN && i < tokens; ++i) {
            float g, w;
            std::memcpy(&g, got_s.data() + 4 * i, 4);
            std::memcpy(&w, want_scale.data() + 4 * i, 4);
            // The sum of squares' order: a relative kHidden x 2^-24 at most.
            ASSERT_NEAR(g, w, std::ldexp(std::fabs(w) * kHidden, -24)) << "token " << i;
          }
          q0 = got_q;
          s0 = got_s;
        } else {
          ASSERT_EQ(got_q, q0) << "rank " << r << ": codes differ from rank 0's";
          ASSERT_EQ(got_s, s0) << "rank " << r << ": scales differ from rank 0's";
        }
      }
    }
  }
  for (arfuse_ctx* c : ctx_) EXPECT_EQ(arfuse_check(c, nullptr), ARFUSE_OK) << arfuse_last_error();
}

TEST_F(InStreamGpu, ProgrammaticDependentLaunchesRunAlike) {
  pdl_ = true;  // small grids only: one block each fits beside the other rank's
  ASSERT_NO_FATAL_FAILURE(AttachAll());
  Op op(1, 7);
  for (int r = 0; r < kWorld; ++r) op.Upload(streams_[r], r);
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_EQ(op.Launch(ctx_[r], streams_[r], r, true), ARFUSE_OK) << arfuse_last_error();
  }
  CUDA_OK(cudaDeviceSynchronize());
  ASSERT_NO_FATAL_FAILURE(op.Verify(true, 7));
}

// Each rank's launch captured into a graph on its stream (the validation's pointer queries do
// not break the capture), then replayed with new inputs copied in before each replay.
TEST_F(InStreamGpu, CapturedLaunchesReplay) {
  ASSERT_NO_FATAL_FAILURE(AttachAll());
  for (uint32_t tokens : {2u, 64u}) {  // one-shot and two-shot
    Op op(tokens, 0);
    cudaGraphExec_t exec[kWorld] = {};
    for (int r = 0; r < kWorld; ++r) {
      cudaGraph_t graph = nullptr;
      CUDA_OK(cudaStreamBeginCapture(streams_[r], cudaStreamCaptureModeGlobal));
      const int rc = op.Launch(ctx_[r], streams_[r], r, true);
      CUDA_OK(cudaStreamEndCapture(streams_[r], &graph));
      ASSERT_EQ(rc, ARFUSE_OK) << arfuse_last_error();
      CUDA_OK(cudaGraphInstantiate(&exec[r], graph, 0));
      CUDA_OK(cudaGraphDestroy(graph));
    }
    for (int replay = 1; replay <= 4; ++replay) {
      for (int r = 0; r < kWorld; ++r) {
        op.host[r] = testing::RankTensors(DType::kBF16, r, replay, tokens, kHidden);
        op.Upload(streams_[r], r);
      }
      for (int r = 0; r < kWorld; ++r) CUDA_OK(cudaGraphLaunch(exec[r], streams_[r]));
      CUDA_OK(cudaDeviceSynchronize());
      ASSERT_NO_FATAL_FAILURE(op.Verify(true, replay)) << "tokens " << tokens;
    }
    for (cudaGraphExec_t e : exec) CUDA_OK(cudaGraphExecDestroy(e));
  }
}

TEST_F(InStreamGpu, TensorsMustBeDeviceMemoryOfThisGpu) {
  ASSERT_NO_FATAL_FAILURE(AttachAll());
  Op op(2, 1);
  std::unique_ptr<void, decltype(&std::free)> plain(std::aligned_alloc(256, op.bytes), &std::free);
  void* pinned = nullptr;
  void* managed = nullptr;
  CUDA_OK(cudaMallocHost(&pinned, op.bytes));
  CUDA_OK(cudaMallocManaged(&managed, op.bytes));
  struct Case {
    void* ptr;
    const char* part;
  } cases[] = {{plain.get(), "input is not CUDA memory"},
               {pinned, "input is pinned host memory"},
               {managed, "input is managed memory"}};
  for (const Case& c : cases) {
    EXPECT_EQ(arfuse_fused_allreduce(ctx_[0], streams_[0], c.ptr, op.dev[0][4]->ptr, 2, kHidden,
                                     ARFUSE_DTYPE_BF16),
              ARFUSE_INVALID_ARGUMENT);
    EXPECT_THAT(arfuse_last_error(), HasSubstr(c.part));
  }
  EXPECT_EQ(arfuse_fused_allreduce_residual_rmsnorm(
                ctx_[0], streams_[0], op.dev[0][0]->ptr, op.dev[0][1]->ptr, op.dev[0][2]->ptr,
                op.dev[0][3]->ptr, pinned, 2, kHidden, ARFUSE_DTYPE_BF16, 1e-5f),
            ARFUSE_INVALID_ARGUMENT);
  EXPECT_THAT(arfuse_last_error(), HasSubstr("gamma is pinned host memory"));
  CUDA_OK(cudaFreeHost(pinned));
  CUDA_OK(cudaFree(managed));
  // Nothing was launched: the peer is not left waiting, the ranks still pair up.
  for (int r = 0; r < kWorld; ++r) op.Upload(streams_[r], r);
  for (int r = 0; r < kWorld; ++r) ASSERT_EQ(op.Launch(ctx_[r], streams_[r], r, false), ARFUSE_OK);
  CUDA_OK(cudaDeviceSynchronize());
  ASSERT_NO_FATAL_FAILURE(op.Verify(false, 1));
}

TEST_F(InStreamGpu, AttachRefusesAnotherGpuAThreadWithoutAContextAndAMissingFunction) {
  AttachResult a = AttachRank(0, [](std::string& blob) {
    blob[offsetof(AttachHeader, gpu_uuid)] ^= 0x5a;  // another GPU's UUID
  });
  EXPECT_EQ(a.rc, ARFUSE_FAILED_PRECONDITION);
  EXPECT_THAT(a.message, HasSubstr("on another GPU"));

  std::thread fresh([&] { a = AttachRank(0); });  // no CUDA call made on this thread yet
  fresh.join();
  EXPECT_EQ(a.rc, ARFUSE_FAILED_PRECONDITION);
  EXPECT_THAT(a.message, HasSubstr("no current CUDA context on this thread"));

  missing_function_ = true;
  a = AttachRank(0);
  EXPECT_NE(a.rc, ARFUSE_OK);
  EXPECT_THAT(a.message, HasSubstr("function arfuse_test_missing is not in the kernel image"));
  EXPECT_EQ(a.ctx, nullptr);
}

// Rank 1 never launches: rank 0's kernel gives up at the spin timeout and writes the error word
// (arfuse_check: ABORTED, timeout); the workspace is poisoned until both ranks re-initialize.
TEST_F(InStreamGpu, APeerThatNeverLaunchesEndsInTheErrorWord) {
  spin_timeout_ns_ = 200'000'000;
  ASSERT_NO_FATAL_FAILURE(AttachAll());
  Op op(2, 1);
  op.Upload(streams_[0], 0);
  ASSERT_EQ(op.Launch(ctx_[0], streams_[0], 0, true), ARFUSE_OK) << arfuse_last_error();
  CUDA_OK(cudaStreamSynchronize(streams_[0]));
  uint32_t code = 0;
  EXPECT_EQ(arfuse_check(ctx_[0], &code), ARFUSE_ABORTED);
  EXPECT_EQ(code, static_cast<uint32_t>(FusionError::kTimeout));
  EXPECT_THAT(arfuse_last_error(), HasSubstr("(timeout)"));
  EXPECT_EQ(op.Download(0, 2), std::vector<uint8_t>(op.bytes, 0xee)) << "no output written";
  EXPECT_EQ(arfuse_check(ctx_[1], &code), ARFUSE_OK);
  ASSERT_NO_FATAL_FAILURE(Reinitialize());
}

// An attached client's in-stream launch on rank 0 and the sidecar's own launch (an eager op) of
// the same shape on rank 1 never pair, as after a client died with its op published and the
// peer's sidecar ran an eager op before the workspace was retired: both ranks' workspaces hold
// the failure (kOpMismatch, or on rank 1 the abort it was sent) and rank 0 writes no output.
// One-shot (2 tokens) and two-shot (16 tokens).
TEST_F(InStreamGpu, AnEagerOpNeverPairsWithAClientsInStreamOp) {
  spin_timeout_ns_ = 500'000'000;
  ASSERT_NO_FATAL_FAILURE(AttachAll());
  // The eager kernels are loaded before any kernel spins, as the sidecar's engine does: with lazy
  // module loading, rank 1's first launch would wait behind rank 0's spinning kernel.
  CUDA_OK(PrepareAllReduceFusionKernels());
  int call = 0;
  for (uint32_t tokens : {2u, 16u}) {
    SCOPED_TRACE(tokens);
    Op op(tokens, ++call);
    for (int r = 0; r < kWorld; ++r) op.Upload(streams_[r], r);
    ASSERT_EQ(op.Launch(ctx_[0], streams_[0], 0, true), ARFUSE_OK) << arfuse_last_error();
    FusedOpArgs args;
    args.pattern = Pattern::kAllReduceResidualRmsNorm;
    args.dtype = DType::kBF16;
    args.hidden = kHidden;
    args.num_tokens = tokens;
    args.eps = 1e-5f;
    args.input = op.dev[1][0]->ptr;
    args.residual_in = op.dev[1][1]->ptr;
    args.residual_out = op.dev[1][2]->ptr;
    args.norm_out = op.dev[1][3]->ptr;
    args.gamma = op.gamma->ptr;
    void* peers[kWorld] = {reinterpret_cast<void*>(ws_[0]->ptr),
                           reinterpret_cast<void*>(ws_[1]->ptr)};
    FusionLaunchSite site;
    site.peer_workspace = peers;
    site.rank = 1;
    site.world_size = kWorld;
    site.layout = layout_;
    site.spin_timeout_ns = spin_timeout_ns_;
    site.sm_budget = sm_budget_;
    const FusionAlgo algo = tokens <= 4 ? FusionAlgo::kOneShot : FusionAlgo::kTwoShot;
    const FusionParams params = MakeFusionParams(args, algo, site);
    const char* why = nullptr;
    ASSERT_EQ(CheckFusionParams(params, &why), cudaSuccess) << (why != nullptr ? why : "");
    CUDA_OK(LaunchAllReduceFusion(params, streams_[1]));
    CUDA_OK(cudaDeviceSynchronize());
    // Rank 0's client sees the mismatch; rank 1's workspace holds it, or the abort rank 0
    // forwarded when it saw it first (the sidecar's engine reads that word after its op).
    uint32_t code = 0;
    EXPECT_EQ(arfuse_check(ctx_[0], &code), ARFUSE_ABORTED);
    EXPECT_EQ(code, static_cast<uint32_t>(FusionError::kOpMismatch));
    EXPECT_THAT(arfuse_last_error(), HasSubstr("op_mismatch"));
    uint32_t words[kWorld] = {};
    for (int r = 0; r < kWorld; ++r) {
      CUDA_OK(ReadWorkspaceError(reinterpret_cast<void*>(ws_[r]->ptr), layout_, streams_[r],
                                 &words[r]));
    }
    EXPECT_EQ(words[0], static_cast<uint32_t>(FusionError::kOpMismatch));
    EXPECT_THAT(words[1], ::testing::AnyOf(static_cast<uint32_t>(FusionError::kOpMismatch),
                                           static_cast<uint32_t>(FusionError::kPeerAbort)));
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_EQ(op.Download(r, 2), std::vector<uint8_t>(op.bytes, 0xee))
          << "rank " << r << ": no output written";
    }
    ASSERT_NO_FATAL_FAILURE(Reinitialize());
  }
  // The same workspaces serve a paired in-stream op again.
  Op op(2, ++call);
  for (int r = 0; r < kWorld; ++r) op.Upload(streams_[r], r);
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_EQ(op.Launch(ctx_[r], streams_[r], r, true), ARFUSE_OK) << arfuse_last_error();
  }
  CUDA_OK(cudaDeviceSynchronize());
  ASSERT_NO_FATAL_FAILURE(op.Verify(true, call));
}

// Clients of two programs (arfuse_set_program_key: keys that differ, in the descriptor's low or
// high key bits, or a key against none) never pair an op, as when a client of another program
// attached on rank 1 in the milliseconds after rank 0's client died with its op published: both
// ranks fail with op_mismatch (or the abort the first to see it forwarded) and write no output.
// Clients that set the same key pair as before. One-shot (2 tokens) and two-shot (16 tokens).
TEST_F(InStreamGpu, ClientsOfTwoProgramsNeverPairAnOp) {
  spin_timeout_ns_ = 500'000'000;
  ASSERT_NO_FATAL_FAILURE(AttachAll());
  const uint32_t mismatch = static_cast<uint32_t>(FusionError::kOpMismatch);
  const uint32_t peer_abort = static_cast<uint32_t>(FusionError::kPeerAbort);
  int call = 0;
  struct Keys {
    uint32_t k0, k1;
  };
  for (uint32_t tokens : {2u, 16u}) {
    for (Keys keys : {Keys{0x001234, 0x003234}, Keys{0x001234, 0x001235}, Keys{0, 0x800000},
                      Keys{0xfff000, 0}}) {
      SCOPED_TRACE(::testing::Message() << tokens << " tokens, keys " << keys.k0 << " " << keys.k1);
      ASSERT_EQ(arfuse_set_program_key(ctx_[0], keys.k0), ARFUSE_OK);
      ASSERT_EQ(arfuse_set_program_key(ctx_[1], keys.k1), ARFUSE_OK);
      Op op(tokens, ++call);
      for (int r = 0; r < kWorld; ++r) op.Upload(streams_[r], r);
      for (int r = 0; r < kWorld; ++r) {
        ASSERT_EQ(op.Launch(ctx_[r], streams_[r], r, true), ARFUSE_OK) << arfuse_last_error();
      }
      CUDA_OK(cudaDeviceSynchronize());
      uint32_t codes[kWorld] = {};
      for (int r = 0; r < kWorld; ++r) {
        EXPECT_EQ(arfuse_check(ctx_[r], &codes[r]), ARFUSE_ABORTED) << "rank " << r;
        EXPECT_THAT(codes[r], ::testing::AnyOf(mismatch, peer_abort)) << "rank " << r;
        EXPECT_EQ(op.Download(r, 2), std::vector<uint8_t>(op.bytes, 0xee))
            << "rank " << r << ": no output written";
      }
      EXPECT_TRUE(codes[0] == mismatch || codes[1] == mismatch);
      // The sidecars re-initialize a failed workspace under a new generation, and the clients
      // attach again (their error words hold the failure until then).
      for (arfuse_ctx*& c : ctx_) {
        arfuse_detach(c);
        c = nullptr;
      }
      ++generation_;
      ASSERT_NO_FATAL_FAILURE(Reinitialize());
      ASSERT_NO_FATAL_FAILURE(AttachAll());
    }
  }
  // The same key on both ranks pairs, one-shot and two-shot.
  for (uint32_t tokens : {2u, 16u}) {
    for (arfuse_ctx* c : ctx_) ASSERT_EQ(arfuse_set_program_key(c, 0xabcdef), ARFUSE_OK);
    Op op(tokens, ++call);
    for (int r = 0; r < kWorld; ++r) op.Upload(streams_[r], r);
    for (int r = 0; r < kWorld; ++r) {
      ASSERT_EQ(op.Launch(ctx_[r], streams_[r], r, true), ARFUSE_OK) << arfuse_last_error();
    }
    CUDA_OK(cudaDeviceSynchronize());
    ASSERT_NO_FATAL_FAILURE(op.Verify(true, call));
  }
  for (arfuse_ctx* c : ctx_) EXPECT_EQ(arfuse_check(c, nullptr), ARFUSE_OK) << arfuse_last_error();
}

// The sidecar re-initialized the workspace (a new generation's tag) after the client attached:
// the client's launches, eager or replayed from a graph captured before, change nothing, count
// as stale, and say so in the error word (arfuse_check: FAILED_PRECONDITION, attach again).
TEST_F(InStreamGpu, LaunchesOfAnOlderGenerationAreStaleAndWriteNothing) {
  ASSERT_NO_FATAL_FAILURE(AttachAll());
  Op op(2, 1);
  for (int r = 0; r < kWorld; ++r) op.Upload(streams_[r], r);
  // A graph of one op on each rank, captured while the attachment's generation is current.
  cudaGraphExec_t exec[kWorld] = {};
  for (int r = 0; r < kWorld; ++r) {
    cudaGraph_t graph = nullptr;
    CUDA_OK(cudaStreamBeginCapture(streams_[r], cudaStreamCaptureModeThreadLocal));
    ASSERT_EQ(op.Launch(ctx_[r], streams_[r], r, true), ARFUSE_OK) << arfuse_last_error();
    CUDA_OK(cudaStreamEndCapture(streams_[r], &graph));
    CUDA_OK(cudaGraphInstantiate(&exec[r], graph, 0));
    CUDA_OK(cudaGraphDestroy(graph));
  }
  ++generation_;
  ASSERT_NO_FATAL_FAILURE(Reinitialize());
  for (int r = 0; r < kWorld; ++r) {
    CUDA_OK(cudaGraphLaunch(exec[r], streams_[r]));
    ASSERT_EQ(op.Launch(ctx_[r], streams_[r], r, true), ARFUSE_OK) << arfuse_last_error();
  }
  CUDA_OK(cudaDeviceSynchronize());
  for (int r = 0; r < kWorld; ++r) {
    uint32_t code = 0;
    EXPECT_EQ(arfuse_check(ctx_[r], &code), ARFUSE_FAILED_PRECONDITION) << "rank " << r;
    EXPECT_EQ(code, kErrorStaleGeneration);
    EXPECT_THAT(arfuse_last_error(), HasSubstr("stale"));
    EXPECT_EQ(op.Download(r, 2), std::vector<uint8_t>(op.bytes, 0xee)) << "no output written";
    CUDA_OK(cudaGraphExecDestroy(exec[r]));
  }
  // The stale launches touched nothing: the workspace serves the new generation's clients.
  uint32_t stale = 0, error = 0;
  for (int r = 0; r < kWorld; ++r) {
    FusionControl c;
    CUDA_OK(cudaMemcpy(&c, reinterpret_cast<char*>(ws_[r]->ptr) + layout_.control_offset,
                       offsetof(FusionControl, reserved1), cudaMemcpyDeviceToHost));
    stale += static_cast<uint32_t>(c.instream_stale);
    error |= c.error;
  }
  EXPECT_EQ(stale, 4u);  // two launches on each of two ranks
  EXPECT_EQ(error, 0u);
}

// The kernels count every launch per attachment slot, pattern and token bucket in the control
// block (FusionControl::instream_ops): a graph's replays never pass through the library, so this
// is the only per-attachment count of them. One op captured on each rank and replayed kReplays
// times, plus one eager launch: the slot counts kReplays + 1, the library's page would count 2
// (the capture and the eager launch). The sidecar's attachments table, probing the control
// block as the CUDA engine does, reports the same for the attachment.
TEST_F(InStreamGpu, ReplaysOfACapturedOpCountPerAttachment) {
  constexpr int kReplays = 25;
  constexpr uint32_t kTokens = 2;
  auto read_control = [&](int r) {
    auto c = std::make_unique<FusionControl>();
    EXPECT_EQ(cudaMemcpy(c.get(), reinterpret_cast<char*>(ws_[r]->ptr) + layout_.control_offset,
                         sizeof(FusionControl), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return c;
  };
  // The sidecar's view of rank 0: its attachments table, probing the control block the way
  // CudaEngine::InStreamStatus does (one copy of the table), hands out the slot.
  InStreamAttachments table([](uint64_t, const AttachEventData&) {},
                            [&] {
                              InStreamProbe p;
                              std::unique_ptr<FusionControl> c = read_control(0);
                              p.ok = true;
                              p.generation = generation_;
                              p.launches = c->instream_launches;
                              p.ops.emplace();
                              std::memcpy(&*p.ops, c->instream_ops, sizeof(c->instream_ops));
                              return p;
                            },
                            absl::Milliseconds(5));
  table.ExpectKernelCounts();
  absl::StatusOr<uint64_t> id = table.Add(1, generation_);
  ASSERT_TRUE(id.ok());
  const uint32_t slot[kWorld] = {*table.counter_slot(*id), 7};
  for (int r = 0; r < kWorld; ++r) {
    AttachResult a = AttachRank(r, [&](std::string& blob) {
      std::memcpy(blob.data() + offsetof(AttachHeader, counter_slot), &slot[r], sizeof(uint32_t));
    });
    ASSERT_EQ(a.rc, ARFUSE_OK) << a.message;
    ctx_[r] = a.ctx;
  }
  Op op(kTokens, 1);
  for (int r = 0; r < kWorld; ++r) op.Upload(streams_[r], r);
  cudaGraphExec_t exec[kWorld] = {};
  for (int r = 0; r < kWorld; ++r) {
    cudaGraph_t graph = nullptr;
    CUDA_OK(cudaStreamBeginCapture(streams_[r], cudaStreamCaptureModeThreadLocal));
    ASSERT_EQ(op.Launch(ctx_[r], streams_[r], r, true), ARFUSE_OK) << arfuse_last_error();
    CUDA_OK(cudaStreamEndCapture(streams_[r], &graph));
    CUDA_OK(cudaGraphInstantiate(&exec[r], graph, 0));
    CUDA_OK(cudaGraphDestroy(graph));
  }
  CUDA_OK(cudaDeviceSynchronize());
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(read_control(r)->instream_launches, 0u) << "a capture runs nothing";
  }
  for (int replay = 0; replay < kReplays; ++replay) {
    for (int r = 0; r < kWorld; ++r) CUDA_OK(cudaGraphLaunch(exec[r], streams_[r]));
  }
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_EQ(op.Launch(ctx_[r], streams_[r], r, true), ARFUSE_OK) << arfuse_last_error();
  }
  CUDA_OK(cudaDeviceSynchronize());
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(arfuse_check(ctx_[r], nullptr), ARFUSE_OK) << arfuse_last_error();
    std::unique_ptr<FusionControl> c = read_control(r);
    EXPECT_EQ(c->instream_launches, uint64_t{kReplays} + 1) << "rank " << r;
    uint64_t total = 0;
    for (uint32_t s = 0; s < kInStreamCounterSlots; ++s) {
      for (uint32_t pi = 0; pi < kOpPatterns; ++pi) {
        for (uint32_t b = 0; b < kOpBucketSlots; ++b) total += c->instream_ops[s][pi][b];
      }
    }
    EXPECT_EQ(c->instream_ops[slot[r]][1][OpTokenBucket(kTokens)], uint64_t{kReplays} + 1)
        << "rank " << r;
    EXPECT_EQ(total, uint64_t{kReplays} + 1) << "nothing counted elsewhere, rank " << r;
  }
  for (cudaGraphExec_t e : exec) CUDA_OK(cudaGraphExecDestroy(e));
  const auto settled = [&] {
    return table.op_counts(*id)->fused_total() == uint64_t{kReplays} + 1;
  };
  for (int i = 0; i < 200 && !settled(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const InStreamOpCounts mine = *table.op_counts(*id);
  EXPECT_EQ(mine.fused[1][OpTokenBucket(kTokens)], uint64_t{kReplays} + 1);
  EXPECT_EQ(mine.fused_total(), uint64_t{kReplays} + 1);
  EXPECT_EQ(table.op_counts().fused_total(), uint64_t{kReplays} + 1);
  EXPECT_EQ(table.unattributed_launches(), 0u);
}

// The same through a slot the table handed out, and a client whose launches carry an index out
// of range: counted in the unattributed slot, nothing written outside the control block.
TEST_F(InStreamGpu, ASlotIndexOutOfRangeCountsUnattributed) {
  InStreamAttachments table(
      [](uint64_t, const AttachEventData&) {},
      [&] {
        InStreamProbe p;
        auto c = std::make_unique<FusionControl>();
        if (cudaMemcpy(c.get(), reinterpret_cast<char*>(ws_[0]->ptr) + layout_.control_offset,
                       sizeof(FusionControl), cudaMemcpyDeviceToHost) != cudaSuccess) {
          return p;
        }
        p.ok = true;
        p.generation = generation_;
        p.ops.emplace();
        std::memcpy(&*p.ops, c->instream_ops, sizeof(c->instream_ops));
        return p;
      },
      absl::Milliseconds(5));
  table.ExpectKernelCounts();
  absl::StatusOr<uint64_t> id = table.Add(1, generation_);
  ASSERT_TRUE(id.ok());
  const uint32_t slots[kWorld] = {*table.counter_slot(*id), 0xdeadbeefu};
  for (int r = 0; r < kWorld; ++r) {
    AttachResult a = AttachRank(r, [&](std::string& blob) {
      std::memcpy(blob.data() + offsetof(AttachHeader, counter_slot), &slots[r], sizeof(uint32_t));
    });
    ASSERT_EQ(a.rc, ARFUSE_OK) << a.message;
    ctx_[r] = a.ctx;
  }
  constexpr int kOps = 6;
  for (int call = 1; call <= kOps; ++call) {
    Op op(100, call);  // the 65-512 bucket, two-shot
    for (int r = 0; r < kWorld; ++r) op.Upload(streams_[r], r);
    for (int r = 0; r < kWorld; ++r) {
      ASSERT_EQ(op.Launch(ctx_[r], streams_[r], r, false), ARFUSE_OK) << arfuse_last_error();
    }
    CUDA_OK(cudaDeviceSynchronize());
    ASSERT_NO_FATAL_FAILURE(op.Verify(false, call));
  }
  FusionControl c1;
  CUDA_OK(cudaMemcpy(&c1, reinterpret_cast<char*>(ws_[1]->ptr) + layout_.control_offset,
                     sizeof(FusionControl), cudaMemcpyDeviceToHost));
  EXPECT_EQ(c1.instream_ops[kInStreamUnattributedSlot][0][OpTokenBucket(100)], uint64_t{kOps});
  EXPECT_EQ(c1.error, 0u);
  const auto settled = [&] { return table.op_counts(*id)->fused_total() == uint64_t{kOps}; };
  for (int i = 0; i < 200 && !settled(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(table.op_counts(*id)->fused[0][OpTokenBucket(100)], uint64_t{kOps});
  EXPECT_EQ(table.unattributed_launches(), 0u);  // rank 0's table: its client used its slot
}

}  // namespace
}  // namespace arfuse::instream
