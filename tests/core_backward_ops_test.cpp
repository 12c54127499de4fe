// Every training op of the CUDA backend (the "Training ops" section of core/backend.h) against the
// fp32 CPU oracle, in the manner of core_backend_ops_test.cpp: random inputs rounded to bf16 so
// that both backends see the same values, several shapes per op (the tiny fixture's dims, the
// real Qwen3-VL-2B dims -- text H 2048, I 6144, 16/8 heads of 128, vocab 151936; vision D 1024,
// I 4096, 16 heads of 64 -- and head_dim 72, 16, 32), outputs compared by normalised mean squared
// error, NMSE = sum((gpu - cpu)^2) / sum(cpu^2). The measured NMSE of every output is printed
// ("[ nmse     ]" lines) to show the margin under each threshold.
//
// Every case also checks:
//  - outputs an op overwrites are poisoned with NaN on both backends before the call, and must
//    come back finite (on the CPU too) and matching;
//  - outputs it accumulates into (f32 parameter gradients, the f32 dx of the norms, loss_sum,
//    accumulating linear_backward_input) are pre-filled with the same random values on both
//    backends, scaled to about the size of the increment, so that a missed accumulate or an
//    overwrite moves the NMSE to ~1e-1;
//  - the CUDA op runs twice, from freshly made identical inputs, and both results must be
//    bitwise identical (every backward is deterministic: no float atomics);
//  - every tensor sits between guard regions of sentinels that must survive (out-of-bounds
//    writes); zero rows (attention padding) are exactly zero on both backends.
//
// Thresholds. One bf16 rounding of an output has a relative error uniform in +-2^-9, an NMSE of
// about 1.3e-6; f32 arithmetic on identical inputs in another order differs by ~1e-7 relative
// per element (NMSE ~1e-12, ~1e-10 for long tensor-core reductions). A real bug (wrong element
// pattern, missing term, wrong mask, missing accumulate) gives 1e-3 or more.
//   kExact (bitwise):    convert to f32, gather_rows without rounding, optimizer step counts, the
//                        frozen tensor's state, the gradients grad_norm_clip only reads
//   kF32 1e-7:           f32 outputs computed from identical inputs in f32 only: norm statistics,
//                        layer/rms_norm_backward dx/dw/db, linear_backward_input into f32,
//                        linear_backward_weight dw/db, embedding_backward,
//                        add_interpolated_rows_backward, attention dsum, lm_head loss_sum. One
//                        wrong element of a 1M-element gradient already gives 1e-6.
//   kLse 1e-6:           attention lse (f32, but the kernel's exp/log and score order differ)
//   kElementwise 2e-5:   compute-dtype outputs of 1-2 roundings: convert/gather f32->bf16,
//                        gelu_tanh/erf_backward, swiglu_backward, linear_backward_input into bf16,
//                        layer/rms_norm_train y
//   kRope 5e-5:          qkv_norm_rope_train out (as the inference op's bound)
//   kRopeBackward 1e-4:  qkv_norm_rope_backward din and q/k norm-weight gradients (bf16 tables on
//                        the text path where the CPU's are f32, plus the din rounding)
//   kAttention 5e-5:     attention_train out (as the inference attention's bound)
//   kAttentionBackward 2e-4: attention_backward dqkv (P and dS rounded to bf16 for the tensor
//                        cores, GQA sums over the group, then the dqkv rounding)
//   kLmHead 5e-5:        lm_head_loss dx and dw (d logits rounded to bf16 for the GEMMs, plus the
//                        dx rounding); the logits are scaled (std ~4) so that the softmax part of
//                        the gradient is 5-35% of it (squared norm), not lost under the one-hot
//                        part
//   kOptimizer 1e-8:     grad_norm_clip stats, AdamW moments, per-tensor parameter updates
//                        (final - initial, so that the small update is what is measured), the
//                        bf16 weights against round_bf16 of the CPU params
//
// Skips cleanly where no CUDA device is present or Iris was built without CUDA (CI).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "core/arena.h"
#include "core/backend.h"
#include "core/dtype.h"
#include "core/splitmix.h"

namespace iris {
namespace {

constexpr double kExact = 0.0;
constexpr double kF32 = 1e-7;
constexpr double kLse = 1e-6;
constexpr double kElementwise = 2e-5;
constexpr double kRope = 5e-5;
constexpr double kRopeBackward = 1e-4;
constexpr double kAttention = 5e-5;
constexpr double kAttentionBackward = 2e-4;
constexpr double kLmHead = 5e-5;
constexpr double kOptimizer = 1e-8;

constexpr int64_t kGuard = 64;         // sentinel elements each side; keeps 16-byte alignment
constexpr float kSentinel = -1232.0f;  // exact in bf16, f32, i32 and i64
constexpr float kEps = 1e-6f;
const float kNaN = std::numeric_limits<float>::quiet_NaN();

enum class Kind { act, f32, i32, i64 };  // act: the backend's compute dtype

const char* kind_name(Kind k) {
  return k == Kind::act ? "compute" : (k == Kind::f32 ? "f32" : (k == Kind::i32 ? "i32" : "i64"));
}

int64_t product(const std::vector<int64_t>& dims) {
  return std::accumulate(dims.begin(), dims.end(), int64_t{1}, std::multiplies<int64_t>());
}

std::string dims_str(std::initializer_list<int64_t> d) {
  std::string s;
  for (int64_t v : d) s += (s.empty() ? "" : "x") + std::to_string(v);
  return s;
}

// A seeded generator cheap enough for tables of 3e8 values (lm_head and embedding gradients at
// vocab 151936 x 2048): approximately normal values (the sum of four uniforms).
class Rng {
 public:
  explicit Rng(uint64_t seed) : g_(seed * 0x9E3779B97F4A7C15ull + 12345) {}
  // bf16-representable values, the inputs both backends can hold exactly.
  std::vector<float> normal(int64_t n, float mean = 0.f, float stddev = 1.f) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = round_bf16(mean + stddev * unit());
    return v;
  }
  // Not rounded: f32 values whose conversion to bf16 must round.
  std::vector<float> normal_f32(int64_t n, float mean = 0.f, float stddev = 1.f) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = mean + stddev * unit();
    return v;
  }
  std::vector<float> uniform_f32(int64_t n, float lo, float hi) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = lo + (hi - lo) * static_cast<float>(g_.uniform01());
    return v;
  }
  int32_t integer(int32_t lo, int32_t hi) { return g_.uniform_int(lo, hi); }  // inclusive

 private:
  float unit() {
    const uint64_t r = g_.next();
    const float s = static_cast<float>(r & 0xffff) + static_cast<float>((r >> 16) & 0xffff) +
                    static_cast<float>((r >> 32) & 0xffff) + static_cast<float>(r >> 48);
    return (s - 131070.f) * (1.7320508f / 65536.f);  // mean 0, variance 1
  }
  SplitMix64 g_;
};

// One backend's half of a test case: tensors carved from arenas on that backend, each between
// guard regions.
class Side {
 public:
  explicit Side(Backend& be) : be_(be) {}
  Backend& be() { return be_; }
  bool on_cuda() const { return be_.device() == Device::cuda; }

  Tensor make(Kind kind, const std::vector<int64_t>& dims, const std::vector<float>& values) {
    const int64_t n = product(dims);
    EXPECT_EQ(static_cast<int64_t>(values.size()), n) << "test bug: value count";
    Tensor t = guarded(dtype_for(kind), dims);
    if (n > 0) be_.write(t, values.data(), DType::f32);
    return t;
  }
  // An output the op overwrites: NaN everywhere, so that an element it misses shows.
  Tensor poisoned(Kind kind, const std::vector<int64_t>& dims) {
    return make(kind, dims, std::vector<float>(static_cast<size_t>(product(dims)), kNaN));
  }
  Tensor make_i32(const std::vector<int64_t>& dims, const std::vector<int32_t>& values) {
    EXPECT_EQ(static_cast<int64_t>(values.size()), product(dims)) << "test bug: value count";
    Tensor t = guarded(DType::i32, dims);
    if (!values.empty()) be_.write(t, values.data(), DType::i32);
    return t;
  }
  Tensor make_i64(const std::vector<int64_t>& dims, const std::vector<int64_t>& values) {
    EXPECT_EQ(static_cast<int64_t>(values.size()), product(dims)) << "test bug: value count";
    Tensor t = guarded(DType::i64, dims);
    if (!values.empty()) be_.write(t, values.data(), DType::i64);
    return t;
  }
  // Scratch of at least `bytes`, poisoned (an op must not assume zeroed scratch).
  Tensor workspace(size_t bytes) {
    const int64_t n = std::max<int64_t>(1, static_cast<int64_t>((bytes + 3) / 4));
    return poisoned(Kind::f32, {n});
  }

  std::vector<float> get(const Tensor& t) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    if (!v.empty()) be_.read(v.data(), DType::f32, t);
    return v;
  }

  ::testing::AssertionResult guards_intact() {
    for (const auto& [lo, hi] : guards_) {
      for (const Tensor* g : {&lo, &hi}) {
        const std::vector<float> v = get(*g);
        for (size_t i = 0; i < v.size(); ++i)
          if (v[i] != kSentinel)
            return ::testing::AssertionFailure()
                   << be_.name() << ": guard element " << i << " of a "
                   << (g == &lo ? "leading" : "trailing") << " guard was overwritten with " << v[i]
                   << " (out-of-bounds write)";
      }
    }
    return ::testing::AssertionSuccess();
  }

 private:
  DType dtype_for(Kind k) const {
    switch (k) {
      case Kind::act:
        return be_.compute_dtype();
      case Kind::f32:
        return DType::f32;
      case Kind::i32:
        return DType::i32;
      case Kind::i64:
        return DType::i64;
    }
    return DType::f32;
  }

  Tensor guarded(DType dt, const std::vector<int64_t>& dims) {
    const int64_t n = product(dims);
    const size_t bytes = static_cast<size_t>(n + 2 * kGuard) * dtype_size(dt);
    if (arenas_.empty() ||
        arenas_.back()->used() + bytes + Arena::kAlignment > arenas_.back()->capacity())
      arenas_.push_back(
          std::make_unique<Arena>(be_, std::max<size_t>(size_t{64} << 20, bytes + 1024)));
    Tensor buf = arenas_.back()->alloc(dt, {n + 2 * kGuard});
    const std::vector<float> sentinel(kGuard, kSentinel);
    Tensor lo = buf.slice(0, kGuard), hi = buf.slice(kGuard + n, n + 2 * kGuard);
    be_.write(lo, sentinel.data(), DType::f32);
    be_.write(hi, sentinel.data(), DType::f32);
    guards_.push_back({lo, hi});
    return buf.slice(kGuard, kGuard + n).view(dims);
  }

  Backend& be_;
  std::vector<std::unique_ptr<Arena>> arenas_;
  std::vector<std::pair<Tensor, Tensor>> guards_;
};

