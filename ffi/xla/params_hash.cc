// XLA FFI handlers for the params fingerprint of nsp's optax transforms (nsp/optim/fingerprint.py).
//
// The fingerprint tells the storage transform whether the params handed to `update` are the ones its previous
// update led to. It must cost no params-sized memory: in XLA:CPU a hash written in jnp either materialises its
// integer words (XLA:CPU fuses no integer elementwise work into a reduction) or, chunked in a loop, gets whole-leaf
// conversions hoisted out of the loop. Here each leaf is read where it lies, in cache-sized blocks on the kernels'
// thread pool, and nothing is allocated but one uint32 per block.
//
// The hash is the one nsp/optim/fingerprint.py computes in jnp (on a GPU, where XLA fuses it into one reduction),
// bit for bit: per leaf, the wrapping uint32 sum over its words of murmur3's finaliser of `word ^ (position *
// 0x9E3779B9)`, where an element of 1, 2 or 4 bytes is one word (its bits, zero-extended) and one of 8 bytes two
// (low word first), and `position` counts words from the leaf's start.
//
// Targets (every operand a params leaf, flat or not; result uint32[leaves]):
//   nsp_params_hash       attribute `cast` (0: the bits as they are; 1, 2, 3: float leaves rounded to float32,
//                         bfloat16, float16 first, as `x.astype(cast)` rounds: to nearest, ties to even).
//   nsp_next_params_update  operands p_0..p_{L-1}, t_0..t_{L-1}; results the hashes, then u_0..u_{L-1}: the
//                         update the storage transform returns for new params `t` (float32 or p's dtype), in p's
//                         dtype: target = t rounded to p's dtype, u = target - p in float32 rounded to p's dtype;
//                         and the hash of `optax.apply_updates(p, u)` = p + u rounded to p's dtype. p: float32,
//                         bfloat16, float16. Returning u (written over `t` where Python aliases them) orders every
//                         write over the params after this read of them: a caller's step that donates its params
//                         then needs no copy of them.
//   nsp_next_params_update_flat  the same with the new params as one flat vector (a store layout's, leaf l at
//                         attribute offsets[l], in p's dtype) and the updates flat like it.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

#include "util/float_mode.h"
#include "util/thread_pool.h"
#include "xla/ffi_common.h"

