#include "tools/arfusectl/args.h"

#include <algorithm>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/status_macros.h"
#include "config/fusion_flags.h"

// Every option of every subcommand, once: a subcommand's FlagSet names the ones it takes, and
// its table in cli.cc holds their help. The values are text; the subcommands parse them.
ABSL_FLAG(std::string, arfusectl_addr, "", "arfused address(es)");
ABSL_FLAG(std::string, arfusectl_timeout_ms, "", "deadline of each call in ms");
ABSL_FLAG(bool, arfusectl_json, false, "print one JSON object");
ABSL_FLAG(std::string, arfusectl_rank, "", "the sidecar of one rank");
ABSL_FLAG(std::string, arfusectl_ranks, "", "the sidecars of these ranks");
ABSL_FLAG(bool, arfusectl_all, false, "every local rank");
ABSL_FLAG(std::string, arfusectl_service, "", "health: the service name");
ABSL_FLAG(std::string, arfusectl_backend, "", "set-backend: the backend");
ABSL_FLAG(std::string, arfusectl_sm, "", "compute capability");
ABSL_FLAG(std::string, arfusectl_nnodes, "", "nodes in the group");
ABSL_FLAG(std::string, arfusectl_tp, "", "tensor-parallel size");
// The fusion flags, from their one declaration (config/fusion_flags.inc): a switch is a
// bool, a value text.
#define ARFUSECTL_FLAG_TYPE_kSwitch bool
#define ARFUSECTL_FLAG_TYPE_kOptional std::string
#define ARFUSECTL_FLAG_TYPE_kValue std::string
#define ARFUSECTL_FLAG_DEFAULT_kSwitch false
#define ARFUSECTL_FLAG_DEFAULT_kOptional ""
#define ARFUSECTL_FLAG_DEFAULT_kValue ""
#define ARFUSE_FUSION_FLAG(kind, ident, field, Type, init, values, check, help) \
  ABSL_FLAG(ARFUSECTL_FLAG_TYPE_##kind, arfusectl_##ident, ARFUSECTL_FLAG_DEFAULT_##kind, help);
#include "config/fusion_flags.inc"
#undef ARFUSE_FUSION_FLAG
ABSL_FLAG(std::string, arfusectl_cuda_graph_mode, "", "CUDA-graph mode, every phase");
ABSL_FLAG(std::string, arfusectl_prefill_cuda_graph_mode, "", "CUDA-graph mode, prefill");
ABSL_FLAG(std::string, arfusectl_decode_cuda_graph_mode, "", "CUDA-graph mode, decode");
ABSL_FLAG(std::string, arfusectl_fused_op_in_graph, "", "the fused op in graphs");
ABSL_FLAG(std::string, arfusectl_mnnvl_capture_safe, "", "mnnvl kernels capture-safe");
ABSL_FLAG(std::string, arfusectl_interval_ms, "", "top: the refresh interval");
ABSL_FLAG(std::string, arfusectl_iterations, "", "top: refreshes before exiting");
ABSL_FLAG(std::string, arfusectl_metrics, "", "top: metrics endpoints");
ABSL_FLAG(bool, arfusectl_plain, false, "top: plain lines, no screen redraw");

namespace arfuse::cli {
namespace {

constexpr char kFlagPrefix[] = "arfusectl_";

std::string Underscored(const std::string& name) { return absl::StrReplaceAll(name, {{"-", "_"}}); }

}  // namespace

bool ParsedArgs::Has(const std::string& name) const {
  return flags::WasGiven(given_, Underscored(name));
}

std::optional<std::string> ParsedArgs::Get(const std::string& name) const {
  if (!Has(name)) return std::nullopt;
  return set_.Find(Underscored(name))->CurrentValue();
}

bool ParsedArgs::Switch(const std::string& name) const { return Get(name) == "true"; }

absl::StatusOr<ParsedArgs> ParseArgs(const std::string& command,
                                     const std::vector<OptionSpec>& specs,
                                     const std::vector<std::string>& args) {
  std::vector<std::string> names;
  flags::Strict strict;
  strict.single = true;
  strict.bool_words = true;
  strict.value_not_flag = true;
  strict.name_program = true;
  for (const OptionSpec& s : specs) {
    names.push_back(Underscored(s.name));
    if (s.last_wins) strict.repeatable.push_back(names.back());
  }
  flags::FlagSet set(absl::StrCat("arfusectl ", command), names, kFlagPrefix, strict);
  std::vector<std::string> argv_text = {command};
  argv_text.insert(argv_text.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : argv_text) argv.push_back(a.data());
  ARFUSE_ASSIGN_OR_RETURN(std::vector<flags::GivenFlag> given,
                          set.Tokenize(static_cast<int>(argv.size()), argv.data()));
  for (const flags::GivenFlag& g : given) {
    auto spec = std::find_if(specs.begin(), specs.end(),
                             [&](const OptionSpec& s) { return Underscored(s.name) == g.name; });
    if (spec->check) ARFUSE_RETURN_IF_ERROR(spec->check(g.value));
    ARFUSE_RETURN_IF_ERROR(set.Set(g.name, g.value, "command line"));
  }
  return ParsedArgs(std::move(set), std::move(given));
}

std::vector<OptionSpec> FusionFlagOptions() {
  std::vector<OptionSpec> options;
  for (const config::FusionFlagSpec& spec : config::FusionFlagTable()) {
    const bool is_switch = spec.kind == config::FusionFlagKind::kSwitch;
    OptionSpec o{spec.name, is_switch ? OptionSpec::Kind::kSwitch : OptionSpec::Kind::kValue,
                 spec.ValueHint(), spec.ShortHelp(), true};
    // Switches are checked by the flag library's strict rules.
    if (!is_switch) {
      o.check = [&spec](const std::string& text) { return spec.Check(text); };
    }
    options.push_back(std::move(o));
  }
  return options;
}

std::vector<OptionSpec> WithFusionFlags(size_t at, std::vector<OptionSpec> options) {
  std::vector<OptionSpec> fusion = FusionFlagOptions();
  options.insert(options.begin() + std::min(at, options.size()), fusion.begin(), fusion.end());
  return options;
}

absl::Status ReadFusionFlags(const ParsedArgs& args, config::FusionFlags& flags) {
  for (const config::FusionFlagSpec& spec : config::FusionFlagTable()) {
    if (std::optional<std::string> text = args.Get(spec.name)) {
      ARFUSE_RETURN_IF_ERROR(spec.Set(flags, *text));
    }
  }
  return absl::OkStatus();
}

std::string OptionsHelp(const std::vector<OptionSpec>& specs) {
  std::string out;
  for (const OptionSpec& s : specs) {
    std::string left = absl::StrCat("  --", s.name);
    if (s.kind == OptionSpec::Kind::kValue) {
      absl::StrAppend(&left, s.value_hint.rfind("true", 0) == 0 ? "=" : " ", s.value_hint);
    }
    if (left.size() < 52)
      left.resize(52, ' ');
    else
      left += "  ";
    absl::StrAppend(&out, left, s.help, "\n");
  }
  return out;
}

}  // namespace arfuse::cli