double nmse_of(const std::vector<float>& got, const std::vector<float>& ref) {
  double err = 0, norm = 0;
  for (size_t i = 0; i < got.size() && i < ref.size(); ++i) {
    const double d = double(got[i]) - double(ref[i]);
    err += d * d;
    norm += double(ref[i]) * double(ref[i]);
  }
  return norm > 0 ? err / norm : err;
}

::testing::AssertionResult matches(const std::vector<float>& got, const std::vector<float>& ref,
                                   double threshold) {
  if (got.size() != ref.size())
    return ::testing::AssertionFailure() << "size " << got.size() << " != " << ref.size();
  double err = 0, norm = 0, worst = 0;
  size_t worst_i = 0, non_finite = 0, mismatches = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) ++non_finite;
    const double d = double(got[i]) - double(ref[i]);
    if (got[i] != ref[i]) ++mismatches;
    err += d * d;
    norm += double(ref[i]) * double(ref[i]);
    if (std::fabs(d) > worst || !std::isfinite(d)) worst = std::fabs(d), worst_i = i;
  }
  const double nmse = norm > 0 ? err / norm : err;
  const bool ok = non_finite == 0 && (threshold == kExact ? mismatches == 0 : nmse <= threshold);
  if (ok) return ::testing::AssertionSuccess();
  auto f = ::testing::AssertionFailure();
  f << "NMSE " << nmse << " (threshold " << threshold << "), " << non_finite << " non-finite, "
    << mismatches << " of " << got.size() << " elements differ";
  if (!got.empty()) f << "; worst [" << worst_i << "] " << got[worst_i] << " vs " << ref[worst_i];
  return f;
}

::testing::AssertionResult all_finite(const std::vector<float>& v) {
  for (size_t i = 0; i < v.size(); ++i)
    if (!std::isfinite(v[i]))
      return ::testing::AssertionFailure()
             << "element " << i << " of " << v.size() << " is " << v[i] << " (not written?)";
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes differ";
  size_t differ = 0, first = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0 && differ++ == 0) first = i;
  if (differ == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << differ << " of " << a.size() << " elements differ, first [" << first << "] " << a[first]
         << " vs " << b[first];
}

// One output of a case.
struct Out {
  std::string name;
  Tensor t;
  double threshold;
  // Rows [zero_from, rows) of t (dim 0) must be exactly zero on both backends (-1: none).
  int64_t zero_from = -1;
  // When not empty, the host truth that both backends' values must also match (same threshold).
  std::vector<float> expected = {};
};
using Outs = std::vector<Out>;
using Body = std::function<Outs(Side&)>;

::testing::AssertionResult zero_rows(const std::vector<float>& v, const Out& o) {
  const int64_t rows = o.t.ndim == 0 ? 1 : o.t.dim(0);
  const int64_t cols = rows == 0 ? 0 : o.t.numel() / rows;
  for (int64_t i = o.zero_from * cols; i < static_cast<int64_t>(v.size()); ++i)
    if (v[static_cast<size_t>(i)] != 0.f)
      return ::testing::AssertionFailure() << "row " << i / cols << " (element " << i % cols
                                           << ") is " << v[static_cast<size_t>(i)] << ", not 0";
  return ::testing::AssertionSuccess();
}

class BackwardOps : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
#ifdef IRIS_WITH_CUDA
    if (!cuda_available()) return;
    cpu_ = make_cpu_backend();
    gpu_ = make_cuda_backend(0);
#endif
  }
  static void TearDownTestSuite() {
    gpu_.reset();
    cpu_.reset();
  }
  void SetUp() override {
    if (!gpu_) GTEST_SKIP() << "no CUDA device: the CUDA backend is not exercised here";
  }

  // Runs `body` on the CPU oracle and twice on the GPU (fresh tensors, identical inputs), then
  // compares the outputs it returns: GPU against CPU (and against the host truth where given),
  // the two GPU runs bit for bit, zero rows, finiteness, guards.
  static void compare(const std::string& what, const Body& body) {
    SCOPED_TRACE(what);
    Outs spec;
    std::vector<std::vector<float>> ref, got[2];
    {
      Side cpu(*cpu_);
      spec = body(cpu);
      for (const Out& o : spec) ref.push_back(cpu.get(o.t));
      EXPECT_TRUE(cpu.guards_intact());
    }
    for (int rep = 0; rep < 2; ++rep) {
      Side gpu(*gpu_);
      const Outs outs = body(gpu);
      ASSERT_EQ(outs.size(), spec.size()) << "test bug: outputs differ between backends";
      for (const Out& o : outs) got[rep].push_back(gpu.get(o.t));
      EXPECT_TRUE(gpu.guards_intact()) << "CUDA run " << rep;
    }
    for (size_t i = 0; i < spec.size(); ++i) {
      const Out& o = spec[i];
      SCOPED_TRACE("output " + o.name);
      EXPECT_TRUE(all_finite(ref[i])) << "CPU oracle";
      EXPECT_TRUE(matches(got[0][i], ref[i], o.threshold)) << "CUDA against the CPU";
      EXPECT_TRUE(bitwise_equal(got[0][i], got[1][i])) << "two CUDA runs (determinism)";
      if (o.zero_from >= 0) {
        EXPECT_TRUE(zero_rows(ref[i], o)) << "CPU";
        EXPECT_TRUE(zero_rows(got[0][i], o)) << "CUDA";
      }
      if (!o.expected.empty()) {
        EXPECT_TRUE(matches(ref[i], o.expected, o.threshold)) << "CPU against the host truth";
        EXPECT_TRUE(matches(got[0][i], o.expected, o.threshold)) << "CUDA against the host truth";
      }
      std::printf("[ nmse     ] %-72s %-20s %.2e\n", what.c_str(), o.name.c_str(),
                  nmse_of(got[0][i], ref[i]));
    }
  }

  static inline std::unique_ptr<Backend> cpu_, gpu_;
};

// Rotate-half RoPE tables cos/sin [t, hd] of positions p * 3 + 1 (f32, as both models build).
void rope_tables(int64_t t, int hd, float theta, std::vector<float>& cs, std::vector<float>& sn) {
  cs.assign(static_cast<size_t>(t * hd), 0.f);
  sn.assign(static_cast<size_t>(t * hd), 0.f);
  for (int64_t p = 0; p < t; ++p)
    for (int i = 0; i < hd / 2; ++i) {
      const float f = float(p * 3 + 1) * std::pow(theta, -2.f * i / hd);
      cs[p * hd + i] = cs[p * hd + i + hd / 2] = std::cos(f);
      sn[p * hd + i] = sn[p * hd + i + hd / 2] = std::sin(f);
    }
}

// Saved statistics computed on the host (f64, stored as f32), identical for both backends.
void layer_norm_stats(const std::vector<float>& x, int64_t rows, int64_t cols,
                      std::vector<float>& mean, std::vector<float>& rstd) {
  mean.resize(static_cast<size_t>(rows));
  rstd.resize(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    double m = 0, v = 0;
    for (int64_t c = 0; c < cols; ++c) m += x[r * cols + c];
    m /= double(cols);
    for (int64_t c = 0; c < cols; ++c) v += (x[r * cols + c] - m) * (x[r * cols + c] - m);
    mean[r] = static_cast<float>(m);
    rstd[r] = static_cast<float>(1.0 / std::sqrt(v / double(cols) + kEps));
  }
}
std::vector<float> rms_stats(const std::vector<float>& x, int64_t rows, int64_t cols,
                             int64_t stride, int64_t offset) {
  std::vector<float> rstd(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    double s = 0;
    for (int64_t c = 0; c < cols; ++c)
      s += double(x[r * stride + offset + c]) * x[r * stride + offset + c];
    rstd[r] = static_cast<float>(1.0 / std::sqrt(s / double(cols) + kEps));
  }
  return rstd;
}

// Ids in [0, vocab) with many repeats (a pool of 8 ids takes half the tokens), the first and last
// id, and `special` (>= 0) at every 5th token.
std::vector<int32_t> ids_with_repeats(Rng& rng, int64_t n, int64_t vocab, int32_t special) {
  const int32_t top = static_cast<int32_t>(vocab - 1);
  std::vector<int32_t> pool(8);
  for (auto& p : pool) p = rng.integer(0, top);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    ids[i] = (i % 2 == 0) ? pool[static_cast<size_t>(rng.integer(0, 7))] : rng.integer(0, top);
  if (n > 1) ids[0] = 0, ids[n - 1] = top;
  if (special >= 0)
    for (int64_t i = 2; i < n; i += 5) ids[i] = special;
  return ids;
}

// ---- convert ----

