// The main socket's credential check (SO_PEERCRED), the main API over TCP with mutual TLS, and
// the holes docs/security.md closes: memory opened with the daemon's rights, a shrunk object
// killing the daemon, descriptor exhaustion, the peer protocol on the client socket, oversized
// metadata.
#include <fcntl.h>
#include <grp.h>
#include <grpcpp/grpcpp.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "arfuse/v1/fusion.grpc.pb.h"
#include "arfuse/v1/peer.grpc.pb.h"
#include "client/cpp/client.h"
#include "common/fd/fd_channel_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/instream/attach_abi.h"
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
using ::arfuse::testing::Subprocess;
using ::testing::HasSubstr;
using ::testing::Not;
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
    std::string ctl = BinaryPath("tools/arfusectl/arfusectl");
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

// Across nodes the peer channel runs over TCP with mutual TLS only (docs/peers.md).
TEST(DaemonSecurity, PeersAcrossNodesWithoutTlsAreRefused) {
  EXPECT_TRUE(ExitsWith2(
      {ArfusedPath(), "--device=host", "--world-size=2", "--nnodes=2", "--peer-addr=127.0.0.1:1"},
      "runs over TCP with mutual TLS only"));
  // Some of the peer flags but not all.
  EXPECT_TRUE(ExitsWith2({ArfusedPath(), "--device=host", "--peer-tls-cert=/x.pem"},
                         "needs all of --peer-tls-cert, --peer-tls-key and --peer-tls-ca"));
  // Files that do not load stop the sidecar at start, named.
  EXPECT_TRUE(
      ExitsWith2({ArfusedPath(), "--device=host", "--world-size=2", "--nnodes=2",
                  "--peer-addr=127.0.0.1:1", "--peer-tls-cert=/nonexistent/peer.pem",
                  "--peer-tls-key=/nonexistent/peer.key", "--peer-tls-ca=/nonexistent/ca.pem"},
                 "cannot read the peer TLS certificate /nonexistent/peer.pem"));
  // --listen's files stand in only when all three are there.
  EXPECT_TRUE(ExitsWith2({ArfusedPath(), "--device=host", "--world-size=2", "--nnodes=2",
                          "--peer-addr=127.0.0.1:1", "--tls-cert=/x.pem", "--tls-key=/x.key"},
                         "runs over TCP with mutual TLS only"));
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
        "-out client.pem 2>/dev/null"
        "; openssl req -newkey rsa:2048 -nodes -subj /CN=arfuse-other -keyout other.key "
        "-out other.csr 2>/dev/null"
        "; openssl x509 -req -in other.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 "
        "-out other.pem 2>/dev/null";
    auto [code, out] = RunToCompletion({"/bin/sh", "-c", script});
    ASSERT_EQ(code, 0) << out;
  }

  // `cert` names the client certificate ("client" or "other", both signed by the CA; empty:
  // none).
  std::shared_ptr<grpc::Channel> Channel(int port, bool with_client_cert,
                                         const std::string& cert = "client") {
    grpc::SslCredentialsOptions tls;
    tls.pem_root_certs = ReadFile(dir_ + "/ca.pem");
    if (with_client_cert) {
      tls.pem_private_key = ReadFile(dir_ + "/" + cert + ".key");
      tls.pem_cert_chain = ReadFile(dir_ + "/" + cert + ".pem");
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

// A session opened over TCP belongs to the identity of its client certificate: another
// certificate the same CA signed, or a caller on the Unix socket, holding the token is refused
// exactly as for a token nobody holds.
TEST_F(MutualTls, ASessionBelongsToTheCertificateThatOpenedIt) {
  Daemon d({"--listen=127.0.0.1:0", "--tls-cert=" + dir_ + "/server.pem",
            "--tls-key=" + dir_ + "/server.key", "--tls-client-ca=" + dir_ + "/ca.pem"});
  ASSERT_TRUE(d.ready) << d.proc->Stderr();
  const std::string socket = d.socket;
  std::smatch m;
  std::string log = d.proc->Stderr();
  ASSERT_TRUE(std::regex_search(log, m, std::regex("event=listening_tls \\S+ port=(\\d+)"))) << log;
  const int port = std::stoi(m[1]);

  auto owner = v1::Fusion::NewStub(Channel(port, true, "client"));
  grpc::ClientContext session_ctx;
  session_ctx.set_deadline(std::chrono::system_clock::now() + 60s);
  auto stream = owner->Session(&session_ctx);
  v1::SessionRequest hello;
  hello.set_client_name("tls-owner");
  ASSERT_TRUE(stream->Write(hello));
  v1::SessionResponse opened;
  ASSERT_TRUE(stream->Read(&opened));
  const std::string token = opened.session_token();
  ASSERT_EQ(token.size(), 32u);

  auto list = [&](v1::Fusion::Stub& stub, const std::string& t) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 10s);
    ctx.AddMetadata("arfuse-session", t);
    v1::ListRegionsResponse resp;
    return stub.ListRegions(&ctx, v1::ListRegionsRequest(), &resp);
  };
  EXPECT_TRUE(list(*owner, token).ok());
  auto other = v1::Fusion::NewStub(Channel(port, true, "other"));
  auto local = v1::Fusion::NewStub(
      grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
  const grpc::Status guessed = list(*other, std::string(32, '7'));
  EXPECT_EQ(guessed.error_code(), grpc::StatusCode::PERMISSION_DENIED) << guessed.error_message();
  for (v1::Fusion::Stub* stub : {other.get(), local.get()}) {
    const grpc::Status s = list(*stub, token);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_EQ(s.error_message(), guessed.error_message());
    EXPECT_THAT(s.error_message(), Not(HasSubstr(token)));
  }
  // The owner's session is untouched.
  EXPECT_TRUE(list(*owner, token).ok());
  session_ctx.TryCancel();
}

TEST_F(MutualTls, UnreadableKeyExits2) {
  EXPECT_TRUE(
      ExitsWith2({ArfusedPath(), "--device=host", "--socket=" + dir_ + "/a.sock",
                  "--listen=127.0.0.1:0", "--tls-cert=" + dir_ + "/server.pem",
                  "--tls-key=" + dir_ + "/missing.key", "--tls-client-ca=" + dir_ + "/ca.pem"},
                 "--tls-key: cannot read"));
}

// ------------------------------------------------ what the daemon opens on a client's behalf

// Runs security_client as uid/gid 65534 with `args`; returns its "code=N message=..." line.
std::string ClientAsNobody(const std::vector<std::string>& args) {
  int out[2];
  if (::pipe(out) != 0) return "pipe failed";
  pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(out[1], 1);
    ::close(out[0]);
    if (::setgroups(0, nullptr) != 0 || ::setgid(kNobody) != 0 || ::setuid(kNobody) != 0) {
      ::_exit(100);
    }
    std::string bin = BinaryPath("tests/daemon/security_client");
    std::vector<char*> argv = {bin.data()};
    std::vector<std::string> copy = args;
    for (auto& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(bin.c_str(), argv.data());
    ::_exit(101);
  }
  ::close(out[1]);
  std::string text;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(out[0], buf, sizeof(buf))) > 0) text.append(buf, n);
  ::close(out[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::StrCat("security_client failed: status ", status, " output ", text);
  }
  return text;
}

