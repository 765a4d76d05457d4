// C simulation testbench of the updater kernel (nsp_update_page), built with plain g++:
//
//   c++ -O2 -std=c++17 -Wno-unknown-pragmas -ffp-contract=off -I ffi -o csim ffi/backends/hls/csim_main.cc
//       ffi/backends/hls/nsp_updater_hls.cc ffi/backends/hls/nsp_updater_host.cc && ./csim
//
// Every optimizer configuration x gradient format (dense fp32, dense bf16, Top-K fp32 values, Top-K bf16 values) x
// lazy on/off runs on random pages of several sizes (one element, a tail shorter than a chunk, exactly a chunk, a
// chunk and one, several chunks), Top-K runs being random 1% runs, empty runs, runs with indices at both ends of the
// page and on chunk boundaries, and runs with repeated indices and zero padding. Each result is held against two
// oracles written here, apart from the kernel:
//   - a plain fp32 loop over a dense gradient with the reference formulas (ffi/kernels/kernel_portable.cc's order): the
//     kernel must match it bit for bit;
//   - the same update in double: the kernel must be within 1e-6 of it, relative to each array's scale.
// It prints the largest relative errors and exits non-zero when either exceeds 1e-6.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backends/hls/nsp_updater_hls.h"

namespace {

constexpr double kTolerance = 1e-6;

struct Config {
  const char* name;
  int32_t kind;
  double b1, b2, eps, weight_decay, momentum;
  bool nesterov;
};

const Config kConfigs[] = {
    {"adam", NSP_HLS_ADAM, 0.9, 0.999, 1e-8, 0.0, 0.0, false},
    {"adam_l2", NSP_HLS_ADAM, 0.9, 0.999, 1e-8, 0.01, 0.0, false},
    {"adamw_wd", NSP_HLS_ADAMW, 0.8, 0.99, 1e-6, 0.05, 0.0, false},
    {"sgd", NSP_HLS_SGD, 0.0, 0.0, 0.0, 0.0, 0.0, false},
    {"sgd_momentum", NSP_HLS_SGD, 0.0, 0.0, 0.0, 0.0, 0.9, false},
    {"sgd_nesterov_l2", NSP_HLS_SGD, 0.0, 0.0, 0.0, 1e-3, 0.9, true},
    {"adagrad", NSP_HLS_ADAGRAD, 0.0, 0.0, 1e-7, 0.0, 0.0, false},
    {"adagrad_l2", NSP_HLS_ADAGRAD, 0.0, 0.0, 1e-7, 0.02, 0.0, false},
};

const char* const kFormatNames[] = {"dense_f32", "dense_bf16", "topk_f32", "topk_bf16"};

enum class RunShape { kRandom, kEmpty, kEnds, kRepeats };
const char* const kRunNames[] = {"random", "empty", "ends", "repeats"};

uint16_t ToBf16(float f) {  // round to nearest even (inputs here are finite)
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float FromBf16(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// One page's inputs. The gradient is held both as the kernel gets it (dense or pairs, fp32 or bf16) and densely in
// fp32, values already rounded to what the kernel sees.
struct Page {
  int32_t n = 0, index_base = 0;
  int64_t step = 1;
  float lr = 0.0f;
  std::vector<float> p, m, v;
  std::vector<float> grad_f32;      // dense fp32 gradient, or Top-K fp32 values
  std::vector<uint16_t> grad_bf16;  // dense bf16 gradient, or Top-K bf16 values
  std::vector<int32_t> idx;         // Top-K indices (absolute: index_base + position)
  std::vector<float> value_seen;    // Top-K values as fp32, in pair order
};

std::vector<int32_t> MakeIndices(std::mt19937& rng, int32_t n, RunShape shape) {
  std::vector<int32_t> pos;
  if (shape == RunShape::kEmpty) return pos;
  if (shape == RunShape::kEnds) {
    for (int32_t k : {0, n - 1, NSP_HLS_CHUNK - 1, NSP_HLS_CHUNK, 2 * NSP_HLS_CHUNK}) {
      if (k >= 0 && k < n) pos.push_back(k);
    }
  } else {
    const int32_t k = std::max<int32_t>(1, n / 100);
    std::uniform_int_distribution<int32_t> any(0, n - 1);
    for (int32_t i = 0; i < k; ++i) pos.push_back(any(rng));
    if (shape == RunShape::kRepeats) {  // repeat some, and pad at the end with the last index (zero values)
      const size_t base = pos.size();
      for (size_t i = 0; i < base; i += 2) pos.push_back(pos[i]);
      pos.push_back(n - 1);
      pos.push_back(n - 1);
    }
  }
  std::sort(pos.begin(), pos.end());
  if (shape != RunShape::kRepeats) pos.erase(std::unique(pos.begin(), pos.end()), pos.end());
  return pos;
}

Page MakePage(std::mt19937& rng, const Config& cfg, int32_t n, int format, RunShape shape, bool lazy) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int32_t> steps(1, 60);
  Page pg;
  pg.n = n;
  pg.index_base = format >= NSP_HLS_TOPK_F32 ? 12345 : 0;
  pg.step = steps(rng);
  pg.lr = 0.01f * std::pow(0.95f, static_cast<float>(pg.step));
  pg.p.resize(n);
  pg.m.resize(n);
  pg.v.resize(n);
  for (int32_t i = 0; i < n; ++i) {
    pg.p[i] = normal(rng);
    pg.m[i] = 0.1f * normal(rng);
    const float r = normal(rng);
    pg.v[i] = cfg.kind == NSP_HLS_ADAGRAD ? 0.1f + r * r : 0.01f * r * r;  // second moments are never negative
  }
  if (format <= NSP_HLS_GRAD_BF16) {
    std::uniform_real_distribution<float> unit(0.0f, 1.0f);
    for (int32_t i = 0; i < n; ++i) {
      float g = normal(rng);
      if (lazy && unit(rng) < 1.0f / 3.0f) g = 0.0f;  // a lazy update must leave these elements alone
      pg.grad_f32.push_back(g);
      pg.grad_bf16.push_back(ToBf16(g));
    }
    return pg;
  }
  const std::vector<int32_t> pos = MakeIndices(rng, n, shape);
  for (size_t j = 0; j < pos.size(); ++j) {
    const bool padding = shape == RunShape::kRepeats && j + 2 >= pos.size();
    const float value = padding ? 0.0f : normal(rng);
    pg.idx.push_back(pg.index_base + pos[j]);
    pg.grad_f32.push_back(value);
    pg.grad_bf16.push_back(ToBf16(value));
    pg.value_seen.push_back(format == NSP_HLS_TOPK_BF16 ? FromBf16(ToBf16(value)) : value);
  }
  return pg;
}

// The gradient as the update sees it: dense fp32, Top-K pairs added in order onto zeros.
std::vector<float> DenseGradient(const Page& pg, int format) {
  std::vector<float> g(pg.n, 0.0f);
  if (format == NSP_HLS_GRAD_F32) return pg.grad_f32;
  if (format == NSP_HLS_GRAD_BF16) {
    for (int32_t i = 0; i < pg.n; ++i) g[i] = FromBf16(pg.grad_bf16[i]);
    return g;
  }
  for (size_t j = 0; j < pg.idx.size(); ++j) g[pg.idx[j] - pg.index_base] += pg.value_seen[j];
  return g;
}

struct State {
  std::vector<float> p, m, v;
  std::vector<uint16_t> p16;
};

// Oracle 1: the reference formulas in fp32, one element at a time, coefficients derived here.
State Fp32Oracle(const Config& cfg, const Page& pg, const std::vector<float>& grad, bool lazy) {
  const double t = static_cast<double>(pg.step);
  const float mu_a = static_cast<float>(cfg.b1), mu_b = static_cast<float>(1.0 - cfg.b1);
  const float nu_a = static_cast<float>(cfg.b2), nu_b = static_cast<float>(1.0 - cfg.b2);
  const float bc1 = static_cast<float>(1.0 / (1.0 - std::pow(cfg.b1, t)));
  const float bc2 = static_cast<float>(1.0 / (1.0 - std::pow(cfg.b2, t)));
  const float eps = static_cast<float>(cfg.eps), wd = static_cast<float>(cfg.weight_decay);
  const float mom = static_cast<float>(cfg.momentum);
  State s{pg.p, pg.m, pg.v, std::vector<uint16_t>(pg.n)};
  for (int32_t i = 0; i < pg.n; ++i) {
    float g = grad[i];
    const float p = pg.p[i];
    if (!(lazy && g == 0.0f)) {
      float u;
      if (cfg.kind == NSP_HLS_ADAM || cfg.kind == NSP_HLS_ADAMW) {
        if (cfg.kind == NSP_HLS_ADAM && wd != 0.0f) g = g + wd * p;
        s.m[i] = mu_a * pg.m[i] + mu_b * g;
        s.v[i] = nu_a * pg.v[i] + nu_b * g * g;
        u = (s.m[i] * bc1) / (std::sqrt(s.v[i] * bc2) + eps);
        if (cfg.kind == NSP_HLS_ADAMW) u = u + wd * p;
      } else if (cfg.kind == NSP_HLS_SGD) {
        if (wd != 0.0f) g = g + wd * p;
        u = g;
        if (mom != 0.0f) {
          s.m[i] = mom * pg.m[i] + g;
          u = cfg.nesterov ? g + mom * s.m[i] : s.m[i];
        }
      } else {
        if (wd != 0.0f) g = g + wd * p;
        s.v[i] = pg.v[i] + g * g;
        u = s.v[i] > 0.0f ? g / std::sqrt(s.v[i] + eps) : 0.0f;
      }
      s.p[i] = p - pg.lr * u;
    }
    s.p16[i] = ToBf16(s.p[i]);
  }
  return s;
}

struct StateD {
  std::vector<double> p, m, v;
};

// Oracle 2: the textbook update in double (hyperparameters as given, no fp32 rounding anywhere but the inputs).
StateD DoubleOracle(const Config& cfg, const Page& pg, const std::vector<float>& grad, bool lazy) {
  StateD s{{pg.p.begin(), pg.p.end()}, {pg.m.begin(), pg.m.end()}, {pg.v.begin(), pg.v.end()}};
  const double t = static_cast<double>(pg.step), lr = pg.lr;
  for (int32_t i = 0; i < pg.n; ++i) {
    double g = grad[i];
    const double p = pg.p[i];
    if (lazy && g == 0.0) continue;
    double u;
    if (cfg.kind == NSP_HLS_ADAM || cfg.kind == NSP_HLS_ADAMW) {
      if (cfg.kind == NSP_HLS_ADAM) g += cfg.weight_decay * p;
      s.m[i] = cfg.b1 * pg.m[i] + (1.0 - cfg.b1) * g;
      s.v[i] = cfg.b2 * pg.v[i] + (1.0 - cfg.b2) * g * g;
      const double m_hat = s.m[i] / (1.0 - std::pow(cfg.b1, t));
      const double v_hat = s.v[i] / (1.0 - std::pow(cfg.b2, t));
      u = m_hat / (std::sqrt(v_hat) + cfg.eps);
      if (cfg.kind == NSP_HLS_ADAMW) u += cfg.weight_decay * p;
    } else if (cfg.kind == NSP_HLS_SGD) {
      g += cfg.weight_decay * p;
      u = g;
      if (cfg.momentum != 0.0) {
        s.m[i] = cfg.momentum * pg.m[i] + g;
        u = cfg.nesterov ? g + cfg.momentum * s.m[i] : s.m[i];
      }
    } else {
      g += cfg.weight_decay * p;
      s.v[i] = pg.v[i] + g * g;
      u = s.v[i] > 0.0 ? g / std::sqrt(s.v[i] + cfg.eps) : 0.0;
    }
    s.p[i] = p - lr * u;
  }
  return s;
}

// Runs the kernel on copies of the page's state: in place (inputs and outputs the same buffers) or out of place.
State RunKernel(const Config& cfg, const Page& pg, int format, bool lazy, bool in_place) {
  float coeffs[NSP_HLS_NUM_COEFFS];
  if (const char* err = nsp_hls_make_coeffs(cfg.kind, pg.lr, pg.step, cfg.b1, cfg.b2, cfg.eps, cfg.weight_decay,
                                            cfg.momentum, coeffs)) {
    std::fprintf(stderr, "nsp_hls_make_coeffs refused %s: %s\n", cfg.name, err);
    std::exit(2);
  }
  if (format >= NSP_HLS_TOPK_F32 &&
      nsp_hls_check_topk(pg.idx.data(), static_cast<int64_t>(pg.idx.size()), pg.n, pg.index_base) != -1) {
    std::fprintf(stderr, "the testbench made an invalid Top-K run for %s\n", cfg.name);
    std::exit(2);
  }
  const uint32_t flags = nsp_hls_flags(cfg.kind, format, lazy, cfg.nesterov, cfg.momentum, 1);
  State in{pg.p, pg.m, pg.v, {}};
  State out = in_place ? State{} : State{std::vector<float>(pg.n), std::vector<float>(pg.n),
                                         std::vector<float>(pg.n), {}};
  State& dst = in_place ? in : out;
  dst.p16.assign(pg.n, 0);
  const bool um = nsp_hls_uses_m(flags) != 0, uv = nsp_hls_uses_v(flags) != 0;
  nsp_update_page(in.p.data(), um ? in.m.data() : nullptr, uv ? in.v.data() : nullptr, dst.p.data(),
                  um ? dst.m.data() : nullptr, uv ? dst.v.data() : nullptr, dst.p16.data(), pg.grad_f32.data(),
                  pg.grad_bf16.data(), pg.idx.data(), coeffs, pg.n, static_cast<int32_t>(pg.idx.size()),
                  pg.index_base, flags);
  if (!in_place) {  // the kernel reads its inputs and must leave them as they were
    if (in.p != pg.p || in.m != pg.m || in.v != pg.v) {
      std::fprintf(stderr, "%s: an out-of-place run changed its inputs\n", cfg.name);
      std::exit(1);
    }
    if (!um) dst.m = pg.m;
    if (!uv) dst.v = pg.v;
  }
  return dst;
}

// max |a - b| / max(scale of b, scale of the inputs): relative to the array's magnitude, so an element that
// cancelled to near zero does not turn one rounding step into a large error.
template <typename T>
double RelError(const std::vector<float>& actual, const std::vector<T>& expected, const std::vector<float>& input) {
  double diff = 0.0, scale = 1e-30;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double d = std::fabs(static_cast<double>(actual[i]) - static_cast<double>(expected[i]));
    if (std::isnan(d)) return INFINITY;  // a NaN on either side is never close
    diff = std::max(diff, d);
    scale = std::max({scale, std::fabs(static_cast<double>(expected[i])), std::fabs(static_cast<double>(input[i]))});
  }
  return diff / scale;
}

struct Tally {
  double worst_fp32 = 0.0, worst_double = 0.0;
  int cases = 0, bit_exact = 0, failures = 0;
};

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void RunCase(const Config& cfg, int32_t n, int format, RunShape shape, bool lazy, std::mt19937& rng, Tally& tally) {
  const Page pg = MakePage(rng, cfg, n, format, shape, lazy);
  const std::vector<float> grad = DenseGradient(pg, format);
  const State got = RunKernel(cfg, pg, format, lazy, true);
  const State got_oop = RunKernel(cfg, pg, format, lazy, false);
  const State f32 = Fp32Oracle(cfg, pg, grad, lazy);
  const StateD f64 = DoubleOracle(cfg, pg, grad, lazy);

  double e32 = std::max({RelError(got.p, f32.p, pg.p), RelError(got.m, f32.m, pg.m), RelError(got.v, f32.v, pg.v)});
  const bool exact = SameBits(got.p, f32.p) && SameBits(got.m, f32.m) && SameBits(got.v, f32.v) &&
                     got.p16 == f32.p16 && SameBits(got_oop.p, got.p) && SameBits(got_oop.m, got.m) &&
                     SameBits(got_oop.v, got.v) && got_oop.p16 == got.p16;
  if (!exact && e32 == 0.0) e32 = 1.0;  // differing bf16 copies, signs of zero, or in-place vs out-of-place
  const double e64 =
      std::max({RelError(got.p, f64.p, pg.p), RelError(got.m, f64.m, pg.m), RelError(got.v, f64.v, pg.v)});
  ++tally.cases;
  tally.bit_exact += exact ? 1 : 0;
  tally.worst_fp32 = std::max(tally.worst_fp32, e32);
  tally.worst_double = std::max(tally.worst_double, e64);
  if (e32 > kTolerance || e64 > kTolerance) {
    ++tally.failures;
    std::printf("FAIL %-16s %-10s %-7s lazy=%d n=%-5d pairs=%zu: rel err vs fp32 oracle %.3g, vs double %.3g\n",
                cfg.name, kFormatNames[format], format >= NSP_HLS_TOPK_F32 ? kRunNames[static_cast<int>(shape)] : "-",
                lazy ? 1 : 0, n, pg.idx.size(), e32, e64);
  }
}

}  // namespace