TEST_F(BackwardOps, Convert) {
  for (int64_t n : {int64_t{1}, int64_t{37}, int64_t{4096}, int64_t{100003}, int64_t{3000001}}) {
    compare("convert f32->compute n=" + std::to_string(n), [&](Side& s) {
      Rng rng(200);
      Tensor src = s.make(Kind::f32, {n}, rng.normal_f32(n, 0.f, 3.f));  // not bf16 values
      Tensor dst = s.poisoned(Kind::act, {n});
      s.be().convert(dst, src);
      return Outs{{"dst", dst, kElementwise}};
    });
    compare("convert compute->f32 n=" + std::to_string(n), [&](Side& s) {
      Rng rng(201);
      const std::vector<float> v = rng.normal(n, 0.f, 3.f);
      Tensor src = s.make(Kind::act, {n}, v);
      Tensor dst = s.poisoned(Kind::f32, {n});
      s.be().convert(dst, src);
      return Outs{{"dst", dst, kExact, -1, v}};
    });
  }
}

// f32 -> bf16 on the device rounds to nearest even exactly as the host conversion does: exact
// ties (down and up to even, both signs, subnormals), signed zeros, extreme magnitudes.
TEST_F(BackwardOps, ConvertRoundsToNearestEven) {
  Side gpu(*gpu_);
  Rng rng(202);
  const int64_t n = 100003;
  std::vector<float> v = rng.normal_f32(n, 0.f, 10.f);
  for (uint32_t i = 0; i < 1024; ++i) {
    const uint32_t hi = (i < 256   ? 0x3f80u
                         : i < 512 ? 0xbf80u
                         : i < 768 ? 0x0000u
                                   : 0x7e00u) +
                        (i % 256);
    const uint32_t bits = (hi << 16) | 0x8000u;  // exactly halfway between two bf16 values
    std::memcpy(&v[i], &bits, 4);
  }
  const float special[] = {0.f, -0.f, 1e-30f, -3e30f, 3.3e38f, -1e-40f, 65504.f};
  for (size_t i = 0; i < std::size(special); ++i) v[1024 + i] = special[i];
  Tensor src = gpu.make(Kind::f32, {n}, v);
  Tensor dst = gpu.poisoned(Kind::act, {n});
  gpu_->convert(dst, src);
  std::vector<uint16_t> bits(v.size());
  gpu_->read(bits.data(), DType::bf16, dst);
  for (size_t i = 0; i < v.size(); ++i) ASSERT_EQ(bits[i], f32_to_bf16(v[i])) << i << ": " << v[i];
  EXPECT_TRUE(gpu.guards_intact());
}

// ---- linear backward ----

TEST_F(BackwardOps, LinearBackwardInput) {
  struct Case {
    int64_t m, n, k;  // dy [m, n], w [n, k], dx [m, k]
    Kind dx;
    bool accumulate;
  };
  const Case cases[] = {
      {5, 64, 32, Kind::act, false},        // tiny
      {7, 96, 64, Kind::f32, true},         // tiny text qkv, into an f32 residual gradient
      {7, 256, 64, Kind::act, true},        // tiny gate_up, bf16 accumulate
      {300, 3072, 1024, Kind::act, false},  // vision qkv
      {300, 1024, 4096, Kind::f32, true},   // vision fc2
      {17, 2048, 6144, Kind::f32, true},    // text down_proj
      {64, 12288, 2048, Kind::act, false},  // text gate_up
      {1, 4096, 2048, Kind::act, true},     // one row
      {4, 1001, 300, Kind::f32, false},     // odd sizes
  };
  for (const Case& c : cases) {
    compare("linear_backward_input " + dims_str({c.m, c.n, c.k}) + " dx " + kind_name(c.dx) +
                (c.accumulate ? " acc" : ""),
            [&](Side& s) {
              Rng rng(210);
              Tensor dy = s.make(Kind::act, {c.m, c.n}, rng.normal(c.m * c.n));
              Tensor w = s.make(Kind::act, {c.n, c.k}, rng.normal(c.n * c.k, 0.f, 0.05f));
              const float scale = 0.05f * std::sqrt(float(c.n));
              Tensor dx = c.accumulate ? s.make(c.dx, {c.m, c.k}, rng.normal(c.m * c.k, 0.f, scale))
                                       : s.poisoned(c.dx, {c.m, c.k});
              s.be().linear_backward_input(dx, dy, w, c.accumulate);
              return Outs{{"dx", dx, c.dx == Kind::f32 ? kF32 : kElementwise}};
            });
  }
}

TEST_F(BackwardOps, LinearBackwardWeight) {
  struct Case {
    int64_t m, n, k;  // dy [m, n], x [m, k], dw [n, k]
    bool dw, db;
  };
  const Case cases[] = {
      {5, 64, 32, true, true},         // tiny vision qkv
      {7, 128, 64, true, false},       // tiny text
      {300, 3072, 1024, true, true},   // vision qkv
      {300, 1024, 4096, true, true},   // vision fc2
      {17, 2048, 6144, true, false},   // text down_proj
      {64, 12288, 2048, true, false},  // text gate_up
      {1000, 64, 48, true, true},      // a long reduction over rows
      {100, 1024, 64, false, true},    // db alone
      {1, 151, 64, true, true},        // one row, odd N
  };
  for (const Case& c : cases) {
    compare("linear_backward_weight " + dims_str({c.m, c.n, c.k}) + (c.dw ? " dw" : "") +
                (c.db ? " db" : ""),
            [&](Side& s) {
              Rng rng(220);
              Tensor dy = s.make(Kind::act, {c.m, c.n}, rng.normal(c.m * c.n));
              Tensor x = s.make(Kind::act, {c.m, c.k}, rng.normal(c.m * c.k));
              const float scale = std::sqrt(float(c.m));  // the increments' size
              const std::vector<float> dw0 = rng.normal(c.n * c.k, 0.f, scale);
              const std::vector<float> db0 = rng.normal(c.n, 0.f, scale);
              Tensor dw = c.dw ? s.make(Kind::f32, {c.n, c.k}, dw0) : Tensor();
              Tensor db = c.db ? s.make(Kind::f32, {c.n}, db0) : Tensor();
              s.be().linear_backward_weight(dw, db, dy, x);
              Outs outs;
              if (c.dw) outs.push_back({"dw", dw, kF32});
              if (c.db) outs.push_back({"db", db, kF32});
              return outs;
            });
  }
}

// ---- norms ----

const std::pair<int64_t, int64_t> kLayerNormShapes[] = {{5, 32},    {3, 64},  {300, 1024},
                                                        {17, 4096}, {7, 100}, {64, 2048}};
const std::pair<int64_t, int64_t> kRmsNormShapes[] = {{7, 64},  {300, 2048}, {1, 2048},
                                                      {5, 100}, {9, 16},     {3, 6144}};

TEST_F(BackwardOps, LayerNormTrain) {
  // Named copies, not a structured binding, wherever a lambda uses them: clang before 16
  // cannot capture a binding (the sanitizer build of scripts/test.sh uses clang).
  for (const auto& shape : kLayerNormShapes) {
    const int64_t rows = shape.first, cols = shape.second;
    compare("layer_norm_train " + dims_str({rows, cols}), [&](Side& s) {
      Rng rng(230);
      // A mean far from zero checks that the variance is not E[x^2] - mean^2.
      Tensor x = s.make(Kind::act, {rows, cols}, rng.normal(rows * cols, 3.f, 1.f));
      Tensor w = s.make(Kind::act, {cols}, rng.normal(cols, 1.f, 0.5f));
      Tensor b = s.make(Kind::act, {cols}, rng.normal(cols, 0.f, 0.1f));
      Tensor y = s.poisoned(Kind::act, {rows, cols});
      Tensor mean = s.poisoned(Kind::f32, {rows});
      Tensor rstd = s.poisoned(Kind::f32, {rows});
      s.be().layer_norm_train(y, mean, rstd, x, w, b, kEps);
      return Outs{{"y", y, kElementwise}, {"mean", mean, kF32}, {"rstd", rstd, kF32}};
    });
  }
}

TEST_F(BackwardOps, LayerNormBackward) {
  struct Variant {
    Kind dy;
    bool dx, grads;
  };
  const Variant variants[] = {
      {Kind::act, true, true},
      {Kind::f32, true, true},
      {Kind::act, true, false},
      {Kind::f32, false, true}};  // dx undefined: only the parameter gradients
  for (const auto& shape : kLayerNormShapes) {
    const int64_t rows = shape.first, cols = shape.second;
    for (const Variant& v : variants) {
      compare("layer_norm_backward " + dims_str({rows, cols}) + " dy " + kind_name(v.dy) +
                  (v.dx ? " dx" : "") + (v.grads ? " dw db" : ""),
              [&](Side& s) {
                Rng rng(231);
                const std::vector<float> xv = rng.normal(rows * cols, 3.f, 1.f);
                std::vector<float> mean_v, rstd_v;
                layer_norm_stats(xv, rows, cols, mean_v, rstd_v);
                Tensor x = s.make(Kind::act, {rows, cols}, xv);
                Tensor w = s.make(Kind::act, {cols}, rng.normal(cols, 1.f, 0.5f));
                Tensor dy = s.make(v.dy, {rows, cols}, rng.normal(rows * cols));
                Tensor mean = s.make(Kind::f32, {rows}, mean_v);
                Tensor rstd = s.make(Kind::f32, {rows}, rstd_v);
                const std::vector<float> dx0 = rng.normal(rows * cols);
                const float scale = std::sqrt(float(rows));
                const std::vector<float> dw0 = rng.normal(cols, 0.f, scale);
                const std::vector<float> db0 = rng.normal(cols, 0.f, scale);
                Tensor dx = v.dx ? s.make(Kind::f32, {rows, cols}, dx0) : Tensor();
                Tensor dw = v.grads ? s.make(Kind::f32, {cols}, dw0) : Tensor();
                Tensor db = v.grads ? s.make(Kind::f32, {cols}, db0) : Tensor();
                s.be().layer_norm_backward(dx, dw, db, dy, x, mean, rstd, w);
                Outs outs;
                if (v.dx) outs.push_back({"dx", dx, kF32});
                if (v.grads) outs.push_back({"dw", dw, kF32}), outs.push_back({"db", db, kF32});
                return outs;
              });
    }
  }
}