// Both sockets of `d` reachable by anyone: only the credential checks stand in the way.
void OpenTheDoors(const Daemon& d) {
  ASSERT_EQ(::chmod(d.dir.c_str(), 0755), 0);
  ASSERT_EQ(::chmod(d.socket.c_str(), 0666), 0);
  ASSERT_EQ(::chmod(FdChannelPath(d.socket).c_str(), 0666), 0);
}

// A shm object owned by this process's user (root in these tests), mode `mode`.
class NamedObject {
 public:
  NamedObject(uint64_t size, mode_t mode)
      : name_(absl::StrCat("/arfuse-sectest-", ::getpid(), "-", ++seq_)), size_(size) {
    fd_ = ::shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, mode);
    EXPECT_GE(fd_, 0);
    EXPECT_EQ(::fchmod(fd_, mode), 0);  // whatever the umask
    EXPECT_EQ(::ftruncate(fd_, static_cast<off_t>(size)), 0);
    data_ = static_cast<char*>(::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0));
  }
  ~NamedObject() {
    ::munmap(data_, size_);
    ::close(fd_);
    ::shm_unlink(name_.c_str());
  }
  const std::string& name() const { return name_; }
  int fd() const { return fd_; }
  char* data() const { return data_; }

 private:
  static inline int seq_ = 0;
  std::string name_;
  uint64_t size_;
  int fd_ = -1;
  char* data_ = nullptr;
};

