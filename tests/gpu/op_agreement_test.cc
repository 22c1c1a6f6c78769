#include "server/collective/op_agreement.h"

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "server/peers/local_exchange.h"

namespace arfuse {
namespace {

constexpr absl::Duration kWait = absl::Seconds(10);

AgreementDeadlines Within(absl::Duration d) {
  AgreementDeadlines out;
  out.arrive_by = absl::Now() + d;
  out.confirm_within = d;
  return out;
}

UnfusedOpKey Key(uint32_t tokens, uint32_t hidden) {
  UnfusedOpKey k;
  k.num_tokens = tokens;
  k.hidden = hidden;
  k.dtype = DType::kBF16;
  k.pattern = Pattern::kAllReduceResidualRmsNorm;
  k.eps = 1e-6f;
  return k;
}

// Every rank of an in-process group agrees on its own key; returns each rank's status.
std::vector<absl::Status> AgreeAll(std::vector<std::unique_ptr<Exchange>>& group,
                                   const std::vector<UnfusedOpKey>& keys, uint64_t generation) {
  std::vector<absl::Status> got(group.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < group.size(); ++r) {
    threads.emplace_back(
        [&, r] { got[r] = AgreeOnUnfusedOp(*group[r], generation, keys[r], Within(kWait)); });
  }
  for (std::thread& t : threads) t.join();
  return got;
}

TEST(OpAgreement, EqualOpsAgreeOnEveryRankOpAfterOp) {
  std::vector<std::unique_ptr<Exchange>> group = LocalExchangeGroup::Create(4);
  for (uint32_t tokens : {1u, 7u, 128u}) {
    std::vector<absl::Status> got =
        AgreeAll(group, std::vector<UnfusedOpKey>(4, Key(tokens, 4096)), 1);
    for (const absl::Status& s : got) EXPECT_TRUE(s.ok()) << s;
  }
}

TEST(OpAgreement, SameElementCountAnotherShapeIsRefusedOnEveryRank) {
  // NCCL would sum 4 x 4096 with 8 x 2048 element by element without complaint.
  std::vector<std::unique_ptr<Exchange>> group = LocalExchangeGroup::Create(2);
  std::vector<absl::Status> got = AgreeAll(group, {Key(4, 4096), Key(8, 2048)}, 1);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(got[r].code(), absl::StatusCode::kInvalidArgument) << got[r];
    EXPECT_NE(got[r].message().find("ranks disagree on the op"), std::string::npos) << got[r];
    EXPECT_NE(got[r].message().find("NCCL was called on no rank"), std::string::npos) << got[r];
  }
  EXPECT_NE(got[0].message().find("rank 1 runs tokens=8 hidden=2048"), std::string::npos) << got[0];
  EXPECT_NE(got[1].message().find("rank 0 runs tokens=4 hidden=4096"), std::string::npos) << got[1];
  // Refused alike on every rank: the ranks stay in step and the next op agrees.
  got = AgreeAll(group, {Key(4, 4096), Key(4, 4096)}, 1);
  for (const absl::Status& s : got) EXPECT_TRUE(s.ok()) << s;
}

TEST(OpAgreement, EveryFieldOfTheOpTakesPart) {
  std::vector<UnfusedOpKey> others(5, Key(4, 4096));
  others[0].dtype = DType::kFP16;
  others[1].pattern = Pattern::kAllReduce;
  others[2].eps = 1e-5f;
  others[3].symmetric = true;
  others[4].num_tokens = 5;
  const char* named[] = {"dtype=fp16", "pattern=allreduce ", "eps=1e-05", "nccl=symmetric",
                         "tokens=5"};
  for (size_t i = 0; i < others.size(); ++i) {
    std::vector<std::unique_ptr<Exchange>> group = LocalExchangeGroup::Create(2);
    std::vector<absl::Status> got = AgreeAll(group, {Key(4, 4096), others[i]}, 1);
    EXPECT_EQ(got[0].code(), absl::StatusCode::kInvalidArgument) << i << ": " << got[0];
    EXPECT_EQ(got[1].code(), absl::StatusCode::kInvalidArgument) << i << ": " << got[1];
    EXPECT_NE(got[0].message().find(named[i]), std::string::npos) << got[0];
  }
}

TEST(OpAgreement, FP8PatternsAndGroupScaleLayoutsTakePart) {
  // The unfused path serves the FP8 patterns too: a static op is not a per-token op, and two
  // per-group ops writing their scales in other layouts are two requests.
  UnfusedOpKey stat = Key(4, 4096), token = Key(4, 4096), row_major = Key(4, 4096);
  stat.pattern = Pattern::kAllReduceResidualRmsNormFp8Static;
  token.pattern = Pattern::kAllReduceResidualRmsNormFp8PerToken;
  row_major.pattern = Pattern::kAllReduceResidualRmsNormFp8PerGroup;
  row_major.scale_layout = 1;
  UnfusedOpKey packed = row_major;
  packed.scale_layout = 3;
  {
    std::vector<std::unique_ptr<Exchange>> group = LocalExchangeGroup::Create(2);
    std::vector<absl::Status> got = AgreeAll(group, {stat, token}, 1);
    EXPECT_EQ(got[0].code(), absl::StatusCode::kInvalidArgument) << got[0];
    EXPECT_NE(got[0].message().find("pattern=allreduce_residual_rmsnorm_fp8_per_token"),
              std::string::npos)
        << got[0];
  }
  {
    std::vector<std::unique_ptr<Exchange>> group = LocalExchangeGroup::Create(2);
    std::vector<absl::Status> got = AgreeAll(group, {row_major, packed}, 1);
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(got[r].code(), absl::StatusCode::kInvalidArgument) << got[r];
      EXPECT_NE(got[r].message().find("ranks disagree on the op"), std::string::npos) << got[r];
    }
    EXPECT_NE(got[0].message().find("rank 1 runs tokens=4 hidden=4096 dtype=bf16 pattern="),
              std::string::npos)
        << got[0];
    EXPECT_NE(got[0].message().find("scale_layout=3"), std::string::npos) << got[0];
    EXPECT_NE(got[1].message().find("scale_layout=1"), std::string::npos) << got[1];
    // Equal per-group ops agree.
    got = AgreeAll(group, {packed, packed}, 1);
    for (const absl::Status& s : got) EXPECT_TRUE(s.ok()) << s;
  }
}