TEST_F(BackwardOps, RmsNormTrain) {
  for (const auto& shape : kRmsNormShapes) {
    const int64_t rows = shape.first, cols = shape.second;
    compare("rms_norm_train " + dims_str({rows, cols}), [&](Side& s) {
      Rng rng(240);
      Tensor x = s.make(Kind::act, {rows, cols}, rng.normal(rows * cols, 0.f, 2.f));
      Tensor w = s.make(Kind::act, {cols}, rng.normal(cols, 1.f, 0.5f));
      Tensor y = s.poisoned(Kind::act, {rows, cols});
      Tensor rstd = s.poisoned(Kind::f32, {rows});
      s.be().rms_norm_train(y, rstd, x, w, kEps);
      return Outs{{"y", y, kElementwise}, {"rstd", rstd, kF32}};
    });
  }
}

TEST_F(BackwardOps, RmsNormBackward) {
  struct Variant {
    Kind dy;
    bool dx, grads;
  };
  const Variant variants[] = {{Kind::act, true, true},
                              {Kind::f32, true, true},
                              {Kind::f32, true, false},
                              {Kind::act, false, true}};  // dx undefined: only the weight gradient
  for (const auto& shape : kRmsNormShapes) {
    const int64_t rows = shape.first, cols = shape.second;
    for (const Variant& v : variants) {
      compare("rms_norm_backward " + dims_str({rows, cols}) + " dy " + kind_name(v.dy) +
                  (v.dx ? " dx" : "") + (v.grads ? " dw" : ""),
              [&](Side& s) {
                Rng rng(241);
                const std::vector<float> xv = rng.normal(rows * cols, 0.f, 2.f);
                Tensor x = s.make(Kind::act, {rows, cols}, xv);
                Tensor w = s.make(Kind::act, {cols}, rng.normal(cols, 1.f, 0.5f));
                Tensor dy = s.make(v.dy, {rows, cols}, rng.normal(rows * cols));
                Tensor rstd = s.make(Kind::f32, {rows}, rms_stats(xv, rows, cols, cols, 0));
                const std::vector<float> dx0 = rng.normal(rows * cols);
                const std::vector<float> dw0 = rng.normal(cols, 0.f, std::sqrt(float(rows)));
                Tensor dx = v.dx ? s.make(Kind::f32, {rows, cols}, dx0) : Tensor();
                Tensor dw = v.grads ? s.make(Kind::f32, {cols}, dw0) : Tensor();
                s.be().rms_norm_backward(dx, dw, dy, x, rstd, w);
                Outs outs;
                if (v.dx) outs.push_back({"dx", dx, kF32});
                if (v.grads) outs.push_back({"dw", dw, kF32});
                return outs;
              });
    }
  }
}

// ---- q/k norm + RoPE ----

struct RopeCase {
  int64_t t;
  int nq, nkv, hd;
  bool norms, round_tables, alias;
  bool dk = true;  // backward: the k norm's gradient is wanted (false: frozen)
};

std::string rope_name(const RopeCase& c) {
  return "T=" + std::to_string(c.t) + " " + std::to_string(c.nq) + "/" + std::to_string(c.nkv) +
         " hd " + std::to_string(c.hd) + (c.norms ? " norms" : "") +
         (c.round_tables ? " bf16 tables" : " f32 tables") + (c.alias ? " in place" : "") +
         (c.norms && !c.dk ? " k norm frozen" : "");
}

const RopeCase kRopeCases[] = {
    {6, 4, 2, 16, true, true, false},           // tiny text
    {10, 2, 2, 16, false, false, false},        // tiny vision
    {10, 2, 2, 16, false, false, true},         // tiny vision, in place
    {37, 16, 8, 128, true, true, false},        // text, real dims
    {300, 16, 8, 128, true, true, false},       // text, many rows for the norm-weight gradients
    {50, 16, 16, 72, false, false, false},      // vision hd 72
    {40, 16, 16, 64, false, false, true},       // vision hd 64, in place
    {33, 4, 4, 32, false, false, false},        // hd 32
    {37, 16, 8, 128, true, true, true, false},  // backward in place, k norm frozen
};

TEST_F(BackwardOps, QkvNormRopeTrain) {
  for (const RopeCase& c : kRopeCases) {
    if (c.alias && c.norms) continue;  // out must not alias in when the norms save rstd
    compare("qkv_norm_rope_train " + rope_name(c), [&](Side& s) {
      Rng rng(250);
      const int64_t width = int64_t{c.nq + 2 * c.nkv} * c.hd;
      Tensor in = s.make(Kind::act, {c.t, width}, rng.normal(c.t * width, 0.f, 2.f));
      const std::vector<float> qn_v = rng.normal(c.hd, 1.f, 0.3f),
                               kn_v = rng.normal(c.hd, 1.f, 0.3f);
      Tensor qn = c.norms ? s.make(Kind::act, {c.hd}, qn_v) : Tensor();
      Tensor kn = c.norms ? s.make(Kind::act, {c.hd}, kn_v) : Tensor();
      std::vector<float> cs, sn;
      rope_tables(c.t, c.hd, c.round_tables ? 5e6f : 1e4f, cs, sn);
      Tensor cos_t = s.make(Kind::f32, {c.t, c.hd}, cs);
      Tensor sin_t = s.make(Kind::f32, {c.t, c.hd}, sn);
      Tensor rstd = c.norms ? s.poisoned(Kind::f32, {c.t, int64_t{c.nq + c.nkv}}) : Tensor();
      Tensor out = c.alias ? in : s.poisoned(Kind::act, {c.t, width});
      s.be().qkv_norm_rope_train(out, rstd, in, qn, kn, kEps, cos_t, sin_t, c.nq, c.nkv, c.hd,
                                 c.round_tables);
      Outs outs{{"out", out, kRope}};
      if (c.norms) outs.push_back({"rstd", rstd, kF32});
      return outs;
    });
  }
}

TEST_F(BackwardOps, QkvNormRopeBackward) {
  for (const RopeCase& c : kRopeCases) {
    compare("qkv_norm_rope_backward " + rope_name(c), [&](Side& s) {
      Rng rng(251);
      const int64_t width = int64_t{c.nq + 2 * c.nkv} * c.hd, heads = c.nq + c.nkv;
      const std::vector<float> in_v = rng.normal(c.t * width, 0.f, 2.f);
      const std::vector<float> qn_v = rng.normal(c.hd, 1.f, 0.3f),
                               kn_v = rng.normal(c.hd, 1.f, 0.3f);
      // rstd [T, nq + nkv]: the q heads' then the k heads' 1/rms of `in`.
      std::vector<float> rstd_v(static_cast<size_t>(c.t * heads));
      for (int h = 0; h < heads; ++h) {
        const std::vector<float> r = rms_stats(in_v, c.t, c.hd, width, int64_t{h} * c.hd);
        for (int64_t t = 0; t < c.t; ++t) rstd_v[t * heads + h] = r[t];
      }
      Tensor dout = s.make(Kind::act, {c.t, width}, rng.normal(c.t * width));
      // Without norms, in and rstd are not read: they are passed undefined.
      Tensor in = c.norms ? s.make(Kind::act, {c.t, width}, in_v) : Tensor();
      Tensor rstd = c.norms ? s.make(Kind::f32, {c.t, heads}, rstd_v) : Tensor();
      Tensor qn = c.norms ? s.make(Kind::act, {c.hd}, qn_v) : Tensor();
      Tensor kn = c.norms ? s.make(Kind::act, {c.hd}, kn_v) : Tensor();
      std::vector<float> cs, sn;
      rope_tables(c.t, c.hd, c.round_tables ? 5e6f : 1e4f, cs, sn);
      Tensor cos_t = s.make(Kind::f32, {c.t, c.hd}, cs);
      Tensor sin_t = s.make(Kind::f32, {c.t, c.hd}, sn);
      const float scale = std::sqrt(float(c.t * c.nq));
      const std::vector<float> dq0 = rng.normal(c.hd, 0.f, scale),
                               dk0 = rng.normal(c.hd, 0.f, scale);
      Tensor dq = c.norms ? s.make(Kind::f32, {c.hd}, dq0) : Tensor();
      Tensor dk = c.norms && c.dk ? s.make(Kind::f32, {c.hd}, dk0) : Tensor();
      Tensor din = c.alias ? dout : s.poisoned(Kind::act, {c.t, width});
      s.be().qkv_norm_rope_backward(din, dq, dk, dout, in, rstd, qn, kn, cos_t, sin_t, c.nq, c.nkv,
                                    c.hd, c.round_tables);
      Outs outs{{"din", din, kRopeBackward}};
      if (dq.defined()) outs.push_back({"dq_norm_w", dq, kRopeBackward});
      if (dk.defined()) outs.push_back({"dk_norm_w", dk, kRopeBackward});
      return outs;
    });
  }
}

// ---- attention ----

struct AttnCase {
  std::vector<int32_t> cu;  // cu_seqlens
  int64_t t;                // rows (may exceed cu.back(): trailing rows past the segments)
  int nq, nkv, hd;
  bool causal;
  int32_t real_rows;  // -1: undefined
};

std::string attn_name(const AttnCase& c) {
  std::string s = "T=" + std::to_string(c.t) + " cu";
  for (int32_t v : c.cu) s += " " + std::to_string(v);
  s += " " + std::to_string(c.nq) + "/" + std::to_string(c.nkv) + " hd " + std::to_string(c.hd) +
       (c.causal ? " causal" : "");
  if (c.real_rows >= 0) s += " real " + std::to_string(c.real_rows);
  return s;
}