// Item 1: a second user admitted by --allowed-uids registered another user's shm object (root's,
// mode 0600) by name; the daemon opened it with its own rights. Now it opens memory by name only
// for a caller the mode bits let open it, and memory by descriptor proves itself.
TEST(DaemonSecurity, NamedMemoryIsOpenedOnlyForACallerWhoCouldOpenItItself) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to act as another user";
  Daemon d({"--allowed-uids=65534"});
  ASSERT_TRUE(d.ready) << d.proc->Stderr();
  OpenTheDoors(d);
  NamedObject victim(4096, 0600);
  std::memcpy(victim.data(), "SECRET", 6);
  const std::string denied = ClientAsNobody({"named", d.socket, victim.name(), "4096"});
  EXPECT_THAT(denied, HasSubstr("code=7 "));  // PERMISSION_DENIED
  EXPECT_THAT(denied, HasSubstr("may not open it read-write itself"));
  EXPECT_THAT(denied, Not(HasSubstr(victim.name())));
  EXPECT_EQ(std::memcmp(victim.data(), "SECRET", 6), 0);
  // The rule is the kernel's: once the mode lets others read and write, the caller may.
  ASSERT_EQ(::fchmod(victim.fd(), 0666), 0);
  EXPECT_THAT(ClientAsNobody({"named", d.socket, victim.name(), "4096"}), HasSubstr("code=0 "));
  // The preferred way needs no check at all: the caller's own sealed memfd.
  EXPECT_THAT(ClientAsNobody({"memfd", d.socket, "4096"}), HasSubstr("code=0 "));
}

// A deposited descriptor is claimed only by the user who deposited it.
TEST(DaemonSecurity, AnFdTicketIsClaimedOnlyByItsDepositor) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to act as another user";
  Daemon d({"--allowed-uids=65534"});
  ASSERT_TRUE(d.ready) << d.proc->Stderr();
  OpenTheDoors(d);
  auto buf = client::HostShmBuffer::Create(4096, "root");
  ASSERT_TRUE(buf.ok()) << buf.status();
  absl::StatusOr<std::string> ticket = DepositFds(FdChannelPath(d.socket), {buf->fd()});
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  const std::string stolen = ClientAsNobody({"claim", d.socket, *ticket, "4096"});
  // Refused as a ticket nobody holds: the answer says nothing about another user's tickets.
  EXPECT_THAT(stolen, HasSubstr("code=7 "));
  EXPECT_THAT(stolen, HasSubstr("fd ticket unknown, expired or not the caller's"));
  EXPECT_THAT(stolen, Not(HasSubstr(*ticket)));
  EXPECT_EQ(stolen, ClientAsNobody({"claim", d.socket, std::string(32, 'a'), "4096"}));
  client::ClientOptions o;
  o.target = d.socket;
  auto c = client::Client::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status();
  v1::RegisterRegionRequest req;
  req.set_name("mine");
  req.set_byte_size(4096);
  req.mutable_host_fd()->set_fd_ticket(*ticket);
  v1::RegisterRegionResponse resp;
  grpc::ClientContext ctx;
  (*c)->PrepareContext(&ctx, absl::Seconds(10));
  EXPECT_TRUE((*c)->stub().RegisterRegion(&ctx, req, &resp).ok());
}

// An fp32 allreduce of 4 x 64 over `region` (input at 0, output at 1024).
client::OpDesc SumOp(const client::Region& region) {
  client::OpDesc op;
  op.pattern = Pattern::kAllReduce;
  op.dtype = DType::kFP32;
  op.hidden = 64;
  op.max_tokens = 4;
  op.input = client::TensorLoc{region, 0};
  op.output = client::TensorLoc{region, 1024};
  return op;
}