int main() {
  std::mt19937 rng(20240611);
  const int32_t sizes[] = {1, 7, NSP_HLS_CHUNK, NSP_HLS_CHUNK + 1, 3 * NSP_HLS_CHUNK + 17};
  const RunShape shapes[] = {RunShape::kRandom, RunShape::kEmpty, RunShape::kEnds, RunShape::kRepeats};
  Tally tally;
  for (const Config& cfg : kConfigs) {
    for (int32_t n : sizes) {
      for (int lazy = 0; lazy < 2; ++lazy) {
        for (int format = NSP_HLS_GRAD_F32; format <= NSP_HLS_TOPK_BF16; ++format) {
          if (format <= NSP_HLS_GRAD_BF16) {
            RunCase(cfg, n, format, RunShape::kRandom, lazy != 0, rng, tally);
          } else {
            for (RunShape shape : shapes) RunCase(cfg, n, format, shape, lazy != 0, rng, tally);
          }
        }
      }
    }
  }
  std::printf("cases: %d, bit-exact against the fp32 oracle: %d\n", tally.cases, tally.bit_exact);
  std::printf("max relative error vs fp32 oracle: %.3g\n", tally.worst_fp32);
  std::printf("max relative error vs double oracle: %.3g\n", tally.worst_double);
  if (tally.failures != 0) {
    std::printf("FAILED: %d cases above %.0e\n", tally.failures, kTolerance);
    return 1;
  }
  std::printf("PASSED\n");
  return 0;
}