// The first row the forward writes as zeros: that of the first segment starting at or past
// real_rows, or the end of the segments.
int64_t first_zero_row(const AttnCase& c) {
  int64_t z = c.cu.back();
  if (c.real_rows >= 0)
    for (size_t s = 0; s + 1 < c.cu.size(); ++s)
      if (c.cu[s] >= c.real_rows) {
        z = std::min<int64_t>(z, c.cu[s]);
        break;
      }
  return z;
}

std::vector<AttnCase> attention_cases() {
  std::vector<AttnCase> cases;
  // Vision: non-causal, nq == nkv; images of 64, 136 and 56 patches; then the same packed into a
  // 300-row bucket with an empty segment, a padding segment (rows 200..255: real_rows 200) and
  // 44 rows past the segments.
  for (const auto& [hd, heads] :
       {std::pair{64, 16}, std::pair{72, 16}, std::pair{16, 2}, std::pair{32, 4}}) {
    cases.push_back({{0, 64, 200, 256}, 256, heads, heads, hd, false, -1});
    cases.push_back({{0, 64, 64, 200, 256}, 300, heads, heads, hd, false, 200});
  }
  // Decoder: causal GQA, sequences packed as causal segments.
  cases.push_back({{0, 137, 300}, 300, 16, 8, 128, true, -1});
  cases.push_back({{0, 100}, 128, 16, 8, 128, true, -1});  // 28 rows past the segment
  cases.push_back({{0, 20, 37}, 37, 4, 2, 16, true, -1});
  cases.push_back({{0, 30, 50}, 64, 4, 2, 16, true, -1});
  return cases;
}

TEST_F(BackwardOps, AttentionTrain) {
  for (const AttnCase& c : attention_cases()) {
    const int64_t width = int64_t{c.nq + 2 * c.nkv} * c.hd, hidden = int64_t{c.nq} * c.hd;
    const int64_t zero = first_zero_row(c);
    compare("attention_train " + attn_name(c), [&](Side& s) {
      Rng rng(260);
      Tensor qkv = s.make(Kind::act, {c.t, width}, rng.normal(c.t * width));
      Tensor cu = s.make_i32({static_cast<int64_t>(c.cu.size())}, c.cu);
      Tensor real = c.real_rows >= 0 ? s.make_i32({1}, {c.real_rows}) : Tensor();
      Tensor out = s.poisoned(Kind::act, {c.t, hidden});
      Tensor lse = s.poisoned(Kind::f32, {c.t, int64_t{c.nq}});
      s.be().attention_train(out, lse, qkv, cu, static_cast<int>(c.cu.size() - 1), c.nq, c.nkv,
                             c.hd, 1.f / std::sqrt(float(c.hd)), c.causal, real);
      return Outs{{"out", out, kAttention, zero}, {"lse", lse, kLse, zero}};
    });
  }
}

// The backward from identical saved tensors on both backends: out (rounded to bf16) and lse come
// from the CPU forward. dout is random on every row, padding rows included (which must ignore
// it).
TEST_F(BackwardOps, AttentionBackward) {
  for (const AttnCase& c : attention_cases()) {
    const int64_t width = int64_t{c.nq + 2 * c.nkv} * c.hd, hidden = int64_t{c.nq} * c.hd;
    const int64_t zero = first_zero_row(c);
    const int n_seg = static_cast<int>(c.cu.size() - 1);
    const float scale = 1.f / std::sqrt(float(c.hd));
    Rng rng(261);
    const std::vector<float> qkv_v = rng.normal(c.t * width);
    const std::vector<float> dout_v = rng.normal(c.t * hidden);
    std::vector<float> out_v, lse_v;
    {
      Side cpu(*cpu_);
      Tensor qkv = cpu.make(Kind::act, {c.t, width}, qkv_v);
      Tensor cu = cpu.make_i32({static_cast<int64_t>(c.cu.size())}, c.cu);
      Tensor real = c.real_rows >= 0 ? cpu.make_i32({1}, {c.real_rows}) : Tensor();
      Tensor out = cpu.poisoned(Kind::f32, {c.t, hidden});
      Tensor lse = cpu.poisoned(Kind::f32, {c.t, int64_t{c.nq}});
      cpu_->attention_train(out, lse, qkv, cu, n_seg, c.nq, c.nkv, c.hd, scale, c.causal, real);
      out_v = cpu.get(out);
      lse_v = cpu.get(lse);
      for (float& v : out_v) v = round_bf16(v);
      ASSERT_TRUE(all_finite(out_v)) << "CPU attention_train " << attn_name(c);
      ASSERT_TRUE(all_finite(lse_v)) << "CPU attention_train " << attn_name(c);
    }
    compare("attention_backward " + attn_name(c), [&](Side& s) {
      Tensor qkv = s.make(Kind::act, {c.t, width}, qkv_v);
      Tensor cu = s.make_i32({static_cast<int64_t>(c.cu.size())}, c.cu);
      Tensor real = c.real_rows >= 0 ? s.make_i32({1}, {c.real_rows}) : Tensor();
      Tensor out = s.make(Kind::act, {c.t, hidden}, out_v);
      Tensor lse = s.make(Kind::f32, {c.t, int64_t{c.nq}}, lse_v);
      Tensor dout = s.make(Kind::act, {c.t, hidden}, dout_v);
      Tensor dqkv = s.poisoned(Kind::act, {c.t, width});
      Tensor dsum = s.poisoned(Kind::f32, {c.t, int64_t{c.nq}});
      s.be().attention_backward(dqkv, dsum, dout, out, lse, qkv, cu, n_seg, c.nq, c.nkv, c.hd,
                                scale, c.causal, real);
      // dsum is scratch: only its rows that are attended are compared.
      return Outs{{"dqkv", dqkv, kAttentionBackward, zero},
                  {"dsum (attended rows)", dsum.slice(0, zero), kF32}};
    });
  }
}

// ---- activations ----

TEST_F(BackwardOps, GeluBackward) {
  for (int64_t n : {int64_t{160}, int64_t{18432}, int64_t{1000003}}) {
    for (bool erf : {false, true}) {
      for (bool in_place : {false, true}) {
        compare(std::string(erf ? "gelu_erf_backward " : "gelu_tanh_backward ") +
                    std::to_string(n) + (in_place ? " in place" : ""),
                [&](Side& s) {
                  Rng rng(270);
                  Tensor x = s.make(Kind::act, {n}, rng.normal(n, 0.f, 3.f));
                  Tensor dy = s.make(Kind::act, {n}, rng.normal(n));
                  Tensor dx = in_place ? dy : s.poisoned(Kind::act, {n});
                  if (erf)
                    s.be().gelu_erf_backward(dx, dy, x);
                  else
                    s.be().gelu_tanh_backward(dx, dy, x);
                  return Outs{{"dx", dx, kElementwise}};
                });
      }
    }
  }
}

TEST_F(BackwardOps, QuickGeluBackward) {
  for (int64_t n : {int64_t{160}, int64_t{18432}, int64_t{1000003}})
    compare("quick_gelu_backward " + std::to_string(n), [&](Side& s) {
      Rng rng(271);
      Tensor x = s.make(Kind::act, {n}, rng.normal(n, 0.f, 3.f));
      Tensor dy = s.make(Kind::act, {n}, rng.normal(n));
      Tensor dx = s.poisoned(Kind::act, {n});
      s.be().quick_gelu_backward(dx, dy, x);
      return Outs{{"dx", dx, kElementwise}};
    });
}

// The CPU oracle against central differences of its own forward, in double: HF's quick_gelu is
// x * sigmoid(1.702 x).
TEST(CpuQuickGelu, ForwardIsTheFormulaAndBackwardIsItsDerivative) {
  auto be = make_cpu_backend();
  const std::vector<float> xs{-6.f, -2.5f, -1.f, -0.3f, 0.f, 0.2f, 1.f, 3.f, 7.f};
  const int64_t n = static_cast<int64_t>(xs.size());
  Arena arena(*be, 4 * 64 * n);
  Tensor x = arena.alloc(DType::f32, {n}), y = arena.alloc(DType::f32, {n}),
         dy = arena.alloc(DType::f32, {n}), dx = arena.alloc(DType::f32, {n});
  be->write(x, xs.data(), DType::f32);
  const std::vector<float> ones(xs.size(), 1.f);
  be->write(dy, ones.data(), DType::f32);
  be->quick_gelu(y, x);
  be->quick_gelu_backward(dx, dy, x);
  std::vector<float> got_y(xs.size()), got_dx(xs.size());
  be->read(got_y.data(), DType::f32, y);
  be->read(got_dx.data(), DType::f32, dx);
  const auto f = [](double v) { return v / (1.0 + std::exp(-1.702 * v)); };
  for (size_t i = 0; i < xs.size(); ++i) {
    EXPECT_NEAR(got_y[i], f(xs[i]), 1e-6 * (1 + std::fabs(f(xs[i])))) << "x " << xs[i];
    const double h = 1e-4, d = (f(xs[i] + h) - f(xs[i] - h)) / (2 * h);
    EXPECT_NEAR(got_dx[i], d, 1e-5) << "x " << xs[i];
  }
}

TEST_F(BackwardOps, SwigluBackward) {
  const std::pair<int64_t, int64_t> shapes[] = {{7, 128},   {5, 48},   {3, 37},
                                                {17, 6144}, {1, 6144}, {64, 6144}};
  for (const auto& shape : shapes) {
    const int64_t m = shape.first, inter = shape.second;
    compare("swiglu_backward " + dims_str({m, inter}), [&](Side& s) {
      Rng rng(280);
      Tensor gu = s.make(Kind::act, {m, 2 * inter}, rng.normal(m * 2 * inter, 0.f, 2.f));
      Tensor dy = s.make(Kind::act, {m, inter}, rng.normal(m * inter));
      Tensor dgu = s.poisoned(Kind::act, {m, 2 * inter});
      s.be().swiglu_backward(dgu, dy, gu);
      return Outs{{"dgate_up", dgu, kElementwise}};
    });
  }
}

// ---- rows ----