std::unique_ptr<client::Client> ConnectOrFail(const std::string& socket) {
  client::ClientOptions o;
  o.target = socket;
  auto c = client::Client::Connect(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

// Item 2: register, plan, shrink the object with ftruncate(fd, 0), Execute: the daemon died of
// SIGBUS. Now the op gets a clear error and the daemon serves the next client.
TEST(DaemonSecurity, AShrunkSharedMemoryObjectFailsTheOpAndTheDaemonServesOthers) {
  Daemon d({"--dtype=fp32", "--hidden=64", "--max-tokens=4"});
  ASSERT_TRUE(d.ready) << d.proc->Stderr();
  std::unique_ptr<client::Client> a = ConnectOrFail(d.socket);
  ASSERT_NE(a, nullptr);
  auto named = client::HostShmBuffer::CreateNamed(4096, "shrink");
  ASSERT_TRUE(named.ok());
  auto region = a->RegisterHostBuffer("r", *named);
  ASSERT_TRUE(region.ok()) << region.status();
  auto plan = a->CreatePlan(SumOp(*region));
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(a->Execute(*plan, 4).ok());
  int fd = ::shm_open(named->shm_name().c_str(), O_RDWR | O_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 0), 0);
  ::close(fd);
  auto shrunk = a->Execute(*plan, 4);
  EXPECT_EQ(shrunk.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(shrunk.status().message(), HasSubstr("shrank to 0 bytes"));
  EXPECT_THAT(shrunk.status().message(), Not(HasSubstr(named->shm_name())));
  // Alive, serving, and a second client's op runs and is right.
  EXPECT_TRUE(HealthCheck("unix:" + d.socket).ok());
  std::unique_ptr<client::Client> b = ConnectOrFail(d.socket);
  ASSERT_NE(b, nullptr);
  auto sealed = client::HostShmBuffer::Create(4096, "sealed");
  ASSERT_TRUE(sealed.ok());
  float* in = static_cast<float*>(sealed->data());
  for (int i = 0; i < 256; ++i) in[i] = static_cast<float>(i);
  auto region_b = b->RegisterHostBuffer("r", *sealed);
  ASSERT_TRUE(region_b.ok()) << region_b.status();
  auto plan_b = b->CreatePlan(SumOp(*region_b));
  ASSERT_TRUE(plan_b.ok()) << plan_b.status();
  auto ran = b->Execute(*plan_b, 4);
  ASSERT_TRUE(ran.ok()) << ran.status();
  EXPECT_EQ(in[256 + 255], 255.0f);
  EXPECT_EQ(d.proc->Wait(0ms), std::nullopt) << "arfused exited";
}

TEST(DaemonSecurity, AMemfdThatIsNotSealedAgainstShrinkingIsRefused) {
  Daemon d;
  ASSERT_TRUE(d.ready) << d.proc->Stderr();
  std::unique_ptr<client::Client> c = ConnectOrFail(d.socket);
  ASSERT_NE(c, nullptr);
  int fd = ::memfd_create("unsealed", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 4096), 0);
  auto r = c->RegisterHostFd("r", fd, 4096);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("F_SEAL_SHRINK"));
  ASSERT_EQ(::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
  EXPECT_TRUE(c->RegisterHostFd("r", fd, 4096).ok());
  ::close(fd);
}

// Item 4: a client of rank 0's socket called Peer.Leave with an epoch an error message had told
// it, and the group re-formed. The client socket serves no Peer RPC now, and the group stays.
TEST(DaemonSecurity, TheClientSocketServesNoPeerRpc) {
  const std::string peers = MakeTempDir();
  Daemon r0({"--world-size=2", "--rank=0", "--peer-dir=" + peers});
  Daemon r1({"--world-size=2", "--rank=1", "--peer-dir=" + peers});
  ASSERT_TRUE(r0.ready && r1.ready) << r0.proc->Stderr() << r1.proc->Stderr();
  auto serving = [&](const Daemon& d) {
    grpc::health::v1::HealthCheckResponse resp;
    return HealthCheck("unix:" + d.socket, "arfuse.v1.Fusion", &resp).ok() &&
           resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
  };
  for (absl::Time until = absl::Now() + absl::Seconds(30);
       absl::Now() < until && !(serving(r0) && serving(r1));) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_TRUE(serving(r0) && serving(r1)) << r0.proc->Stderr();
  auto stub = v1::Peer::NewStub(
      grpc::CreateChannel("unix:" + r0.socket, grpc::InsecureChannelCredentials()));
  auto ctx = [] {
    auto c = std::make_unique<grpc::ClientContext>();
    c->set_deadline(std::chrono::system_clock::now() + 10s);
    return c;
  };
  v1::JoinResponse join;
  EXPECT_EQ(stub->Join(ctx().get(), v1::JoinRequest(), &join).error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
  v1::CollectiveResponse coll;
  EXPECT_EQ(stub->Collective(ctx().get(), v1::CollectiveRequest(), &coll).error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
  for (uint64_t epoch : {uint64_t{0}, uint64_t{1}, uint64_t{2}}) {
    v1::LeaveRequest leave;
    leave.set_epoch(epoch);
    leave.set_rank(1);
    v1::LeaveResponse left;
    EXPECT_EQ(stub->Leave(ctx().get(), leave, &left).error_code(), grpc::StatusCode::UNIMPLEMENTED);
  }
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_TRUE(serving(r0) && serving(r1));
  EXPECT_THAT(r0.proc->Stderr(), Not(HasSubstr("event=peer_lost")));
  // No log line names an epoch.
  EXPECT_THAT(r0.proc->Stderr() + r1.proc->Stderr(), Not(HasSubstr("epoch")));
  std::filesystem::remove_all(peers);
}

// Item 5: a 12-32 KiB metadata value got RESOURCE_EXHAUSTED and the connection closed, taking
// the caller's session with it. The main server takes 64 KiB of metadata a call now; past that
// gRPC 1.51 still closes the connection (docs/security.md says so).
TEST(DaemonSecurity, MetadataUpTo32KiBLeavesTheSessionAlone) {
  Daemon d;
  ASSERT_TRUE(d.ready) << d.proc->Stderr();
  std::unique_ptr<client::Client> c = ConnectOrFail(d.socket);
  ASSERT_NE(c, nullptr);
  auto buf = client::HostShmBuffer::Create(4096, "md");
  ASSERT_TRUE(c->RegisterHostBuffer("r", *buf).ok());
  auto call_with = [&](size_t bytes) {
    grpc::ClientContext ctx;
    c->PrepareContext(&ctx, absl::Seconds(10));
    ctx.AddMetadata("x-big", std::string(bytes, 'a'));
    v1::ListRegionsResponse resp;
    return c->stub().ListRegions(&ctx, v1::ListRegionsRequest(), &resp);
  };
  for (size_t kib : {12, 16, 32}) {
    grpc::Status s = call_with(kib << 10);
    EXPECT_TRUE(s.ok()) << kib << " KiB: " << s.error_message();
  }
  auto regions = c->ListRegions();
  ASSERT_TRUE(regions.ok()) << regions.status();
  EXPECT_EQ(regions->size(), 1u);  // the session and its region are still there
  grpc::Status over = call_with(80 << 10);
  EXPECT_EQ(over.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(over.error_message(), HasSubstr("metadata"));
}

// CPU seconds the process has used (utime + stime).
double CpuSeconds(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), {});
  std::istringstream rest(stat.substr(stat.rfind(')') + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {
    if (i == 14 || i == 15) ticks += std::stod(field);
  }
  return ticks / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

int CountLines(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

// Item 3: under a low RLIMIT_NOFILE with a few hundred idle connections the accept loop spun at
// 100% of a core, wrote millions of lines and liveness stopped answering. Now: capped connections,
// descriptors in reserve, rate-limited logs; health answers, and the socket serves again once the
// idle connections go.
TEST(DaemonSecurity, IdleConnectionsUnderALowDescriptorLimitLeaveHealthAnswering) {
  const std::string dir = MakeTempDir();
  const std::string socket = dir + "/a.sock";
  Subprocess proc({"/bin/sh", "-c",
                   absl::StrCat("ulimit -n 128 && exec ", ArfusedPath(), " --socket=", socket,
                                " --health-port=0 --device=host --health-host=127.0.0.1")});
  ASSERT_TRUE(proc.WaitForOutput("ready to accept", 30s)) << proc.Stderr();
  std::smatch m;
  const std::string out = proc.Stdout();
  ASSERT_TRUE(std::regex_search(out, m, std::regex("health_port=(\\d+)"))) << out;
  const std::string health = "127.0.0.1:" + std::string(m[1]);

  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, socket.c_str(), sizeof(addr.sun_path) - 1);
  std::vector<int> idle;
  for (int i = 0; i < 300; ++i) {
    int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    ASSERT_GE(fd, 0);
    // A full backlog answers EAGAIN: the daemon drains it (accepting or refusing) shortly.
    int r = -1;
    for (int attempt = 0; attempt < 200; ++attempt) {
      r = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
      if (r == 0 || errno != EAGAIN) break;
      std::this_thread::sleep_for(5ms);
    }
    EXPECT_EQ(r, 0) << "connection " << i << ": " << std::strerror(errno);
    idle.push_back(fd);
  }
  std::this_thread::sleep_for(500ms);
  const double cpu_before = CpuSeconds(proc.pid());
  std::this_thread::sleep_for(2s);
  const double cpu = CpuSeconds(proc.pid()) - cpu_before;
  EXPECT_LT(cpu, 0.5) << "arfused used " << cpu << " s of CPU in 2 s with idle connections";
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status live = HealthCheck(health, "", &resp);
  EXPECT_TRUE(live.ok()) << live.error_message();
  EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  const std::string log = proc.Stderr();
  EXPECT_GT(CountLines(log, "event=connection_refused"), 0) << log;
  EXPECT_LT(CountLines(log, "event=connection_refused"), 20) << log;
  EXPECT_LT(CountLines(log, "\n"), 100) << log;
  EXPECT_EQ(CountLines(log, "accept_failed"), 0) << log;
  // The idle connections go; the socket serves clients again.
  for (int fd : idle) ::close(fd);
  bool served = false;
  for (absl::Time until = absl::Now() + absl::Seconds(20); absl::Now() < until && !served;) {
    served = HealthCheck("unix:" + socket).ok();
    if (!served) absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(served);
  std::filesystem::remove_all(dir);
}

int OpenFdsOf(pid_t pid) {
  int n = 0;
  for ([[maybe_unused]] const auto& e :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd")) {
    ++n;
  }
  return n;
}

v1::AttachRequest HostAttachRequest() {
  v1::AttachRequest req;
  req.set_attach_abi_version(instream::kAttachAbiVersion);
  req.set_launch_abi_version(instream::kLaunchAbiVersion);
  req.set_launch_args_bytes(instream::kLaunchArgsBytes);
  return req;
}

// A host-mode group of two ranks deciding as an H200 group with fusion on (an attach needs a
// workspace to hand out); rank 0 runs under `ulimit -n <nofile>` (0: as this process does).
struct TwoRanks {
  explicit TwoRanks(int nofile, const std::string& extra = "") : dir(MakeTempDir()) {
    ::chmod(dir.c_str(), 0755);
    std::filesystem::create_directories(dir + "/peers");
    for (int r = 0; r < 2; ++r) {
      sockets[r] = absl::StrCat(dir, "/rank", r, ".sock");
      const std::string limit =
          r == 0 && nofile > 0 ? absl::StrCat("ulimit -n ", nofile, " && ") : "";
      procs[r] = std::make_unique<Subprocess>(std::vector<std::string>{
          "/bin/sh", "-c",
          absl::StrCat(limit, "exec ", ArfusedPath(), " --device=host --rank=", r,
                       " --world-size=2 --peer-dir=", dir, "/peers --socket=", sockets[r],
                       " --health-port=0 --health-host=127.0.0.1 --dtype=fp32 --hidden=64",
                       " --max-tokens=4 --peer-timeout=30 --sm=90",
                       " --flashinfer-allreduce-fusion-backend=auto ", extra)});
    }
  }
  ~TwoRanks() { std::filesystem::remove_all(dir); }
  // Both ranks serve and the group is ready (readiness SERVING on both).
  bool Ready() {
    for (int r = 0; r < 2; ++r) {
      if (!procs[r]->WaitForOutput("ready to accept", 30s)) return false;
    }
    for (int r = 0; r < 2; ++r) {
      bool serving = false;
      for (absl::Time until = absl::Now() + absl::Seconds(30); !serving && absl::Now() < until;) {
        grpc::health::v1::HealthCheckResponse resp;
        serving = HealthCheck("unix:" + sockets[r], "arfuse.v1.Fusion", &resp).ok() &&
                  resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
        if (!serving) absl::SleepFor(absl::Milliseconds(50));
      }
      if (!serving) return false;
    }
    return true;
  }
  std::string dir;
  std::string sockets[2];
  std::unique_ptr<Subprocess> procs[2];
};

// Under RLIMIT_NOFILE 1024, one admitted uid's 64 unclaimed DEPOSITs of 16 descriptors and 64
// idle fd-channel connections took the sidecar to 1024 open descriptors: health timed out, new
// sessions failed, another user's Attach got RESOURCE_EXHAUSTED; and those idle connections locked
// the uid out of the main socket. Now descriptors are budgeted (32 per uid, 128 in all at 1024,
// inside the reserve the connection caps leave) and the fd channel has its own per-uid cap: the
// flood stays inside its budget, and everything else is served.
TEST(DaemonSecurity, OneUsersDescriptorFloodStaysInsideItsBudget) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to act as another user";
  TwoRanks g(1024, "--allowed-uids=65534");
  ASSERT_TRUE(g.Ready()) << g.procs[0]->Stderr() << g.procs[1]->Stderr();
  Subprocess& proc = *g.procs[0];
  const std::string& socket = g.sockets[0];
  std::smatch m;
  const std::string out = proc.Stdout();
  ASSERT_TRUE(std::regex_search(out, m, std::regex("health_port=(\\d+)"))) << out;
  const std::string health = "127.0.0.1:" + std::string(m[1]);
  EXPECT_THAT(proc.Stderr(), HasSubstr("max_pending_fds=128 max_pending_fds_per_uid=32"));
  ASSERT_EQ(::chmod(socket.c_str(), 0666), 0);
  ASSERT_EQ(::chmod(FdChannelPath(socket).c_str(), 0666), 0);
  const int baseline = OpenFdsOf(proc.pid());

  const std::string flood = ClientAsNobody({"flood", socket, "64", "16", "64"});
  EXPECT_THAT(flood, HasSubstr("deposits_ok=2 refused=62 "));
  EXPECT_THAT(flood, HasSubstr("idle_open=16 "));  // --max-fd-connections-per-uid
  EXPECT_THAT(flood, HasSubstr("main=0 "));        // not locked out of the main socket
  EXPECT_THAT(flood, HasSubstr("code=8 "));        // RESOURCE_EXHAUSTED
  EXPECT_THAT(flood, HasSubstr("budget of 32 (--max-pending-fds-per-uid)"));
  // Its two tickets stay pending (30 s): 32 descriptors, far from the limit. The 16 idle
  // fd-channel connections and the main-socket one of its Connect close when the client exits,
  // but the sidecar sees those hang-ups asynchronously: under load they can all still be open
  // here, so they are bounded now and waited for after.
  EXPECT_LE(OpenFdsOf(proc.pid()), baseline + 32 + 16 + 1) << "baseline " << baseline;
  int settled = OpenFdsOf(proc.pid());
  for (absl::Time until = absl::Now() + absl::Seconds(10);
       settled >= baseline + 32 + 4 && absl::Now() < until; settled = OpenFdsOf(proc.pid())) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_LT(settled, baseline + 32 + 4) << "baseline " << baseline;

  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status live = HealthCheck(health, "", &resp);
  EXPECT_TRUE(live.ok()) << live.error_message();
  EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  // Another user: sessions, regions and a paired op on both ranks, a DEPOSIT of its own.
  std::unique_ptr<client::Client> a[2] = {ConnectOrFail(g.sockets[0]), ConnectOrFail(g.sockets[1])};
  ASSERT_NE(a[0], nullptr);
  ASSERT_NE(a[1], nullptr);
  absl::StatusOr<client::HostShmBuffer> bufs[2] = {client::HostShmBuffer::Create(4096, "r0"),
                                                   client::HostShmBuffer::Create(4096, "r1")};
  std::optional<client::Plan> plans[2];
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(bufs[r].ok());
    float* in = static_cast<float*>(bufs[r]->data());
    for (int i = 0; i < 256; ++i) in[i] = static_cast<float>(i);
    auto region = a[r]->RegisterHostBuffer("r", *bufs[r]);
    ASSERT_TRUE(region.ok()) << region.status();
    auto plan = a[r]->CreatePlan(SumOp(*region));
    ASSERT_TRUE(plan.ok()) << plan.status();
    plans[r] = *plan;
  }
  absl::Status ran[2];
  std::thread peer([&] { ran[1] = a[1]->Execute(*plans[1], 4).status(); });
  ran[0] = a[0]->Execute(*plans[0], 4).status();
  peer.join();
  EXPECT_TRUE(ran[0].ok()) << ran[0];
  EXPECT_TRUE(ran[1].ok()) << ran[1];
  EXPECT_EQ(static_cast<float*>(bufs[0]->data())[256 + 255], 510.0f);
  std::vector<int> sixteen(16, bufs[0]->fd());
  absl::StatusOr<std::string> own = DepositFds(FdChannelPath(socket), sixteen);
  EXPECT_TRUE(own.ok()) << own.status();
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(a[r]->DestroyPlan(*plans[r]).ok());
  // ... and its Attach: offered, picked up, detached.
  absl::StatusOr<v1::AttachResponse> att = a[0]->Attach(HostAttachRequest());
  ASSERT_TRUE(att.ok()) << att.status();
  ASSERT_GT(att->fd_count(), 0u);
  absl::StatusOr<std::vector<UniqueFd>> picked = PickupFds(att->fd_socket(), att->fd_ticket());
  ASSERT_TRUE(picked.ok()) << picked.status();
  EXPECT_EQ(picked->size(), att->fd_count());
  EXPECT_TRUE(a[0]->Detach(att->attach_id()).ok());
  // The flooding uid is still held to its budget.
  EXPECT_THAT(ClientAsNobody({"flood", socket, "1", "1", "0"}), HasSubstr("deposits_ok=0 "));
  EXPECT_EQ(proc.Wait(0ms), std::nullopt) << "arfused exited";
}

// A ticket an Attach offered dies with that attachment's Detach, and with the session's end:
// picking it up afterwards finds nothing (its descriptors are closed in the sidecar).
TEST(DaemonSecurity, AnAttachsTicketDiesWithItsDetachAndItsSession) {
  TwoRanks g(0);
  ASSERT_TRUE(g.Ready()) << g.procs[0]->Stderr() << g.procs[1]->Stderr();
  std::unique_ptr<client::Client> a = ConnectOrFail(g.sockets[0]);
  ASSERT_NE(a, nullptr);
  absl::StatusOr<v1::AttachResponse> att = a->Attach(HostAttachRequest());
  ASSERT_TRUE(att.ok()) << att.status();
  ASSERT_GT(att->fd_count(), 0u);
  ASSERT_TRUE(a->Detach(att->attach_id()).ok());
  absl::StatusOr<std::vector<UniqueFd>> after = PickupFds(att->fd_socket(), att->fd_ticket());
  EXPECT_EQ(after.status().code(), absl::StatusCode::kPermissionDenied) << after.status();

  absl::StatusOr<v1::AttachResponse> again = a->Attach(HostAttachRequest());
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_GT(again->fd_count(), 0u);
  a.reset();  // the session ends
  // Its tickets are revoked right after the registry closes it (which it logs).
  ASSERT_TRUE(g.procs[0]->WaitForOutput("event=session_close", 10s)) << g.procs[0]->Stderr();
  absl::SleepFor(absl::Milliseconds(100));
  const absl::StatusCode code = PickupFds(again->fd_socket(), again->fd_ticket()).status().code();
  EXPECT_EQ(code, absl::StatusCode::kPermissionDenied);
}

// A plaintext grpc.health.v1 Check on a fresh channel, with a short deadline.
bool AnswersNow(const std::shared_ptr<grpc::Channel>& channel, absl::Duration timeout) {
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  grpc::health::v1::HealthCheckResponse resp;
  return stub->Check(&ctx, {}, &resp).ok();
}

// The health port and --listen (mutual TLS) after the process ran out of descriptors: with
// gRPC's own listeners, both stopped accepting for good at the first accept that failed with
// EMFILE. The sidecar's RLIMIT_NOFILE is lowered to what it holds (prlimit), both ports are
// probed meanwhile, and the limit is raised again: each answers within a second.
TEST_F(MutualTls, HealthAndTlsAnswerWithinASecondOfDescriptorsComingBack) {
  Daemon d({"--listen=127.0.0.1:0", "--tls-cert=" + dir_ + "/server.pem",
            "--tls-key=" + dir_ + "/server.key", "--tls-client-ca=" + dir_ + "/ca.pem",
            "--health-host=127.0.0.1"});
  ASSERT_TRUE(d.ready) << d.proc->Stderr();
  std::smatch m;
  std::string log = d.proc->Stderr();
  ASSERT_TRUE(std::regex_search(log, m, std::regex("event=listening_tls \\S+ port=(\\d+)"))) << log;
  const int tls_port = std::stoi(m[1]);
  auto health = [&] {
    return grpc::CreateChannel(absl::StrCat("127.0.0.1:", d.health_port),
                               grpc::InsecureChannelCredentials());
  };
  ASSERT_TRUE(AnswersNow(health(), absl::Seconds(10)));
  ASSERT_TRUE(AnswersNow(Channel(tls_port, true), absl::Seconds(10)));

  rlimit saved{};
  ASSERT_EQ(::prlimit(d.proc->pid(), RLIMIT_NOFILE, nullptr, &saved), 0);
  rlimit low = saved;
  // Below what it holds: a descriptor it closes meanwhile gives it no room either.
  low.rlim_cur = static_cast<rlim_t>(OpenFdsOf(d.proc->pid()) - 8);
  ASSERT_EQ(::prlimit(d.proc->pid(), RLIMIT_NOFILE, &low, nullptr), 0);
  // Probes while it is out of descriptors: gRPC's accept fails with EMFILE on the TLS port.
  for (int i = 0; i < 3; ++i) {
    AnswersNow(Channel(tls_port, true), absl::Milliseconds(300));
    AnswersNow(health(), absl::Milliseconds(300));
  }
  absl::SleepFor(absl::Milliseconds(500));
  ASSERT_EQ(::prlimit(d.proc->pid(), RLIMIT_NOFILE, &saved, nullptr), 0);
  const absl::Time back = absl::Now();
  absl::Duration health_took = absl::InfiniteDuration(), tls_took = absl::InfiniteDuration();
  while (absl::Now() - back < absl::Seconds(10) &&
         (health_took == absl::InfiniteDuration() || tls_took == absl::InfiniteDuration())) {
    if (health_took == absl::InfiniteDuration() && AnswersNow(health(), absl::Milliseconds(200))) {
      health_took = absl::Now() - back;
    }
    if (tls_took == absl::InfiniteDuration() &&
        AnswersNow(Channel(tls_port, true), absl::Milliseconds(200))) {
      tls_took = absl::Now() - back;
    }
  }
  EXPECT_LT(health_took, absl::Seconds(1)) << "health port";
  EXPECT_LT(tls_took, absl::Seconds(1)) << "--listen";
  log = d.proc->Stderr();
  EXPECT_THAT(log, HasSubstr("event=tcp_listener_rebuilt")) << log;
  EXPECT_EQ(d.proc->Wait(0ms), std::nullopt) << "arfused exited";
}

}  // namespace
}  // namespace arfuse
