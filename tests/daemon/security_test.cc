// The main socket's credential check (SO_PEERCRED) and the main API over TCP with mutual TLS.
#include <grp.h>
#include <grpcpp/grpcpp.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <regex>
#include <sstream>
#include <string>

#include "gtest/gtest.h"
#include "tests/daemon/daemon_test_util.h"
#include "tests/support/daemon_process.h"
#include "tests/support/subprocess.h"

namespace arfuse {
namespace {

using ::arfuse::testing::ArfusedPath;
using ::arfuse::testing::BinaryPath;
using ::arfuse::testing::ExitsWith2;
using ::arfuse::testing::HealthCheck;
using ::arfuse::testing::MakeTempDir;
using ::arfuse::testing::RunToCompletion;
using namespace std::chrono_literals;

constexpr uid_t kNobody = 65534;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs `arfusectl health` as uid/gid 65534 and returns its exit code.
int HealthAsNobody(const std::string& socket) {
  pid_t pid = ::fork();
  if (pid == 0) {
    if (::setgroups(0, nullptr) != 0 || ::setgid(kNobody) != 0 || ::setuid(kNobody) != 0) {
      ::_exit(100);
    }
    std::string ctl = BinaryPath("client/arfusectl/arfusectl");
    std::string addr = "--addr=unix:" + socket;
    ::execl(ctl.c_str(), ctl.c_str(), "health", addr.c_str(), "--timeout-ms=3000",
            static_cast<char*>(nullptr));
    ::_exit(101);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

using Daemon = ::arfuse::testing::DaemonProcess;

TEST(DaemonSecurity, SocketIsCreatedOwnerAndGroupOnly) {
  Daemon d;
  ASSERT_TRUE(d.ready) << d.proc->Stderr();
  struct stat st {};
  ASSERT_EQ(::stat(d.socket.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660);
}

TEST(DaemonSecurity, DisallowedUserIsRefusedEvenWhenTheSocketIsReachable) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to act as another user";
  Daemon d;
  ASSERT_TRUE(d.ready) << d.proc->Stderr();
  // Open the file system's door wide, so only the credential check stands in the way.
  ASSERT_EQ(::chmod(d.dir.c_str(), 0755), 0);
  ASSERT_EQ(::chmod(d.socket.c_str(), 0666), 0);
  EXPECT_EQ(HealthAsNobody(d.socket), 3);  // arfusectl: unreachable
  EXPECT_TRUE(d.proc->WaitForOutput("event=connection_refused uid=65534", 10s)) << d.proc->Stderr();
  // The sidecar keeps serving its allowed users.
  EXPECT_TRUE(HealthCheck("unix:" + d.socket).ok());
}

TEST(DaemonSecurity, AllowedUidIsAccepted) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to act as another user";
  Daemon d({"--allowed-uids=65534"});
  ASSERT_TRUE(d.ready) << d.proc->Stderr();
  ASSERT_EQ(::chmod(d.dir.c_str(), 0755), 0);
  ASSERT_EQ(::chmod(d.socket.c_str(), 0666), 0);
  EXPECT_EQ(HealthAsNobody(d.socket), 0) << d.proc->Stderr();
}

TEST(DaemonSecurity, BadAllowedIdsExit2) {
  EXPECT_TRUE(
      ExitsWith2({ArfusedPath(), "--allowed-uids=12,abc"}, "bad value \"abc\" in --allowed-uids"));
  EXPECT_TRUE(ExitsWith2({ArfusedPath(), "--allowed-gids=-1"}, "--allowed-gids"));
}

TEST(DaemonSecurity, TcpWithoutTlsIsRefused) {
  EXPECT_TRUE(
      ExitsWith2({ArfusedPath(), "--device=host", "--listen=127.0.0.1:0"}, "only with mutual TLS"));
}

class MutualTls : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir();
    // A CA, a server certificate for the name "arfuse-test", and a client certificate, made
    // fresh for every run.
    const std::string script =
        "set -e; cd " + dir_ +
        "; openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=arfuse-test-ca "
        "-keyout ca.key -out ca.pem 2>/dev/null"
        "; openssl req -newkey rsa:2048 -nodes -subj /CN=arfuse-test "
        "-addext subjectAltName=DNS:arfuse-test -keyout server.key -out server.csr 2>/dev/null"
        "; openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 "
        "-copy_extensions copy -out server.pem 2>/dev/null"
        "; openssl req -newkey rsa:2048 -nodes -subj /CN=arfuse-client -keyout client.key "
        "-out client.csr 2>/dev/null"
        "; openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 "
        "-out client.pem 2>/dev/null";
    auto [code, out] = RunToCompletion({"/bin/sh", "-c", script});
    ASSERT_EQ(code, 0) << out;
  }

  std::shared_ptr<grpc::Channel> Channel(int port, bool with_client_cert) {
    grpc::SslCredentialsOptions tls;
    tls.pem_root_certs = ReadFile(dir_ + "/ca.pem");
    if (with_client_cert) {
      tls.pem_private_key = ReadFile(dir_ + "/client.key");
      tls.pem_cert_chain = ReadFile(dir_ + "/client.pem");
    }
    grpc::ChannelArguments args;
    args.SetSslTargetNameOverride("arfuse-test");
    return grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port), grpc::SslCredentials(tls),
                                     args);
  }

  std::string dir_;
};

TEST_F(MutualTls, ClientWithCertificateIsServedOthersAreNot) {
  Daemon d({"--listen=127.0.0.1:0", "--tls-cert=" + dir_ + "/server.pem",
            "--tls-key=" + dir_ + "/server.key", "--tls-client-ca=" + dir_ + "/ca.pem"});
  ASSERT_TRUE(d.ready) << d.proc->Stderr();
  std::smatch m;
  std::string log = d.proc->Stderr();
  ASSERT_TRUE(std::regex_search(log, m, std::regex("event=listening_tls \\S+ port=(\\d+)"))) << log;
  int port = std::stoi(m[1]);
  EXPECT_TRUE(HealthCheck(Channel(port, /*with_client_cert=*/true)).ok());
  EXPECT_FALSE(HealthCheck(Channel(port, /*with_client_cert=*/false)).ok());
  EXPECT_FALSE(HealthCheck("127.0.0.1:" + std::to_string(port)).ok());
}

TEST_F(MutualTls, UnreadableKeyExits2) {
  EXPECT_TRUE(
      ExitsWith2({ArfusedPath(), "--device=host", "--socket=" + dir_ + "/a.sock",
                  "--listen=127.0.0.1:0", "--tls-cert=" + dir_ + "/server.pem",
                  "--tls-key=" + dir_ + "/missing.key", "--tls-client-ca=" + dir_ + "/ca.pem"},
                 "--tls-key: cannot read"));
}

}  // namespace
}  // namespace arfuse