TEST_F(BackwardOps, EmbeddingBackward) {
  struct Case {
    int64_t vocab, hidden, t;
    Kind dy;
    int32_t skip;
  };
  const Case cases[] = {
      {151936, 64, 50, Kind::act, 151655},  // tiny text, image tokens skipped
      {1000, 64, 300, Kind::f32, 7},        // many repeats, f32 dy
      {151936, 2048, 17, Kind::act, -1},    // real dims
      {100, 36, 300, Kind::f32, -1},        // odd hidden, heavy repeats
      {5000, 2048, 64, Kind::act, 3},
  };
  for (const Case& c : cases) {
    compare("embedding_backward " + dims_str({c.vocab, c.hidden, c.t}) + " dy " + kind_name(c.dy) +
                " skip " + std::to_string(c.skip),
            [&](Side& s) {
              Rng rng(290);
              const std::vector<int32_t> ids = ids_with_repeats(rng, c.t, c.vocab, c.skip);
              Tensor ids_t = s.make_i32({c.t}, ids);
              Tensor dy = s.make(c.dy, {c.t, c.hidden}, rng.normal(c.t * c.hidden));
              // Pre-filled about as large as the increments, over the whole table.
              const float scale = std::max(0.01f, std::sqrt(float(c.t) / float(c.vocab)));
              Tensor dtable = s.make(Kind::f32, {c.vocab, c.hidden},
                                     rng.normal(c.vocab * c.hidden, 0.f, scale));
              s.be().embedding_backward(dtable, dy, ids_t, c.skip);
              return Outs{{"dtable", dtable, kF32}};
            });
  }
}

TEST_F(BackwardOps, GatherRows) {
  struct Case {
    int64_t rows, hidden, n;
    Kind src, dst;
  };
  const Case cases[] = {
      {300, 2048, 64, Kind::act, Kind::act},  // text rows
      {50, 64, 10, Kind::f32, Kind::act},     // f32 -> bf16 rounds
      {50, 64, 10, Kind::act, Kind::f32},     // bf16 -> f32 exact
      {1000, 1024, 333, Kind::f32, Kind::f32}, {20, 36, 7, Kind::act, Kind::act},  // odd hidden
      {400, 2048, 256, Kind::f32, Kind::act},
  };
  for (const Case& c : cases) {
    const bool rounds = c.src == Kind::f32 && c.dst == Kind::act;
    compare(
        "gather_rows " + dims_str({c.rows, c.hidden, c.n}) + " " + kind_name(c.src) + "->" +
            kind_name(c.dst),
        [&](Side& s) {
          Rng rng(300);
          // f32 sources hold values bf16 cannot: the conversion must round them.
          const std::vector<float> src_v = c.src == Kind::f32 ? rng.normal_f32(c.rows * c.hidden)
                                                              : rng.normal(c.rows * c.hidden);
          std::vector<int32_t> idx(static_cast<size_t>(c.n));
          for (auto& i : idx) i = rng.integer(0, static_cast<int32_t>(c.rows - 1));
          idx[0] = static_cast<int32_t>(c.rows - 1);
          if (c.n > 2) idx[2] = idx[1];  // a repeated row
          std::vector<float> want(static_cast<size_t>(c.n * c.hidden));
          for (int64_t i = 0; i < c.n; ++i)
            std::copy_n(src_v.begin() + idx[i] * c.hidden, c.hidden, want.begin() + i * c.hidden);
          Tensor src = s.make(c.src, {c.rows, c.hidden}, src_v);
          Tensor idx_t = s.make_i32({c.n}, idx);
          Tensor dst = s.poisoned(c.dst, {c.n, c.hidden});
          s.be().gather_rows(dst, src, idx_t);
          if (rounds) return Outs{{"dst", dst, kElementwise}};
          return Outs{{"dst", dst, kExact, -1, want}};
        });
  }
}

TEST_F(BackwardOps, AddInterpolatedRowsBackward) {
  struct Case {
    int grid;  // the learned grid is grid x grid rows; 0: random indices into 50 rows
    int64_t dim, h, w;
    Kind dy;
  };
  const Case cases[] = {
      {8, 32, 5, 7, Kind::act},       // tiny vision (64 position embeddings)
      {48, 1024, 32, 32, Kind::act},  // real grid (2304 rows), a 32x32-patch image
      {48, 1024, 64, 80, Kind::f32},  // a large image: many patches share table rows
      {48, 1024, 20, 100, Kind::act}, {0, 36, 1, 7, Kind::f32},  // random indices and weights
  };
  for (const Case& c : cases) {
    const int64_t table_rows = c.grid > 0 ? int64_t{c.grid} * c.grid : 50, n = c.h * c.w;
    compare("add_interpolated_rows_backward table " + dims_str({table_rows, c.dim}) + " S " +
                std::to_string(n) + " dy " + kind_name(c.dy),
            [&](Side& s) {
              Rng rng(310);
              std::vector<int32_t> idx(static_cast<size_t>(n * 4));
              std::vector<float> wt(static_cast<size_t>(n * 4));
              if (c.grid > 0) {
                // Bilinear interpolation of the grid at the image's patch centres (linspace).
                const int g = c.grid;
                for (int64_t r = 0; r < c.h; ++r)
                  for (int64_t q = 0; q < c.w; ++q) {
                    const float fy = c.h > 1 ? float(r) * float(g - 1) / float(c.h - 1) : 0.f;
                    const float fx = c.w > 1 ? float(q) * float(g - 1) / float(c.w - 1) : 0.f;
                    const int y0 = static_cast<int>(fy), x0 = static_cast<int>(fx);
                    const int y1 = std::min(y0 + 1, g - 1), x1 = std::min(x0 + 1, g - 1);
                    const float dy = fy - float(y0), dx = fx - float(x0);
                    const int64_t p = (r * c.w + q) * 4;
                    idx[p] = y0 * g + x0, idx[p + 1] = y0 * g + x1;
                    idx[p + 2] = y1 * g + x0, idx[p + 3] = y1 * g + x1;
                    wt[p] = (1 - dy) * (1 - dx), wt[p + 1] = (1 - dy) * dx;
                    wt[p + 2] = dy * (1 - dx), wt[p + 3] = dy * dx;
                  }
              } else {
                for (auto& i : idx) i = rng.integer(0, static_cast<int32_t>(table_rows - 1));
                wt = rng.uniform_f32(n * 4, -1.f, 1.f);
              }
              Tensor idx_t = s.make_i32({n, 4}, idx);
              Tensor w_t = s.make(Kind::f32, {n, 4}, wt);
              Tensor dy = s.make(c.dy, {n, c.dim}, rng.normal(n * c.dim));
              const float scale = std::max(0.05f, std::sqrt(float(n) / float(table_rows)));
              Tensor dtable = s.make(Kind::f32, {table_rows, c.dim},
                                     rng.normal(table_rows * c.dim, 0.f, scale));
              s.be().add_interpolated_rows_backward(dtable, dy, idx_t, w_t);
              return Outs{{"dtable", dtable, kF32}};
            });
  }
}

// ---- lm_head + cross-entropy ----

TEST_F(BackwardOps, LmHeadLoss) {
  struct Case {
    int64_t n, hidden, vocab, chunk;
    float loss0;
    bool dx, dw;
    bool ignore_some = false;  // every third row's target -100 (bucket padding)
  };
  const Case cases[] = {
      {37, 64, 1000, 8, 0.f, true, true},         // chunks of 8, the last one short
      {37, 64, 1000, 8, 1.f, true, true, true},   // ignored rows: no loss, zero dx rows
      {20, 256, 1000, 7, 123.5f, true, false},    // a running loss_sum; lm_head frozen
      {12, 128, 1003, 16, 0.f, true, true},       // one chunk larger than N, odd vocab
      {9, 64, 151936, 4, 2.f, true, true},        // tiny text model: real vocab
      {5, 2048, 151936, 2, 0.f, true, true},      // real dims
      {3, 2048, 151936, 2, 7.25f, false, false},  // loss only (evaluation)
  };
  for (const Case& c : cases) {
    compare(
        "lm_head_loss " + dims_str({c.n, c.hidden, c.vocab}) + " chunk " + std::to_string(c.chunk) +
            " loss0 " + std::to_string(c.loss0) + (c.dx ? " dx" : "") + (c.dw ? " dw" : ""),
        [&](Side& s) {
          Rng rng(320);
          const float gs = 1.f / (1.7f * float(c.n));
          Tensor x = s.make(Kind::act, {c.n, c.hidden}, rng.normal(c.n * c.hidden));
          // Logits of std ~4: a peaked softmax, whose part of the gradient is as large as the
          // one-hot part.
          Tensor w = s.make(Kind::act, {c.vocab, c.hidden},
                            rng.normal(c.vocab * c.hidden, 0.f, 4.f / std::sqrt(float(c.hidden))));
          std::vector<int32_t> tgt(static_cast<size_t>(c.n));
          for (auto& t : tgt) t = rng.integer(0, static_cast<int32_t>(c.vocab - 1));
          tgt[0] = 0, tgt[c.n - 1] = static_cast<int32_t>(c.vocab - 1);
          if (c.ignore_some)
            for (size_t i = 1; i < tgt.size(); i += 3) tgt[i] = -100;
          Tensor tgt_t = s.make_i32({c.n}, tgt);
          Tensor gs_t = s.make(Kind::f32, {1}, {gs});
          Tensor loss = s.make(Kind::f32, {1}, {c.loss0});
          Tensor dx = c.dx ? s.poisoned(Kind::act, {c.n, c.hidden}) : Tensor();
          const float dw_scale = gs * std::sqrt(float(c.n) / float(c.vocab));
          Tensor dw = c.dw ? s.make(Kind::f32, {c.vocab, c.hidden},
                                    rng.normal(c.vocab * c.hidden, 0.f, dw_scale))
                           : Tensor();
          Tensor ws = s.workspace(s.be().lm_head_loss_workspace_bytes(c.chunk, c.hidden, c.vocab));
          s.be().lm_head_loss(loss, dx, dw, x, w, tgt_t, gs_t, ws, c.chunk);
          Outs outs{{"loss_sum", loss, kF32}};
          if (c.dx) outs.push_back({"dx", dx, kLmHead});
          if (c.dw) outs.push_back({"dw", dw, kLmHead});
          return outs;
        });
  }
}

