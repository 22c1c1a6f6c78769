#include "bench/flashinfer/compare.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace arfuse::bench_fi {
namespace {

template <typename T>
cudaError_t CopyOut(std::vector<T>* dst, const void* src, size_t count) {
  dst->resize(count);
  return count == 0 ? cudaSuccess
                    : cudaMemcpy(dst->data(), src, count * sizeof(T), cudaMemcpyDeviceToHost);
}

template <typename T>
uint64_t CountDiff(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return std::max(a.size(), b.size());
  uint64_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += a[i] != b[i];
  return n;
}

// Sign-magnitude codes on one integer line: neighbouring values are one apart, +0 and -0 meet.
int Ordinal8(uint8_t c) { return (c & 0x80) ? -(c & 0x7f) : (c & 0x7f); }
int Ordinal16(uint16_t b) { return (b & 0x8000) ? -(b & 0x7fff) : (b & 0x7fff); }
bool IsE4m3Nan(uint8_t c) { return (c & 0x7f) == 0x7f; }

// Every code's value and the E4M3 spacing at it (2^-9 among subnormals, else 2^(e - 3) in the
// binade [2^e, 2^(e + 1))), as tables: the cross check visits every code. NaN codes never get
// here (CountCode and CountDequantized reject them first).
struct E4m3Table {
  float value[256];
  float spacing[256];
  E4m3Table() {
    for (int c = 0; c < 256; ++c) {
      const int e = (c >> 3) & 0xf, m = c & 7;
      const float mag = e == 0 ? std::ldexp(m / 8.0f, -6) : std::ldexp(1.0f + m / 8.0f, e - 7);
      value[c] = (c & 0x80) ? -mag : mag;
      spacing[c] = e == 0 ? 0x1p-9f : std::ldexp(1.0f, e - 10);
    }
  }
};

const E4m3Table& E4m3() {
  static const E4m3Table table;
  return table;
}

float Ue8m0Scale(uint8_t byte) { return std::ldexp(1.0f, static_cast<int>(byte) - 127); }

float FloatAt(const std::vector<uint8_t>& bytes, uint64_t offset) {
  float f = 0.0f;
  std::memcpy(&f, bytes.data() + offset, sizeof(f));
  return f;
}

void CountCode(CrossCheck* r, uint8_t a, uint8_t f) {
  ++r->codes;
  if (IsE4m3Nan(a) || IsE4m3Nan(f)) {
    ++r->codes_beyond;
    return;
  }
  const int d = std::abs(Ordinal8(a) - Ordinal8(f));
  if (d == 1) ++r->codes_one_step;
  if (d > 1) ++r->codes_beyond;
}

// Codes under different scales: each is the nearest point of its own grid (spacing sp_a, sp_f
// at its value), so two correct codes of nearly the same value are at most the coarser spacing
// apart; the slack of 2^-8 of the value covers FlashInfer quantizing the bf16-rounded value.
void CountDequantized(CrossCheck* r, uint8_t a, float sa, uint8_t f, float sf) {
  ++r->codes;
  ++r->dequantized;
  if (IsE4m3Nan(a) || IsE4m3Nan(f)) {
    ++r->codes_beyond;
    return;
  }
  const E4m3Table& t = E4m3();
  const double da = static_cast<double>(t.value[a]) * sa;
  const double df = static_cast<double>(t.value[f]) * sf;
  if (da == df) return;
  const double sp =
      std::max(static_cast<double>(t.spacing[a]) * sa, static_cast<double>(t.spacing[f]) * sf);
  if (std::fabs(da - df) <= sp + 0x1p-8 * std::max(std::fabs(da), std::fabs(df))) {
    ++r->codes_one_step;
  } else {
    ++r->codes_beyond;
  }
}

void NoteScale(CrossCheck* r, float sa, float sf) {
  if (std::memcmp(&sa, &sf, sizeof(sa)) != 0) ++r->scales_differ;
  if (sf != 0.0f)
    r->scale_max_rel = std::max(r->scale_max_rel, static_cast<double>(std::fabs((sa - sf) / sf)));
}

}  // namespace