namespace nsp {
namespace {

using ffi_common::Invalid;

constexpr char kOp[] = "nsp.params_hash";
constexpr int64_t kBlock = 1 << 16;  // elements per task: a block's words stay in cache

inline uint32_t Mix(uint32_t word, uint32_t position) {
  uint32_t h = word ^ (position * 0x9E3779B9u);
  h = (h ^ (h >> 16)) * 0x85EBCA6Bu;
  h = (h ^ (h >> 13)) * 0xC2B2AE35u;
  return h ^ (h >> 16);
}

// ---- float conversions, rounding to nearest even as XLA's convert does ----------------------------------------

inline uint32_t F32Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

inline float F32FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

inline float Bf16ToF32(uint16_t h) { return F32FromBits(static_cast<uint32_t>(h) << 16); }

inline uint16_t F32ToBf16(float f) {
  const uint32_t b = F32Bits(f);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((b >> 16) | 0x0040u);  // NaN stays NaN
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

inline float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  if (exponent == 0) {  // zero or subnormal: mantissa x 2^-24, exact in float32
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return F32FromBits(sign | 0x7F800000u | (mantissa << 13));
  return F32FromBits(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline uint16_t F32ToF16(float f) {
  const uint32_t b = F32Bits(f);
  const uint16_t sign = static_cast<uint16_t>((b >> 16) & 0x8000u);
  const uint32_t magnitude = b & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return sign | 0x7E00u | static_cast<uint16_t>((magnitude >> 13) & 0x3FFu);
  if (magnitude >= 0x477FF000u) return sign | 0x7C00u;  // from halfway past 65504 on: infinity
  if (magnitude < 0x38800000u) {                        // below 2^-14: a subnormal half (or zero, or 2^-14)
    const float units = F32FromBits(magnitude) * 16777216.0f;  // in units of 2^-24, exact
    return sign | static_cast<uint16_t>(std::nearbyint(units));
  }
  const uint32_t rebased = magnitude - 0x38000000u;  // exponent rebiased from 127 to 15
  return sign | static_cast<uint16_t>((rebased + 0xFFFu + ((rebased >> 13) & 1u)) >> 13);
}

enum class Float { kF32, kBF16, kF16, kOther };

Float FloatOf(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F32: return Float::kF32;
    case ffi::DataType::BF16: return Float::kBF16;
    case ffi::DataType::F16: return Float::kF16;
    default: return Float::kOther;
  }
}

inline float ToF32(const void* data, Float type, int64_t i) {
  switch (type) {
    case Float::kF32: return static_cast<const float*>(data)[i];
    case Float::kBF16: return Bf16ToF32(static_cast<const uint16_t*>(data)[i]);
    default: return F16ToF32(static_cast<const uint16_t*>(data)[i]);
  }
}

// The bits of float32 `f` rounded to `type`, zero-extended.
inline uint32_t BitsAs(float f, Float type) {
  switch (type) {
    case Float::kF32: return F32Bits(f);
    case Float::kBF16: return F32ToBf16(f);
    default: return F32ToF16(f);
  }
}

// Float `f` rounded to `type` and back to float32.
inline float RoundTo(float f, Float type) {
  switch (type) {
    case Float::kF32: return f;
    case Float::kBF16: return Bf16ToF32(F32ToBf16(f));
    default: return F16ToF32(F32ToF16(f));
  }
}

size_t ItemSize(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::PRED: case ffi::DataType::S8: case ffi::DataType::U8: return 1;
    case ffi::DataType::S16: case ffi::DataType::U16: case ffi::DataType::F16: case ffi::DataType::BF16: return 2;
    case ffi::DataType::S32: case ffi::DataType::U32: case ffi::DataType::F32: return 4;
    case ffi::DataType::S64: case ffi::DataType::U64: case ffi::DataType::F64: return 8;
    default: return 0;
  }
}

// Sums word_of(i) mixed with its position over elements [0, n) of a leaf whose elements are `per` words each, in
// blocks on the thread pool. `word_of(i, w)` gives word w of element i.
template <typename WordOf>
uint32_t HashLeaf(int64_t n, int per, const WordOf& word_of) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<uint32_t> sums(static_cast<size_t>(blocks), 0);
  const CallerFloatMode mode;
  ParallelFor(static_cast<int>(blocks), [&](int b) {
    const auto scope = mode.Enter();
    const int64_t begin = static_cast<int64_t>(b) * kBlock, end = std::min(n, begin + kBlock);
    uint32_t sum = 0;
    for (int64_t i = begin; i < end; ++i) {
      for (int w = 0; w < per; ++w) {
        sum += Mix(word_of(i, w), static_cast<uint32_t>(i * per + w));
      }
    }
    sums[static_cast<size_t>(b)] = sum;
  });
  uint32_t total = 0;
  for (uint32_t s : sums) total += s;
  return total;
}

uint32_t HashBits(const void* data, size_t itemsize, int64_t n) {
  switch (itemsize) {
    case 1: {
      const auto* x = static_cast<const uint8_t*>(data);
      return HashLeaf(n, 1, [x](int64_t i, int) { return static_cast<uint32_t>(x[i]); });
    }
    case 2: {
      const auto* x = static_cast<const uint16_t*>(data);
      return HashLeaf(n, 1, [x](int64_t i, int) { return static_cast<uint32_t>(x[i]); });
    }
    case 4: {
      const auto* x = static_cast<const uint32_t*>(data);
      return HashLeaf(n, 1, [x](int64_t i, int) { return x[i]; });
    }
    default: {
      const auto* x = static_cast<const uint32_t*>(data);  // two words an element, low word first
      return HashLeaf(n, 2, [x](int64_t i, int w) { return x[2 * i + w]; });
    }
  }
}

ffi::Error ParamsHashImpl(ffi::RemainingArgs leaves, ffi::Result<ffi::Buffer<ffi::U32>> out, int32_t cast) {
  if (out->element_count() != leaves.size()) {
    return Invalid(kOp, "the result needs one element per leaf: " + std::to_string(leaves.size()));
  }
  if (cast < 0 || cast > 3) return Invalid(kOp, "cast must be 0 (none), 1 (float32), 2 (bfloat16) or 3 (float16)");
  static constexpr Float kCasts[] = {Float::kOther, Float::kF32, Float::kBF16, Float::kF16};
  for (size_t l = 0; l < leaves.size(); ++l) {
    auto leaf = leaves.get<ffi::AnyBuffer>(l);
    if (leaf.has_error()) return leaf.error();
    const int64_t n = static_cast<int64_t>(leaf->element_count());
    const size_t itemsize = ItemSize(leaf->element_type());
    if (itemsize == 0) return Invalid(kOp, "leaf " + std::to_string(l) + " has a dtype the hash does not take");
    const Float type = FloatOf(leaf->element_type());
    uint32_t h;
    if (cast == 0 || type == Float::kOther) {
      // Non-float leaves are hashed as they are whatever the cast (x.astype applies to float leaves only). A
      // float64 leaf with a cast is refused: its rounding is left to XLA (the Python side never asks for it).
      if (cast != 0 && leaf->element_type() == ffi::DataType::F64) {
        return Invalid(kOp, "float64 leaves are not cast here");
      }
      h = HashBits(leaf->untyped_data(), itemsize, n);
    } else {
      const void* data = leaf->untyped_data();
      const Float to = kCasts[cast];
      h = HashLeaf(n, 1, [data, type, to](int64_t i, int) { return BitsAs(ToF32(data, type, i), to); });
    }
    out->typed_data()[l] = h;
  }
  return ffi::Error::Success();
}

// Per leaf: the update for new params `t` (written to `u`, which may be `t` itself: element i of `t` is read
// before element i of `u` is written) and the hash of the params it leads to. `u` has p's dtype.
uint32_t NextParamsLeaf(const void* pd, Float ptype, const void* td, Float ttype, void* ud, int64_t n) {
  return HashLeaf(n, 1, [=](int64_t i, int) {
    const float param = ToF32(pd, ptype, i);
    const float target = RoundTo(ToF32(td, ttype, i), ptype);
    const float update = RoundTo(target - param, ptype);  // float32 difference, then the params' dtype
    if (ptype == Float::kF32) {
      static_cast<float*>(ud)[i] = update;
    } else {
      static_cast<uint16_t*>(ud)[i] = static_cast<uint16_t>(BitsAs(update, ptype));
    }
    return BitsAs(param + update, ptype);  // optax.apply_updates: p + u, back in p's dtype
  });
}

ffi::Error CheckLeafTypes(size_t l, Float ptype, Float ttype, ffi::DataType p, ffi::DataType u) {
  if (ptype == Float::kOther || (ttype != Float::kF32 && ttype != ptype) || u != p) {
    return Invalid(kOp, "leaf " + std::to_string(l) + ": params (and their update) must be float32, bfloat16 or "
                        "float16, the new params float32 or the params' dtype");
  }
  return ffi::Error::Success();
}

ffi::ErrorOr<uint32_t*> HashesResult(ffi::RemainingRets& rets, size_t leaves) {
  auto hashes = rets.get<ffi::AnyBuffer>(0);
  if (hashes.has_error()) return ffi::Unexpected(hashes.error());
  if ((*hashes)->element_type() != ffi::DataType::U32 || (*hashes)->element_count() != leaves) {
    return ffi::Unexpected(Invalid(kOp, "the hashes result must be uint32 with one element per leaf"));
  }
  return static_cast<uint32_t*>((*hashes)->untyped_data());
}

// Operands p_0..p_{L-1}, t_0..t_{L-1}; results the hashes, u_0..u_{L-1}.
ffi::Error NextParamsUpdateImpl(ffi::RemainingArgs args, ffi::RemainingRets rets) {
  const size_t leaves = args.size() / 2;
  if (args.size() % 2 || rets.size() != leaves + 1) {
    return Invalid(kOp, "needs the params leaves, then as many new-params leaves; returns the hashes, then one "
                        "update per leaf");
  }
  auto hash_out = HashesResult(rets, leaves);
  if (hash_out.has_error()) return hash_out.error();
  for (size_t l = 0; l < leaves; ++l) {
    auto p = args.get<ffi::AnyBuffer>(l);
    auto t = args.get<ffi::AnyBuffer>(leaves + l);
    auto u = rets.get<ffi::AnyBuffer>(1 + l);
    if (p.has_error()) return p.error();
    if (t.has_error()) return t.error();
    if (u.has_error()) return u.error();
    const Float ptype = FloatOf(p->element_type()), ttype = FloatOf(t->element_type());
    if (ffi::Error e = CheckLeafTypes(l, ptype, ttype, p->element_type(), (*u)->element_type()); e.failure()) {
      return e;
    }
    if (p->element_count() != t->element_count() || p->element_count() != (*u)->element_count()) {
      return Invalid(kOp, "leaf " + std::to_string(l) + ": params, new params and update differ in size");
    }
    (*hash_out)[l] = NextParamsLeaf(p->untyped_data(), ptype, t->untyped_data(), ttype, (*u)->untyped_data(),
                                    static_cast<int64_t>(p->element_count()));
  }
  return ffi::Error::Success();
}

// The new params as one flat vector (a store layout's: leaf l at offsets[l]): operands p_0..p_{L-1}, t; results
// the hashes and u, flat like t (and in p's dtype, which t shares).
ffi::Error NextParamsUpdateFlatImpl(ffi::RemainingArgs args, ffi::RemainingRets rets,
                                    ffi::Span<const int64_t> offsets) {
  const size_t leaves = offsets.size();
  if (args.size() != leaves + 1 || rets.size() != 2) {
    return Invalid(kOp, "needs the params leaves (one per offset) and the flat new params; returns the hashes and "
                        "the flat updates");
  }
  auto hash_out = HashesResult(rets, leaves);
  if (hash_out.has_error()) return hash_out.error();
  auto t = args.get<ffi::AnyBuffer>(leaves);
  auto u = rets.get<ffi::AnyBuffer>(1);
  if (t.has_error()) return t.error();
  if (u.has_error()) return u.error();
  const Float ttype = FloatOf(t->element_type());
  if ((*u)->element_type() != t->element_type() || (*u)->element_count() != t->element_count()) {
    return Invalid(kOp, "the flat updates must have the flat new params' dtype and size");
  }
  const int64_t total = static_cast<int64_t>(t->element_count());
  for (size_t l = 0; l < leaves; ++l) {
    auto p = args.get<ffi::AnyBuffer>(l);
    if (p.has_error()) return p.error();
    const Float ptype = FloatOf(p->element_type());
    if (ffi::Error e = CheckLeafTypes(l, ptype, ttype, p->element_type(), (*u)->element_type()); e.failure()) {
      return e;
    }
    const int64_t n = static_cast<int64_t>(p->element_count());
    if (offsets[l] < 0 || offsets[l] + n > total) {
      return Invalid(kOp, "leaf " + std::to_string(l) + " lies outside the flat new params");
    }
    const size_t bytes = ttype == Float::kF32 ? 4 : 2;
    const char* td = static_cast<const char*>(t->untyped_data()) + offsets[l] * bytes;
    char* ud = static_cast<char*>((*u)->untyped_data()) + offsets[l] * bytes;
    (*hash_out)[l] = NextParamsLeaf(p->untyped_data(), ptype, td, ttype, ud, n);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace nsp

XLA_FFI_DEFINE_HANDLER_SYMBOL(NspParamsHash, nsp::ParamsHashImpl,
                              xla::ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Attr<int32_t>("cast"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(NspNextParamsUpdate, nsp::NextParamsUpdateImpl,
                              xla::ffi::Ffi::Bind().RemainingArgs().RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(NspNextParamsUpdateFlat, nsp::NextParamsUpdateFlatImpl,
                              xla::ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attr<xla::ffi::Span<const int64_t>>(
                                  "offsets"));