// Ignored rows (negative targets) must be exactly absent: the loss and dw of the labelled rows
// alone, and zero dx rows, so that padding a micro-batch up to a graph bucket changes nothing.
TEST(LmHeadLossIgnoredRows, EqualTheLabelledRowsAlone) {
  auto be = make_cpu_backend();
  const int64_t n = 10, H = 32, V = 50, chunk = 4;
  Rng rng(77);
  const std::vector<float> x = rng.normal(n * H), w = rng.normal(V * H, 0.f, 0.5f);
  std::vector<int32_t> tgt(n);
  for (auto& t : tgt) t = rng.integer(0, static_cast<int32_t>(V - 1));
  std::vector<int64_t> kept;
  for (int64_t i = 0; i < n; ++i)
    if (i % 3 == 1)
      tgt[static_cast<size_t>(i)] = -100;
    else
      kept.push_back(i);
  const int64_t m = static_cast<int64_t>(kept.size());
  std::vector<float> xk, outs_loss(2);
  std::vector<int32_t> tk;
  for (int64_t i : kept) {
    xk.insert(xk.end(), x.begin() + i * H, x.begin() + (i + 1) * H);
    tk.push_back(tgt[static_cast<size_t>(i)]);
  }
  std::vector<std::vector<float>> dx(2), dw(2);
  for (int pass = 0; pass < 2; ++pass) {
    const int64_t rows = pass == 0 ? n : m;
    Arena plan;
    plan.alloc(DType::f32, {rows, H}), plan.alloc(DType::f32, {V, H}),
        plan.alloc(DType::i32, {rows});
    plan.alloc(DType::f32, {1}), plan.alloc(DType::f32, {1}), plan.alloc(DType::f32, {rows, H});
    plan.alloc(DType::f32, {V, H});
    const size_t ws_bytes = be->lm_head_loss_workspace_bytes(chunk, H, V);
    plan.alloc(DType::f32, {static_cast<int64_t>(ws_bytes / 4 + 1)});
    Arena a(*be, plan.used());
    Tensor xt = a.alloc(DType::f32, {rows, H}), wt = a.alloc(DType::f32, {V, H});
    Tensor tt = a.alloc(DType::i32, {rows}), gs = a.alloc(DType::f32, {1});
    Tensor loss = a.alloc(DType::f32, {1}), dxt = a.alloc(DType::f32, {rows, H});
    Tensor dwt = a.alloc(DType::f32, {V, H});
    Tensor ws = a.alloc(DType::f32, {static_cast<int64_t>(ws_bytes / 4 + 1)});
    be->write(xt, (pass == 0 ? x : xk).data(), DType::f32);
    be->write(wt, w.data(), DType::f32);
    be->write(tt, (pass == 0 ? tgt : tk).data(), DType::i32);
    const float one = 1.0f;
    be->write(gs, &one, DType::f32);
    be->fill_zero(loss);
    be->fill_zero(dwt);
    std::vector<float> nan_rows(static_cast<size_t>(rows * H), std::nanf(""));
    be->write(dxt, nan_rows.data(), DType::f32);
    be->lm_head_loss(loss, dxt, dwt, xt, wt, tt, gs, ws, chunk);
    be->read(&outs_loss[pass], DType::f32, loss);
    dx[pass].resize(static_cast<size_t>(rows * H));
    dw[pass].resize(static_cast<size_t>(V * H));
    be->read(dx[pass].data(), DType::f32, dxt);
    be->read(dw[pass].data(), DType::f32, dwt);
  }
  EXPECT_NEAR(outs_loss[0], outs_loss[1], 1e-5 * std::abs(outs_loss[1]));
  for (int64_t i = 0, k = 0; i < n; ++i) {
    for (int64_t h = 0; h < H; ++h) {
      const float got = dx[0][static_cast<size_t>(i * H + h)];
      if (i % 3 == 1)
        ASSERT_EQ(got, 0.0f) << "row " << i;
      else
        ASSERT_NEAR(got, dx[1][static_cast<size_t>(k * H + h)], 1e-6f) << "row " << i;
    }
    if (i % 3 != 1) ++k;
  }
  for (size_t j = 0; j < dw[0].size(); ++j) ASSERT_NEAR(dw[0][j], dw[1][j], 1e-6f) << j;
}

// ---- optimizer ----

// Five tensors in flat f32 buffers, with gaps between them (elements of no tensor, which no op
// may touch or count), and their slices of `weights` in another order with gaps too.
struct FlatLayout {
  struct Entry {
    int64_t numel;
    float weight_decay, lr_scale;
    int64_t step0;
    int64_t offset = 0, woffset = 0;
  };
  std::vector<Entry> t = {
      {1 << 20, 0.1f, 1.0f, 0},  // a large matrix
      {2048, 0.0f, 1.0f, 2},     // a norm weight: no decay, state from earlier steps
      {777, 0.1f, 0.0f, 5},      // frozen
      {3072, 0.1f, 0.5f, 0},     // lr scale 0.5
      {1, 0.1f, 2.0f, 10},       // a single element, lr scale 2
  };
  int64_t flat = 0, wlen = 0;
  static constexpr int kFrozen = 2;

  FlatLayout() {
    for (auto& e : t) e.offset = flat + 3, flat = e.offset + e.numel;
    flat += 3;
    for (size_t i = t.size(); i-- > 0;) t[i].woffset = wlen + 5, wlen = t[i].woffset + t[i].numel;
    wlen += 5;
  }
  int n() const { return static_cast<int>(t.size()); }
  std::vector<int64_t> spans() const {
    std::vector<int64_t> v;
    for (const auto& e : t) v.insert(v.end(), {e.offset, e.numel, e.woffset});
    return v;
  }
  std::vector<float> hyper() const {
    std::vector<float> v;
    for (const auto& e : t) v.insert(v.end(), {e.weight_decay, e.lr_scale});
    return v;
  }
  // Gradients: std 1, the frozen tensor's std 100 and the gaps 1000 (so that counting either in
  // the norm shows).
  std::vector<float> grads(Rng& rng) const {
    std::vector<float> g(static_cast<size_t>(flat), 1000.f);
    for (int i = 0; i < n(); ++i) {
      const std::vector<float> v = rng.normal_f32(t[i].numel, 0.f, i == kFrozen ? 100.f : 1.f);
      std::copy(v.begin(), v.end(), g.begin() + t[i].offset);
    }
    return g;
  }
  std::vector<float> stats(const std::vector<float>& g, float max_norm) const {
    double sq = 0;
    for (int i = 0; i < n(); ++i)
      if (t[i].lr_scale != 0.f)
        for (int64_t j = 0; j < t[i].numel; ++j)
          sq += double(g[t[i].offset + j]) * g[t[i].offset + j];
    const float norm = static_cast<float>(std::sqrt(sq));
    const float coef = max_norm / (norm + 1e-6f);
    return {norm, max_norm > 0.f && coef < 1.f ? coef : 1.f};
  }
};

TEST_F(BackwardOps, GradNormClip) {
  const FlatLayout L;
  for (float max_norm : {0.f, -1.f, 1e9f, 200.f, 1.f}) {
    compare("grad_norm_clip max_norm " + std::to_string(max_norm), [&](Side& s) {
      Rng rng(330);
      const std::vector<float> g = L.grads(rng);
      Tensor grads = s.make(Kind::f32, {L.flat}, g);
      Tensor spans = s.make_i64({L.n(), 3}, L.spans());
      Tensor hyper = s.make(Kind::f32, {L.n(), 2}, L.hyper());
      Tensor stats = s.poisoned(Kind::f32, {2});
      s.be().grad_norm_clip(stats, grads, spans, hyper, max_norm);
      return Outs{{"grad_stats", stats, kOptimizer, -1, L.stats(g, max_norm)},
                  {"grads (read only)", grads, kExact, -1, g}};
    });
  }
}

// The per-span sums a sharded optimizer adds over its shards: on the CPU, added in span order their
// root is grad_norm_clip's norm (a 1 Mi-element span is summed by every thread), and a frozen span
// gives 0. Runs without a GPU.
TEST(CpuOptimizerOps, GradSumSquaresAreTheTermsOfTheNorm) {
  const FlatLayout L;
  auto cpu = make_cpu_backend();
  Rng rng(331);
  std::vector<float> g = L.grads(rng), hyper = L.hyper(), stats(2);
  std::vector<int64_t> spans = L.spans(), sums(static_cast<size_t>(L.n()), -1);
  const Tensor tg(g.data(), DType::f32, Device::cpu, {L.flat});
  const Tensor ts(spans.data(), DType::i64, Device::cpu, {L.n(), 3});
  const Tensor th(hyper.data(), DType::f32, Device::cpu, {L.n(), 2});
  cpu->grad_sum_squares(Tensor(sums.data(), DType::i64, Device::cpu, {L.n()}), tg, ts, th);
  cpu->grad_norm_clip(Tensor(stats.data(), DType::f32, Device::cpu, {2}), tg, ts, th, 0.f);
  double ss = 0.0;
  for (int i = 0; i < L.n(); ++i) {
    double d = 0;
    std::memcpy(&d, &sums[static_cast<size_t>(i)], sizeof(d));
    if (i == FlatLayout::kFrozen) EXPECT_EQ(d, 0.0);
    ss += d;
  }
  EXPECT_EQ(static_cast<float>(std::sqrt(ss)), stats[0]);
  EXPECT_NEAR(stats[0], L.stats(g, 0.f)[0], 1e-3);
}

