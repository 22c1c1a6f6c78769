// How the daemon words the doorbell self-test and MPS detection (CUDA-free).
#include "server/doorbell/doorbell_report.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace arfuse {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

DoorbellHopReport Measured(double doorbell, double inprocess) {
  DoorbellHopReport r;
  r.measured = true;
  r.ops = 200;
  r.doorbell_us_per_op = doorbell;
  r.inprocess_us_per_op = inprocess;
  r.hop_us = doorbell - inprocess;
  return r;
}

TEST(DoorbellReport, FastOnlyWhenMeasuredUnderTargetAndMpsRuns) {
  EXPECT_TRUE(DoorbellExpectedFast(Measured(4.0, 1.5), true));
  EXPECT_FALSE(DoorbellExpectedFast(Measured(4.0, 1.5), false));  // time-slicing without MPS
  EXPECT_FALSE(DoorbellExpectedFast(Measured(6.0, 1.5), true));   // 4.5 us over the 3 us target
  EXPECT_FALSE(DoorbellExpectedFast(DoorbellHopReport{}, true));
}

TEST(DoorbellReport, DescribesTheFiguresAndMps) {
  const std::string line = DescribeDoorbell(Measured(4.12, 1.71), true);
  EXPECT_THAT(line, HasSubstr("+2.41 us/op over in-process"));
  EXPECT_THAT(line, HasSubstr("4.12 vs 1.71 us/op, 200 ops"));
  EXPECT_THAT(line, HasSubstr("mps=active"));
  EXPECT_THAT(line, Not(HasSubstr("target")));
}

TEST(DoorbellReport, SaysWhyItIsSlowOrUnmeasured) {
  EXPECT_THAT(DescribeDoorbell(Measured(6.0, 1.5), true), HasSubstr("above the 3.0 us target"));
  const std::string no_mps = DescribeDoorbell(Measured(4.0, 1.5), false);
  EXPECT_THAT(no_mps, HasSubstr("mps=inactive"));
  EXPECT_THAT(no_mps, HasSubstr("run MPS"));
  DoorbellHopReport failed;
  failed.error = "no CUDA device";
  EXPECT_THAT(DescribeDoorbell(failed, true), HasSubstr("not measured (no CUDA device)"));
  EXPECT_THAT(DescribeDoorbell(DoorbellHopReport{}, true), HasSubstr("not measured (not run)"));
}

}  // namespace
}  // namespace arfuse
