#include "tests/daemon/daemon_test_util.h"

#include <chrono>

#include "tests/support/subprocess.h"

namespace arfuse::testing {

::testing::AssertionResult ExitsWith2(const std::vector<std::string>& argv,
                                      const std::string& message,
                                      const std::vector<std::string>& env) {
  auto [code, out] = RunToCompletion(argv, env);
  if (code == 2 && out.find(message) != std::string::npos) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << "exit code " << code << " (want 2), output (want \"" << message << "\" in it):\n"
         << out;
}

grpc::Status HealthCheck(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                         grpc::health::v1::HealthCheckResponse* response) {
  grpc::health::v1::HealthCheckResponse ignored;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  return grpc::health::v1::Health::NewStub(channel)->Check(
      &ctx, request, response != nullptr ? response : &ignored);
}

grpc::Status HealthCheck(const std::string& addr, const std::string& service,
                         grpc::health::v1::HealthCheckResponse* response) {
  return HealthCheck(grpc::CreateChannel(addr, grpc::InsecureChannelCredentials()), service,
                     response);
}

}  // namespace arfuse::testing