// The CUDA kernel sums each span in another order than the CPU's threads: equal to the CPU's sums
// to f64 rounding, 0 for the frozen span, and the root of their sum is the CUDA norm.
TEST(CudaOptimizerOps, GradSumSquaresMatchTheCpuAndTheNorm) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  const FlatLayout L;
  auto cpu = make_cpu_backend();
  auto cuda = make_cuda_backend(0);
  Rng rng(331);
  std::vector<float> g = L.grads(rng), hyper = L.hyper();
  std::vector<int64_t> spans = L.spans(), want(static_cast<size_t>(L.n()));
  cpu->grad_sum_squares(Tensor(want.data(), DType::i64, Device::cpu, {L.n()}),
                        Tensor(g.data(), DType::f32, Device::cpu, {L.flat}),
                        Tensor(spans.data(), DType::i64, Device::cpu, {L.n(), 3}),
                        Tensor(hyper.data(), DType::f32, Device::cpu, {L.n(), 2}));
  Arena plan;
  plan.alloc(DType::f32, {L.flat}), plan.alloc(DType::i64, {L.n(), 3});
  plan.alloc(DType::f32, {L.n(), 2}), plan.alloc(DType::i64, {L.n()}), plan.alloc(DType::f32, {2});
  Arena a(*cuda, plan.used());
  const Tensor tg = a.alloc(DType::f32, {L.flat}), ts = a.alloc(DType::i64, {L.n(), 3});
  const Tensor th = a.alloc(DType::f32, {L.n(), 2}), tsum = a.alloc(DType::i64, {L.n()});
  const Tensor tstats = a.alloc(DType::f32, {2});
  cuda->write(tg, g.data(), DType::f32);
  cuda->write(ts, spans.data(), DType::i64);
  cuda->write(th, hyper.data(), DType::f32);
  cuda->grad_sum_squares(tsum, tg, ts, th);
  cuda->grad_norm_clip(tstats, tg, ts, th, 0.f);
  std::vector<int64_t> got(static_cast<size_t>(L.n()));
  float stats[2];
  cuda->read(got.data(), DType::i64, tsum);
  cuda->read(stats, DType::f32, tstats);
  double ss = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    double d = 0, w = 0;
    std::memcpy(&d, &got[i], sizeof(d));
    std::memcpy(&w, &want[i], sizeof(w));
    if (static_cast<int>(i) == FlatLayout::kFrozen)
      EXPECT_EQ(d, 0.0);
    else
      EXPECT_NEAR(d, w, 1e-12 * w) << "span " << i;
    ss += d;
  }
  EXPECT_NEAR(std::sqrt(ss), stats[0], 1e-6 * stats[0]);
}

// Three steps of grad_norm_clip + adamw_step with varying lr (a device scalar written each step)
// and max_norm (clipping, disabled, clipping). The CPU's params are its weights (undefined
// `weights`); on CUDA the bf16 weights must be round_bf16 of the params.
TEST_F(BackwardOps, AdamwStep) {
  const FlatLayout L;
  const float lrs[] = {1e-3f, 3e-3f, 5e-4f};
  const float max_norms[] = {100.f, 0.f, 40.f};
  const float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  compare("adamw_step 3 steps", [&](Side& s) {
    Rng rng(340);
    std::vector<bool> in_span(static_cast<size_t>(L.flat), false);
    for (const auto& e : L.t) std::fill_n(in_span.begin() + e.offset, e.numel, true);
    std::vector<float> p0 = rng.normal_f32(L.flat, 0.f, 0.5f);
    for (int64_t i = 0; i < L.flat; ++i)
      if (!in_span[i]) p0[i] = 777.f;  // gaps: any write there shows
    std::vector<float> m0(static_cast<size_t>(L.flat), 555.f), v0(m0);
    for (const auto& e : L.t) {
      const std::vector<float> a = rng.normal_f32(e.numel, 0.f, 0.01f);
      const std::vector<float> b = rng.normal_f32(e.numel, 0.f, 0.01f);
      for (int64_t j = 0; j < e.numel; ++j) {
        m0[e.offset + j] = e.step0 > 0 ? a[j] : 0.f;
        v0[e.offset + j] = e.step0 > 0 ? b[j] * b[j] : 0.f;
      }
    }
    const std::vector<float> w0 = rng.normal(L.wlen);  // unrelated to the params
    std::vector<int64_t> steps0;
    for (const auto& e : L.t) steps0.push_back(e.step0);

    Tensor params = s.make(Kind::f32, {L.flat}, p0);
    Tensor grads = s.make(Kind::f32, {L.flat}, std::vector<float>(L.flat, 0.f));
    Tensor exp_avg = s.make(Kind::f32, {L.flat}, m0);
    Tensor exp_avg_sq = s.make(Kind::f32, {L.flat}, v0);
    Tensor weights = s.on_cuda() ? s.make(Kind::act, {L.wlen}, w0) : Tensor();
    Tensor spans = s.make_i64({L.n(), 3}, L.spans());
    Tensor hyper = s.make(Kind::f32, {L.n(), 2}, L.hyper());
    Tensor steps = s.make_i64({L.n()}, steps0);
    Tensor lr = s.make(Kind::f32, {1}, {0.f});
    Tensor stats = s.poisoned(Kind::f32, {2});
    Tensor history = s.poisoned(Kind::f32, {3, 2});
    std::vector<float> want_stats;
    for (int k = 0; k < 3; ++k) {
      const std::vector<float> g = L.grads(rng);
      s.be().write(grads, g.data(), DType::f32);
      s.be().write(lr, &lrs[k], DType::f32);
      s.be().grad_norm_clip(stats, grads, spans, hyper, max_norms[k]);
      s.be().adamw_step(params, grads, exp_avg, exp_avg_sq, weights, spans, hyper, steps, lr, stats,
                        beta1, beta2, eps);
      s.be().copy(history.slice(k, k + 1).view({2}), stats);
      const std::vector<float> st = L.stats(g, max_norms[k]);
      want_stats.insert(want_stats.end(), st.begin(), st.end());
    }
    const std::vector<float> p = s.get(params), m = s.get(exp_avg), v = s.get(exp_avg_sq);
    // Elements of no tensor are never touched.
    for (int64_t i = 0; i < L.flat; ++i)
      if (!in_span[i]) {
        EXPECT_EQ(p[i], p0[i]) << s.be().name() << ": params gap element " << i;
        EXPECT_EQ(m[i], m0[i]) << s.be().name() << ": exp_avg gap element " << i;
        EXPECT_EQ(v[i], v0[i]) << s.be().name() << ": exp_avg_sq gap element " << i;
      }
    // The working weights: on CUDA read back; on the CPU (no weights tensor) the same layout
    // built from its params, so that CUDA's bf16 weights are compared with round_bf16 of the CPU's
    // params (the frozen slice and the gaps keep their first values).
    std::vector<float> w_want = w0;
    for (int i = 0; i < L.n(); ++i)
      if (L.t[i].lr_scale != 0.f)
        for (int64_t j = 0; j < L.t[i].numel; ++j)
          w_want[L.t[i].woffset + j] = round_bf16(p[L.t[i].offset + j]);
    Tensor w_out = weights;
    if (s.on_cuda()) {
      EXPECT_TRUE(matches(s.get(weights), w_want, kExact))
          << "CUDA weights are not round_bf16 of CUDA's params (or a gap/frozen slice changed)";
    } else {
      w_out = s.make(Kind::f32, {L.wlen}, w_want);
    }
    Outs outs{{"grad_stats per step", history, kOptimizer, -1, want_stats},
              {"steps", steps, kExact},
              // Whether the clip scales grads in place is the backend's choice (the CPU's does,
              // as torch's clip_grad_norm_); the backends must agree.
              {"grads after the step", grads, kOptimizer},
              {"weights", w_out, kOptimizer}};
    const FlatLayout::Entry& fz = L.t[FlatLayout::kFrozen];
    const auto sub = [](const std::vector<float>& a, int64_t off, int64_t n) {
      return std::vector<float>(a.begin() + off, a.begin() + off + n);
    };
    outs.push_back({"frozen weights", w_out.slice(fz.woffset, fz.woffset + fz.numel), kExact, -1,
                    sub(w0, fz.woffset, fz.numel)});
    std::vector<float> steps_want;
    for (const auto& e : L.t) steps_want.push_back(float(e.step0 + (e.lr_scale != 0.f ? 3 : 0)));
    outs[1].expected = steps_want;
    for (int i = 0; i < L.n(); ++i) {
      const auto& e = L.t[i];
      const std::string tag = " t" + std::to_string(i);
      const bool frozen = e.lr_scale == 0.f;
      // The update itself (final - initial, exact in f64 then rounded once), not the params: an
      // update is ~1e-3 of its param.
      std::vector<float> delta(static_cast<size_t>(e.numel));
      for (int64_t j = 0; j < e.numel; ++j)
        delta[j] = static_cast<float>(double(p[e.offset + j]) - double(p0[e.offset + j]));
      Tensor delta_t = s.make(Kind::f32, {e.numel}, delta);
      outs.push_back({"update" + tag, delta_t, frozen ? kExact : kOptimizer, -1,
                      frozen ? std::vector<float>(e.numel, 0.f) : std::vector<float>{}});
      outs.push_back({"exp_avg" + tag, exp_avg.slice(e.offset, e.offset + e.numel),
                      frozen ? kExact : kOptimizer, -1,
                      frozen ? sub(m0, e.offset, e.numel) : std::vector<float>{}});
      outs.push_back({"exp_avg_sq" + tag, exp_avg_sq.slice(e.offset, e.offset + e.numel),
                      frozen ? kExact : kOptimizer, -1,
                      frozen ? sub(v0, e.offset, e.numel) : std::vector<float>{}});
    }
    outs.push_back({"params", params, kOptimizer});
    return outs;
  });
}

}  // namespace
}  // namespace iris
