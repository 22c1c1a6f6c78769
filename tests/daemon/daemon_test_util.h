// Helpers of the tests that run arfused as a process (daemon_test, security_test): its refusal
// of a configuration, and health checks on its endpoints.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"

namespace arfuse::testing {

// Runs `argv` to completion, with `env` added to the environment: success when it exits with
// code 2 (how arfused refuses a configuration) and its output contains `message`; otherwise the
// failure shows the code and the whole output.
::testing::AssertionResult ExitsWith2(const std::vector<std::string>& argv,
                                      const std::string& message,
                                      const std::vector<std::string>& env = {});

// grpc.health.v1 Health.Check of `service` ("": the process itself) over `channel`, with a 10 s
// deadline. `response` may be null when only the status matters.
grpc::Status HealthCheck(const std::shared_ptr<grpc::Channel>& channel,
                         const std::string& service = "",
                         grpc::health::v1::HealthCheckResponse* response = nullptr);
// The same over a plaintext channel to `addr` ("unix:<path>" or "host:port").
grpc::Status HealthCheck(const std::string& addr, const std::string& service = "",
                         grpc::health::v1::HealthCheckResponse* response = nullptr);

}  // namespace arfuse::testing