cudaError_t TakeSnapshot(Case c, uint32_t tokens, uint32_t hidden, bool flashinfer,
                         const RankTensors (&t)[kWorld], Snapshot* out) {
  *out = Snapshot{};
  const size_t elems = static_cast<size_t>(tokens) * hidden;
  const CaseInfo info = InfoOf(c);
  const size_t scale_bytes = WrittenScaleBytes(c, tokens, hidden, flashinfer);
  Snapshot ranks[kWorld];
  for (int r = 0; r < kWorld; ++r) {
    Snapshot& s = ranks[r];
    if (cudaError_t e = CopyOut(&s.residual, t[r].residual_out, elems); e != cudaSuccess) return e;
    if (info.quant == QuantKind::kNone) {
      if (cudaError_t e = CopyOut(&s.norm, t[r].norm_out, elems); e != cudaSuccess) return e;
    } else {
      if (cudaError_t e = CopyOut(&s.quant, t[r].quant_out, elems); e != cudaSuccess) return e;
      if (cudaError_t e = CopyOut(&s.scale, t[r].scale, scale_bytes); e != cudaSuccess) return e;
    }
  }
  *out = std::move(ranks[0]);
  out->rank_diff = SnapshotDiff(*out, ranks[1]);
  out->valid = true;
  return cudaSuccess;
}

uint64_t SnapshotDiff(const Snapshot& a, const Snapshot& b) {
  return CountDiff(a.residual, b.residual) + CountDiff(a.norm, b.norm) +
         CountDiff(a.quant, b.quant) + CountDiff(a.scale, b.scale);
}

CrossCheck Compare(Case c, uint32_t tokens, uint32_t hidden, const Snapshot& a, const Snapshot& f) {
  CrossCheck r;
  if (!a.valid || !f.valid) return r;
  r.compared = true;
  r.residual_diff = CountDiff(a.residual, f.residual);
  const CaseInfo info = InfoOf(c);
  if (info.quant == QuantKind::kNone) {
    r.norm_diff = CountDiff(a.norm, f.norm);
    for (size_t i = 0; i < a.norm.size() && i < f.norm.size(); ++i) {
      const uint64_t d =
          static_cast<uint64_t>(std::abs(Ordinal16(a.norm[i]) - Ordinal16(f.norm[i])));
      r.norm_max_ulp = std::max(r.norm_max_ulp, d);
    }
    return r;
  }
  const size_t elems = static_cast<size_t>(tokens) * hidden;
  if (a.quant.size() != elems || f.quant.size() != elems) {
    r.codes_beyond = elems;
    return r;
  }
  const uint32_t groups = hidden / fp8::kGroupSize;
  const auto layout_a = static_cast<fp8::GroupScaleLayout>(info.scale_layout);
  constexpr auto kPacked = fp8::GroupScaleLayout::kUe8m0Packed;
  for (uint32_t t = 0; t < tokens; ++t) {
    if (info.quant == QuantKind::kPerToken)
      NoteScale(&r, FloatAt(a.scale, t * 4), FloatAt(f.scale, t * 4));
    for (uint32_t g = 0; g < (info.quant == QuantKind::kPerGroup ? groups : 1u); ++g) {
      const size_t begin = static_cast<size_t>(t) * hidden +
                           (info.quant == QuantKind::kPerGroup ? g * fp8::kGroupSize : 0);
      const size_t end = info.quant == QuantKind::kPerGroup ? begin + fp8::kGroupSize
                                                            : (static_cast<size_t>(t) + 1) * hidden;
      bool same_scale = true;
      float sa = 1.0f, sf = 1.0f;
      if (info.quant == QuantKind::kPerGroup) {
        const uint8_t fb = f.scale[fp8::GroupScaleByteOffset(kPacked, t, g, tokens, groups)];
        sf = Ue8m0Scale(fb);
        const uint64_t at = fp8::GroupScaleByteOffset(layout_a, t, g, tokens, groups);
        if (layout_a == kPacked) {
          sa = Ue8m0Scale(a.scale[at]);
          same_scale = a.scale[at] == fb;
        } else {
          sa = FloatAt(a.scale, at);
          same_scale = false;
        }
        NoteScale(&r, sa, sf);
      }
      for (size_t i = begin; i < end; ++i) {
        if (same_scale) {
          CountCode(&r, a.quant[i], f.quant[i]);
        } else {
          CountDequantized(&r, a.quant[i], sa, f.quant[i], sf);
        }
      }
    }
  }
  return r;
}

void Merge(CrossCheck* into, const CrossCheck& o) {
  if (!o.compared) return;
  if (!into->compared) {
    *into = o;
    return;
  }
  into->residual_diff = std::max(into->residual_diff, o.residual_diff);
  into->norm_diff = std::max(into->norm_diff, o.norm_diff);
  into->norm_max_ulp = std::max(into->norm_max_ulp, o.norm_max_ulp);
  into->codes = std::max(into->codes, o.codes);
  into->codes_one_step = std::max(into->codes_one_step, o.codes_one_step);
  into->codes_beyond = std::max(into->codes_beyond, o.codes_beyond);
  into->dequantized = std::max(into->dequantized, o.dequantized);
  into->scales_differ = std::max(into->scales_differ, o.scales_differ);
  into->scale_max_rel = std::max(into->scale_max_rel, o.scale_max_rel);
}

}  // namespace arfuse::bench_fi