TEST(OpAgreement, NegativeZeroEpsIsAnotherOp) {
  // Bit for bit: -0.0f == 0.0f as floats, but the ops are not the same request.
  UnfusedOpKey a = Key(1, 4096), b = Key(1, 4096);
  a.eps = 0.0f;
  b.eps = -0.0f;
  EXPECT_NE(EncodeUnfusedOp(a), EncodeUnfusedOp(b));
  std::vector<std::unique_ptr<Exchange>> group = LocalExchangeGroup::Create(2);
  std::vector<absl::Status> got = AgreeAll(group, {a, b}, 1);
  EXPECT_EQ(got[0].code(), absl::StatusCode::kInvalidArgument) << got[0];
}

TEST(OpAgreement, MissingRankTimesOutAndALateRankIsRefusedToo) {
  std::vector<std::unique_ptr<Exchange>> group = LocalExchangeGroup::Create(2);
  const absl::Time start = absl::Now();
  absl::Status early =
      AgreeOnUnfusedOp(*group[0], 3, Key(2, 4096), Within(absl::Milliseconds(200)));
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(early.code(), absl::StatusCode::kDeadlineExceeded) << early;
  EXPECT_NE(early.message().find("the ranks did not agree on the unfused op (tokens=2"),
            std::string::npos)
      << early;
  EXPECT_GE(took, absl::Milliseconds(150));
  // The rank whose client came back late must not enqueue the op its peer gave up on.
  absl::Status late = AgreeOnUnfusedOp(*group[1], 3, Key(2, 4096), Within(kWait));
  EXPECT_EQ(late.code(), absl::StatusCode::kAborted) << late;
  EXPECT_NE(late.message().find("already failed on the other ranks"), std::string::npos) << late;
  // A new generation starts afresh.
  std::vector<absl::Status> got = AgreeAll(group, {Key(2, 4096), Key(2, 4096)}, 4);
  for (const absl::Status& s : got) EXPECT_TRUE(s.ok()) << s;
}

