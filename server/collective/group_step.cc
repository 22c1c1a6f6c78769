#include "server/collective/group_step.h"

#include "absl/strings/str_cat.h"
#include "server/peers/exchange.h"

namespace arfuse {
namespace {
// Payload framing: one marker byte, then the payload (ok) or code byte + message (error).
constexpr char kOk = 'K';
constexpr char kErr = 'E';
}  // namespace

absl::StatusOr<std::vector<std::string>> AllgatherStep(Exchange& exchange, const std::string& tag,
                                                       const absl::StatusOr<std::string>& local,
                                                       const std::string& what,
                                                       absl::Time deadline) {
  std::string payload;
  if (local.ok()) {
    payload = std::string(1, kOk) + *local;
  } else {
    payload = std::string(1, kErr);
    payload.push_back(static_cast<char>(local.status().code()));
    payload.append(local.status().message().data(), local.status().message().size());
  }
  absl::StatusOr<std::vector<std::string>> all = exchange.Allgather(tag, payload, deadline);
  if (!all.ok()) return all.status();
  if (!local.ok()) return local.status();
  std::vector<std::string> out;
  out.reserve(all->size());
  for (size_t r = 0; r < all->size(); ++r) {
    const std::string& p = (*all)[r];
    if (p.empty() || (p[0] != kOk && p[0] != kErr) || (p[0] == kErr && p.size() < 2)) {
      return absl::InternalError(absl::StrCat(what, ": malformed payload from rank ", r));
    }
    if (p[0] == kErr) {
      auto code = static_cast<absl::StatusCode>(static_cast<unsigned char>(p[1]));
      return absl::Status(code, absl::StrCat(what, ": rank ", r, ": ", p.substr(2)));
    }
    out.push_back(p.substr(1));
  }
  return out;
}

absl::Status StatusStep(Exchange& exchange, const std::string& tag, const absl::Status& local,
                        const std::string& what, absl::Time deadline) {
  absl::StatusOr<std::string> step = std::string();
  if (!local.ok()) step = local;
  return AllgatherStep(exchange, tag, step, what, deadline).status();
}

}  // namespace arfuse