TEST(OpAgreement, APeerThatPublishedItsOpButNeverConfirmsStopsEveryRank) {
  // The peer died or froze while it waited for this rank in step 1: the coordinator may complete
  // step 1 with its key, but step 2 never passes, so no rank enqueues the op.
  std::vector<std::unique_ptr<Exchange>> group = LocalExchangeGroup::Create(2);
  std::thread peer([&] {
    static_cast<void>(
        group[1]->Allgather(UnfusedOpTag(1), EncodeUnfusedOp(Key(2, 4096)), absl::Now() + kWait));
  });
  const absl::Time start = absl::Now();
  absl::Status mine = AgreeOnUnfusedOp(*group[0], 1, Key(2, 4096), Within(absl::Milliseconds(300)));
  const absl::Duration took = absl::Now() - start;
  peer.join();
  EXPECT_EQ(mine.code(), absl::StatusCode::kDeadlineExceeded) << mine;
  EXPECT_NE(mine.message().find("not every rank confirmed it"), std::string::npos) << mine;
  EXPECT_LT(took, absl::Seconds(5));
  // The confirmation gets its own time, counted from the end of step 1 ...
  group = LocalExchangeGroup::Create(2);
  std::vector<absl::Status> got(2);
  std::thread late([&] {
    absl::SleepFor(absl::Milliseconds(250));
    got[1] = AgreeOnUnfusedOp(*group[1], 1, Key(2, 4096), Within(absl::Milliseconds(300)));
  });
  got[0] = AgreeOnUnfusedOp(*group[0], 1, Key(2, 4096), Within(absl::Milliseconds(300)));
  late.join();
  EXPECT_TRUE(got[0].ok()) << got[0];
  EXPECT_TRUE(got[1].ok()) << got[1];
  // ... but never past `latest`.
  group = LocalExchangeGroup::Create(2);
  std::thread peer2([&] {
    static_cast<void>(
        group[1]->Allgather(UnfusedOpTag(1), EncodeUnfusedOp(Key(2, 4096)), absl::Now() + kWait));
  });
  AgreementDeadlines capped = Within(kWait);
  capped.latest = absl::Now() + absl::Milliseconds(200);
  const absl::Time t0 = absl::Now();
  mine = AgreeOnUnfusedOp(*group[0], 1, Key(2, 4096), capped);
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2)) << mine;
  EXPECT_EQ(mine.code(), absl::StatusCode::kDeadlineExceeded) << mine;
  peer2.join();
}

TEST(OpAgreement, AnUnreadableKeyIsRefused) {
  std::vector<std::unique_ptr<Exchange>> group = LocalExchangeGroup::Create(2);
  absl::Status mine;
  std::thread peer([&] {
    // A sidecar of another encoding: refused, never taken for an equal op.
    static_cast<void>(group[1]->Allgather(UnfusedOpTag(1), "v9-op", absl::Now() + kWait));
  });
  mine = AgreeOnUnfusedOp(*group[0], 1, Key(1, 4096), Within(kWait));
  peer.join();
  EXPECT_EQ(mine.code(), absl::StatusCode::kInvalidArgument) << mine;
  EXPECT_NE(mine.message().find("an op this sidecar cannot read"), std::string::npos) << mine;
}

TEST(OpAgreement, TagsDifferPerGeneration) {
  EXPECT_NE(UnfusedOpTag(1), UnfusedOpTag(2));
  EXPECT_EQ(DescribeUnfusedOp(Key(4, 4096)),
            "tokens=4 hidden=4096 dtype=bf16 pattern=allreduce_residual_rmsnorm eps=1e-06 "
            "nccl=regular");
}

}  // namespace
}  // namespace arfuse
