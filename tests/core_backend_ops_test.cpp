// Every op of the CUDA backend against the fp32 CPU oracle, in the manner of llama.cpp's
// test-backend-ops: random inputs, rounded to bf16 first so that both backends see the same
// values, several shapes per op (the tiny fixture's dims and the real models'), outputs compared
// by normalised mean squared error, NMSE = sum((gpu - cpu)^2) / sum(cpu^2).
//
// Thresholds. One bf16 rounding of an output has a relative error uniform in +-2^-9, an NMSE of
// about 1.3e-6; a real bug (wrong element, missed key, bad mask) gives 1e-3 or more.
//   exact (bitwise):  copy, fill_zero, embedding, scatter_rows, kv_store, argmax_rows, and the
//                     fused qkv_norm_rope_kv_store against the two CUDA ops it fuses
//   kElementwise 2e-5: add, gelu_tanh, gelu_erf, swiglu (2 roundings), scatter_rows accumulate,
//                      add_interpolated_rows (2), layer_norm, rms_norm (2), linear (output
//                      rounding plus fp32 accumulation-order differences), linear_gelu_tanh,
//                      rms_norm_linear (the normalised rows rounded before the product)
//   kRope 5e-5:       qkv_norm_rope and qkv_norm_rope_kv_store (up to 5 HF-style bf16
//                     roundings on the text path)
//   kChained 5e-5:    the swiglu output of rms_norm_linear (normalised rows, gate/up and silu
//                     each rounded, with the first two errors carried through the product)
//   kAttention 5e-5:  attention_segments, attention_causal (probabilities rounded to bf16 for
//                     the tensor cores, plus the output rounding)
// Outputs must also be finite, and every tensor sits between guard regions of sentinel values
// that must survive the op (out-of-bounds writes).
//
// Skips cleanly where no CUDA device is present (CI, CPU-only builds).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/arena.h"
#include "core/backend.h"
#include "core/dtype.h"
#include "core/moe_ops.h"
#include "core/vision_tables.h"

#ifdef IRIS_WITH_CUDA
#include <cuda_runtime.h>

#include "core/cuda/cuda_backend.h"
#include "core/cuda/cuda_check.h"
#endif

namespace iris {
namespace {

constexpr double kExact = 0.0;
constexpr double kElementwise = 2e-5;
constexpr double kRope = 5e-5;
constexpr double kAttention = 5e-5;
constexpr double kChained = 5e-5;

constexpr int64_t kGuard = 64;         // sentinel elements each side; keeps 16-byte alignment
constexpr float kSentinel = -1232.0f;  // exact in bf16, f32 and i32

enum class Kind { act, f32, i32 };  // act: the backend's compute dtype

int64_t product(const std::vector<int64_t>& dims) {
  return std::accumulate(dims.begin(), dims.end(), int64_t{1}, std::multiplies<int64_t>());
}

class Rng {
 public:
  explicit Rng(uint32_t seed) : gen_(seed) {}
  // bf16-representable normal values, the inputs both backends can hold exactly.
  std::vector<float> normal(int64_t n, float mean = 0.f, float stddev = 1.f) {
    std::normal_distribution<float> d(mean, stddev);
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = round_bf16(d(gen_));
    return v;
  }
  std::vector<float> uniform_f32(int64_t n, float lo, float hi) {
    std::uniform_real_distribution<float> d(lo, hi);
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = d(gen_);
    return v;
  }
  int32_t integer(int32_t lo, int32_t hi) {  // inclusive
    return std::uniform_int_distribution<int32_t>(lo, hi)(gen_);
  }
  std::vector<int32_t> permutation_prefix(int32_t n, int32_t count) {
    std::vector<int32_t> p(static_cast<size_t>(n));
    std::iota(p.begin(), p.end(), 0);
    std::shuffle(p.begin(), p.end(), gen_);
    p.resize(static_cast<size_t>(count));
    return p;
  }

 private:
  std::mt19937 gen_;
};

// One backend's half of a test case: tensors carved from arenas on that backend, each between
// guard regions.
class Side {
 public:
  explicit Side(Backend& be) : be_(be) {}
  Backend& be() { return be_; }

  Tensor make(Kind kind, const std::vector<int64_t>& dims, const std::vector<float>& values) {
    const int64_t n = product(dims);
    EXPECT_EQ(static_cast<int64_t>(values.size()), n) << "test bug: value count";
    Tensor t = guarded(dtype_for(kind), dims);
    if (n > 0) be_.write(t, values.data(), DType::f32);
    return t;
  }
  Tensor make_i64_scalar(int64_t value) {
    Tensor t = guarded(DType::i64, {1});
    be_.write(t, &value, DType::i64);
    return t;
  }
  Tensor make_i32(const std::vector<int64_t>& dims, const std::vector<int32_t>& values) {
    const int64_t n = product(dims);
    EXPECT_EQ(static_cast<int64_t>(values.size()), n) << "test bug: value count";
    Tensor t = guarded(DType::i32, dims);
    if (n > 0) be_.write(t, values.data(), DType::i32);
    return t;
  }

  std::vector<float> get(const Tensor& t) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    be_.read(v.data(), DType::f32, t);
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
    return k == Kind::act ? be_.compute_dtype() : (k == Kind::f32 ? DType::f32 : DType::i32);
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

using Body = std::function<std::vector<Tensor>(Side&)>;

class BackendOps : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!cuda_available()) return;
    cpu_ = make_cpu_backend();
    gpu_ = make_cuda_backend(0);
  }
  static void TearDownTestSuite() {
    gpu_.reset();
    cpu_.reset();
  }
  void SetUp() override {
    if (!gpu_) GTEST_SKIP() << "no CUDA device: the CUDA backend is not exercised here";
  }

  // Runs `body` on the CPU oracle and on the GPU and compares the tensors it returns.
  static void compare(const std::string& what, double threshold, const Body& body) {
    SCOPED_TRACE(what);
    Side cpu(*cpu_), gpu(*gpu_);
    const std::vector<Tensor> ref = body(cpu);
    const std::vector<Tensor> out = body(gpu);
    ASSERT_EQ(ref.size(), out.size());
    for (size_t i = 0; i < ref.size(); ++i) {
      const std::vector<float> got = gpu.get(out[i]), want = cpu.get(ref[i]);
      EXPECT_TRUE(matches(got, want, threshold)) << "output " << i;
      // The margin under each threshold, for the record.
      std::printf("[ nmse     ] %-60s %.2e\n", what.c_str(), nmse_of(got, want));
    }
    EXPECT_TRUE(cpu.guards_intact());
    EXPECT_TRUE(gpu.guards_intact());
  }

  static inline std::unique_ptr<Backend> cpu_, gpu_;
};

std::string dims_str(std::initializer_list<int64_t> d) {
  std::string s;
  for (int64_t v : d) s += (s.empty() ? "" : "x") + std::to_string(v);
  return s;
}

// ---- transfers ----

TEST_F(BackendOps, WriteReadConvertsBetweenHostAndDeviceDtypes) {
  Side gpu(*gpu_);
  Rng rng(1);
  std::vector<float> x = rng.uniform_f32(1000, -50.f, 50.f);
  Tensor b = gpu.make(Kind::act, {1000}, x);  // f32 host -> bf16 device rounds to nearest even
  std::vector<uint16_t> bits(1000);
  gpu_->read(bits.data(), DType::bf16, b);
  const std::vector<float> back = gpu.get(b);
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(bits[i], f32_to_bf16(x[i])) << i;
    ASSERT_EQ(back[i], round_bf16(x[i])) << i;
  }
  Tensor f = gpu.make(Kind::f32, {1000}, x);  // f32 on the device is exact
  EXPECT_EQ(gpu.get(f), x);

  std::vector<int64_t> ids64 = {0, 1, -5, 151935, 2147483647};
  Tensor i32 = gpu.make_i32({5}, {0, 0, 0, 0, 0});
  gpu_->write(i32, ids64.data(), DType::i64);
  std::vector<int64_t> ids_back(5);
  gpu_->read(ids_back.data(), DType::i64, i32);
  EXPECT_EQ(ids_back, ids64);
  const int64_t too_big = int64_t{1} << 40;
  EXPECT_THROW(gpu_->write(i32.slice(0, 1), &too_big, DType::i64), Error);
  EXPECT_TRUE(gpu.guards_intact());
}

TEST_F(BackendOps, WriteReadLargeAndManySmallTransfers) {
  Side gpu(*gpu_);
  Rng rng(2);
  // Larger than the pinned staging buffer: the transfer runs in chunks.
  const int64_t n = 9'000'001;
  const std::vector<float> big = rng.normal(n);
  Tensor t = gpu.make(Kind::act, {n}, big);
  EXPECT_TRUE(matches(gpu.get(t), big, kExact));
  // Many small writes queued without a sync in between must not overwrite each other's staging.
  std::vector<Tensor> small;
  std::vector<std::vector<float>> values;
  for (int i = 0; i < 200; ++i) {
    values.push_back(rng.normal(3000 + i));
    small.push_back(gpu.make(Kind::act, {3000 + i}, values.back()));
  }
  for (int i = 0; i < 200; ++i) ASSERT_TRUE(matches(gpu.get(small[i]), values[i], kExact)) << i;
  EXPECT_TRUE(gpu.guards_intact());
}

// A checkpoint's weights go through write_finite: on CUDA the check runs inside the staging copy
// of each chunk, so a NaN or Inf must be found at its index in whichever chunk it falls, and a
// finite source must arrive as write() would bring it.
TEST_F(BackendOps, WriteFiniteFindsTheFirstNonFiniteElementInAnyChunk) {
  Side gpu(*gpu_);
  Rng rng(4);
  // bf16 to bf16 (the fused copy) and f32 to bf16 (checked, then converted), over more than one
  // 8 MiB staging chunk.
  const int64_t n = 9'000'001;
  const std::vector<float> values = rng.normal(n);
  std::vector<uint16_t> bits(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) bits[size_t(i)] = f32_to_bf16(values[size_t(i)]);
  Tensor dst = gpu.make(Kind::act, {n}, std::vector<float>(size_t(n), 0.f));
  EXPECT_EQ(gpu_->write_finite(dst, bits.data(), DType::bf16), -1);
  std::vector<uint16_t> back(static_cast<size_t>(n));
  gpu_->read(back.data(), DType::bf16, dst);
  EXPECT_EQ(back, bits);
  EXPECT_EQ(gpu_->write_finite(dst, values.data(), DType::f32), -1);
  gpu_->read(back.data(), DType::bf16, dst);
  EXPECT_EQ(back, bits);

  const float inf = std::numeric_limits<float>::infinity(), nan = std::nanf("");
  for (int64_t at : {int64_t{0}, int64_t{4'194'303}, int64_t{4'194'304}, n - 1}) {
    SCOPED_TRACE(at);
    std::vector<uint16_t> bad_bits = bits;
    std::vector<float> bad = values;
    bad[size_t(at)] = at % 2 == 0 ? nan : -inf;
    bad_bits[size_t(at)] = f32_to_bf16(bad[size_t(at)]);
    // A second one later: the first is the one reported.
    if (at + 7 < n) {
      bad[size_t(at + 7)] = inf;
      bad_bits[size_t(at + 7)] = f32_to_bf16(inf);
    }
    ASSERT_EQ(first_non_finite(bad_bits.data(), DType::bf16, n), at);
    EXPECT_EQ(gpu_->write_finite(dst, bad_bits.data(), DType::bf16), at);
    EXPECT_EQ(gpu_->write_finite(dst, bad.data(), DType::f32), at);
  }
  EXPECT_TRUE(gpu.guards_intact());
}

// A checkpoint's load writes every tensor through write_all_finite, which on CUDA spreads the
// blocks over host threads: each write must land whole whichever thread took its blocks, and each
// must report its own first NaN or Inf, not another write's.
TEST_F(BackendOps, WriteAllFiniteLandsEveryWriteAndFindsEachOnesFirstNonFinite) {
  Side gpu(*gpu_);
  Rng rng(5);
  const int64_t big = 9'000'001, small = 1'000;  // big spans several upload blocks
  const std::vector<float> v_big = rng.normal(big), v_f32 = rng.normal(small),
                           v_f16 = rng.normal(small), v_small = rng.normal(small);
  auto bf16_bits = [](const std::vector<float>& v) {
    std::vector<uint16_t> b(v.size());
    for (size_t i = 0; i < v.size(); ++i) b[i] = f32_to_bf16(v[i]);
    return b;
  };
  std::vector<uint16_t> big_bits = bf16_bits(v_big), small_bits = bf16_bits(v_small);
  std::vector<uint16_t> half_bits(v_f16.size()), f16_as_bf16(v_f16.size());
  for (size_t i = 0; i < v_f16.size(); ++i) {
    half_bits[i] = f32_to_f16(v_f16[i]);
    f16_as_bf16[i] = f32_to_bf16(f16_to_f32(half_bits[i]));
  }
  std::vector<Tensor> dst;
  for (int64_t n : {big, small, small, small})
    dst.push_back(gpu.make(Kind::act, {n}, std::vector<float>(size_t(n), 0.f)));
  auto writes = [&] {
    return std::vector<Backend::HostWrite>{{dst[0], big_bits.data(), DType::bf16},
                                           {dst[1], v_f32.data(), DType::f32},
                                           {dst[2], half_bits.data(), DType::f16},
                                           {dst[3], small_bits.data(), DType::bf16}};
  };
  EXPECT_EQ(gpu_->write_all_finite(writes()), std::vector<int64_t>(4, -1));
  const std::vector<std::vector<uint16_t>> expected = {big_bits, bf16_bits(v_f32), f16_as_bf16,
                                                       small_bits};
  for (size_t i = 0; i < dst.size(); ++i) {
    std::vector<uint16_t> back(static_cast<size_t>(dst[i].numel()));
    gpu_->read(back.data(), DType::bf16, dst[i]);
    EXPECT_EQ(back, expected[i]) << "write " << i;
  }

  // In the last block, whose later Inf is not the one reported.
  const int64_t at_big = 8'400'000;
  big_bits[size_t(at_big)] = f32_to_bf16(std::nanf(""));
  big_bits[size_t(big - 1)] = f32_to_bf16(std::numeric_limits<float>::infinity());
  half_bits[17] = f32_to_f16(std::numeric_limits<float>::infinity());
  EXPECT_EQ(gpu_->write_all_finite(writes()), (std::vector<int64_t>{at_big, -1, 17, -1}));
  EXPECT_TRUE(gpu.guards_intact());
}

TEST_F(BackendOps, CopyAndFillZero) {
  for (Kind kind : {Kind::act, Kind::f32, Kind::i32}) {
    for (int64_t n : {int64_t{1}, int64_t{37}, int64_t{4096}, int64_t{100003}}) {
      compare("copy/fill_zero n=" + std::to_string(n), kExact, [&](Side& s) {
        Rng rng(3);
        std::vector<float> v = rng.normal(n, 0.f, 100.f);
        if (kind == Kind::i32)
          for (float& x : v) x = std::round(x);
        Tensor src = s.make(kind, {n}, v);
        Tensor dst = s.make(kind, {n}, std::vector<float>(n, 7.f));
        Tensor zero = s.make(kind, {n}, v);
        s.be().copy(dst, src);
        s.be().fill_zero(zero);
        return std::vector<Tensor>{dst, zero};
      });
    }
  }
}

// ---- GEMM ----

TEST_F(BackendOps, Linear) {
  struct Case {
    int64_t m, n, k;
    bool bias, accumulate;
  };
  const Case cases[] = {
      {5, 64, 32, true, false},        // tiny vision qkv-ish
      {7, 96, 64, false, true},        // tiny text, residual accumulate
      {3, 128, 64, true, true},        // bias and accumulate together
      {3, 1001, 64, true, false},      // odd N: rows not 16-byte multiples
      {300, 3072, 1024, true, false},  // vision qkv
      {50, 1024, 1536, true, false},   // patch embedding
      {64, 2048, 2048, false, false},  // text projection
      {17, 2048, 6144, false, true},   // down_proj into the residual
      {1, 6144, 2048, false, false},   // decode GEMV
      {1, 2048, 6144, false, true},    // decode down_proj: several K groups per warp
      {8, 512, 4096, true, true},      // 8 rows, the most x the GEMV keeps in shared memory
      {4, 300, 1000, true, false},     // K not a multiple of the 256-element slab
      {2, 151, 64, false, true},       // odd N: a warp's second row out of range
  };
  for (const Case& c : cases) {
    compare("linear " + dims_str({c.m, c.n, c.k}) + (c.bias ? " bias" : "") +
                (c.accumulate ? " acc" : ""),
            kElementwise, [&](Side& s) {
              Rng rng(10);
              Tensor x = s.make(Kind::act, {c.m, c.k}, rng.normal(c.m * c.k));
              Tensor w = s.make(Kind::act, {c.n, c.k}, rng.normal(c.n * c.k, 0.f, 0.05f));
              Tensor b = c.bias ? s.make(Kind::act, {c.n}, rng.normal(c.n)) : Tensor();
              Tensor y = s.make(Kind::act, {c.m, c.n}, rng.normal(c.m * c.n));
              s.be().linear(y, x, w, b, c.accumulate);
              return std::vector<Tensor>{y};
            });
  }
}

TEST_F(BackendOps, LinearGeluTanh) {
  struct Case {
    int64_t m, n, k;
    bool bias;
  };
  const Case cases[] = {
      {5, 64, 32, true},        // GEMV, then gelu
      {300, 4096, 1024, true},  // vision fc1 (cuBLASLt GELU_BIAS epilogue)
      {64, 256, 128, false},    // GELU epilogue without bias
  };
  for (const Case& c : cases) {
    compare("linear_gelu_tanh " + dims_str({c.m, c.n, c.k}) + (c.bias ? " bias" : ""), kElementwise,
            [&](Side& s) {
              Rng rng(11);
              Tensor x = s.make(Kind::act, {c.m, c.k}, rng.normal(c.m * c.k));
              Tensor w = s.make(Kind::act, {c.n, c.k}, rng.normal(c.n * c.k, 0.f, 0.05f));
              Tensor b = c.bias ? s.make(Kind::act, {c.n}, rng.normal(c.n)) : Tensor();
              Tensor y = s.make(Kind::act, {c.m, c.n}, rng.normal(c.m * c.n));
              s.be().linear_gelu_tanh(y, x, w, b);
              return std::vector<Tensor>{y};
            });
  }
}

TEST_F(BackendOps, RmsNormLinear) {
  struct Case {
    int64_t m, n, k;
    bool swiglu;
  };
  const Case cases[] = {
      {1, 4096, 2048, false},  // decode input norm + qkv
      {1, 12288, 2048, true},  // decode post norm + gate_up + swiglu
      {3, 96, 256, true},      // a few rows
      {8, 512, 1024, false},   // the most rows the fused kernel takes
      {17, 128, 256, true},    // prefill: the unfused sequence
  };
  for (const Case& c : cases) {
    // The same call checked twice: y and xn at the elementwise bound, act at the chained one.
    for (bool act_only : {false, true}) {
      if (act_only && !c.swiglu) continue;
      compare("rms_norm_linear " + dims_str({c.m, c.n, c.k}) + (c.swiglu ? " swiglu" : "") +
                  (act_only ? " (act)" : ""),
              act_only ? kChained : kElementwise, [&](Side& s) {
                Rng rng(12);
                Tensor x = s.make(Kind::act, {c.m, c.k}, rng.normal(c.m * c.k, 0.f, 2.f));
                Tensor nw = s.make(Kind::act, {c.k}, rng.normal(c.k, 1.f, 0.5f));
                Tensor w = s.make(Kind::act, {c.n, c.k}, rng.normal(c.n * c.k, 0.f, 0.05f));
                Tensor xn = s.make(Kind::act, {c.m, c.k}, rng.normal(c.m * c.k));
                Tensor y = s.make(Kind::act, {c.m, c.n}, rng.normal(c.m * c.n));
                Tensor act = c.swiglu ? s.make(Kind::act, {c.m, c.n / 2}, rng.normal(c.m * c.n / 2))
                                      : Tensor();
                s.be().rms_norm_linear(y, xn, x, nw, 1e-6f, w, Tensor(), act);
                if (act_only) return std::vector<Tensor>{act};
                return std::vector<Tensor>{y, xn};
              });
    }
  }
}

// ---- row-wise normalisation ----

TEST_F(BackendOps, LayerNormAndRmsNorm) {
  const std::pair<int64_t, int64_t> shapes[] = {{5, 32},   {3, 64},   {17, 1024}, {9, 2048},
                                                {4, 4096}, {3, 4608}, {7, 100},   {2, 10000}};
  // Named copies, not a structured binding, wherever a lambda uses them: clang before 16
  // cannot capture a binding (the sanitizer build of scripts/test.sh uses clang).
  for (const auto& shape : shapes) {
    const int64_t rows = shape.first, cols = shape.second;
    for (bool in_place : {false, true}) {
      const std::string tag = dims_str({rows, cols}) + (in_place ? " in place" : "");
      compare("layer_norm " + tag, kElementwise, [&](Side& s) {
        Rng rng(20);
        // A mean far from zero checks that the variance is not E[x^2] - mean^2.
        Tensor x = s.make(Kind::act, {rows, cols}, rng.normal(rows * cols, 3.f, 1.f));
        Tensor w = s.make(Kind::act, {cols}, rng.normal(cols, 1.f, 0.5f));
        Tensor b = s.make(Kind::act, {cols}, rng.normal(cols, 0.f, 0.1f));
        Tensor y = in_place ? x : s.make(Kind::act, {rows, cols}, rng.normal(rows * cols));
        s.be().layer_norm(y, x, w, b, 1e-6f);
        return std::vector<Tensor>{y};
      });
      compare("rms_norm " + tag, kElementwise, [&](Side& s) {
        Rng rng(21);
        Tensor x = s.make(Kind::act, {rows, cols}, rng.normal(rows * cols, 0.f, 2.f));
        Tensor w = s.make(Kind::act, {cols}, rng.normal(cols, 1.f, 0.5f));
        Tensor y = in_place ? x : s.make(Kind::act, {rows, cols}, rng.normal(rows * cols));
        s.be().rms_norm(y, x, w, 1e-6f);
        return std::vector<Tensor>{y};
      });
    }
  }
}

// ---- elementwise ----

TEST_F(BackendOps, AddAndGelu) {
  for (int64_t n : {int64_t{160}, int64_t{18432}, int64_t{1000003}}) {
    for (bool in_place : {false, true}) {
      const std::string tag = std::to_string(n) + (in_place ? " in place" : "");
      compare("add " + tag, kElementwise, [&](Side& s) {
        Rng rng(30);
        Tensor a = s.make(Kind::act, {n}, rng.normal(n));
        Tensor b = s.make(Kind::act, {n}, rng.normal(n));
        Tensor y = in_place ? a : s.make(Kind::act, {n}, rng.normal(n));
        s.be().add(y, a, b);
        return std::vector<Tensor>{y};
      });
      // f32 operands (gradients) add exactly as the CPU does.
      compare("add f32 " + tag, kExact, [&](Side& s) {
        Rng rng(32);
        Tensor a = s.make(Kind::f32, {n}, rng.normal(n));
        Tensor b = s.make(Kind::f32, {n}, rng.normal(n));
        Tensor y = in_place ? a : s.make(Kind::f32, {n}, rng.normal(n));
        s.be().add(y, a, b);
        return std::vector<Tensor>{y};
      });
      compare("gelu_tanh " + tag, kElementwise, [&](Side& s) {
        Rng rng(31);
        Tensor x = s.make(Kind::act, {n}, rng.normal(n, 0.f, 3.f));
        Tensor y = in_place ? x : s.make(Kind::act, {n}, rng.normal(n));
        s.be().gelu_tanh(y, x);
        return std::vector<Tensor>{y};
      });
      compare("gelu_erf " + tag, kElementwise, [&](Side& s) {
        Rng rng(32);
        Tensor x = s.make(Kind::act, {n}, rng.normal(n, 0.f, 3.f));
        Tensor y = in_place ? x : s.make(Kind::act, {n}, rng.normal(n));
        s.be().gelu_erf(y, x);
        return std::vector<Tensor>{y};
      });
    }
  }
}

// Dropout keeps and drops the same elements on both backends (the draw is integer arithmetic), in
// place and out of place, and a negative seed copies.
TEST_F(BackendOps, Dropout) {
  for (int64_t seed : {int64_t{987654321}, int64_t{-1}}) {
    for (bool in_place : {false, true}) {
      compare("dropout seed " + std::to_string(seed) + (in_place ? " in place" : ""), kElementwise,
              [&](Side& s) {
                Rng rng(150);
                const int64_t n = 100003;
                Tensor x = s.make(Kind::act, {n}, rng.normal(n));
                Tensor y = in_place ? x : s.make(Kind::act, {n}, rng.normal(n));
                Tensor sd = s.make_i64_scalar(seed);
                s.be().dropout(y, x, 0.1f, sd, 5);
                return std::vector<Tensor>{y};
              });
    }
  }
}

// A column block into and out of a wider matrix, in every dtype pairing the adapters use.
TEST_F(BackendOps, AddColumnBlock) {
  // A block of 12 at 20 takes the CUDA kernel's element path, 24 at 16 its 8-wide path.
  const int64_t rows = 37, wide = 48;
  for (const auto& block : {std::pair<int64_t, int64_t>{12, 20}, {24, 16}})
    for (bool accumulate : {true, false}) {
      // Plain locals: clang before 16 does not let a lambda capture a structured binding.
      const int64_t narrow = block.first, at = block.second;
      for (Kind dst_kind : {Kind::act, Kind::f32}) {
        const std::string tag = std::string(accumulate ? "accumulate" : "overwrite") +
                                (dst_kind == Kind::f32 ? " f32 " : " ") + std::to_string(narrow) +
                                " at " + std::to_string(at);
        compare("add_column_block into " + tag, kElementwise, [&](Side& s) {
          Rng rng(140);
          Tensor dst = s.make(dst_kind, {rows, wide}, rng.normal(rows * wide));
          Tensor src = s.make(Kind::act, {rows, narrow}, rng.normal(rows * narrow));
          s.be().add_column_block(dst, at, src, 0, narrow, 1.75f, accumulate);
          return std::vector<Tensor>{dst};
        });
        compare("add_column_block out of " + tag, kElementwise, [&](Side& s) {
          Rng rng(141);
          Tensor src = s.make(Kind::act, {rows, wide}, rng.normal(rows * wide));
          Tensor dst = s.make(dst_kind, {rows, narrow}, rng.normal(rows * narrow));
          s.be().add_column_block(dst, 0, src, at, narrow, -0.5f, accumulate);
          return std::vector<Tensor>{dst};
        });
      }
    }
  // Out of range and overlapping blocks are refused by every backend.
  for (Backend* be : {cpu_.get(), gpu_.get()}) {
    Arena a(*be, 1 << 16);
    Tensor x = a.alloc(be->compute_dtype(), {4, 8}), y = a.alloc(be->compute_dtype(), {4, 4});
    EXPECT_THROW(be->add_column_block(x, 6, y, 0, 4, 1.0f, true), Error);
    EXPECT_THROW(be->add_column_block(x, 0, x, 4, 4, 1.0f, true), Error);
  }
}

TEST_F(BackendOps, SwiGlu) {
  const std::pair<int64_t, int64_t> shapes[] = {{5, 48}, {9, 3072}, {3, 37}, {1, 6144}};
  for (const auto& shape : shapes) {
    const int64_t m = shape.first, inter = shape.second;
    compare("swiglu " + dims_str({m, inter}), kElementwise, [&](Side& s) {
      Rng rng(40);
      Tensor gu = s.make(Kind::act, {m, 2 * inter}, rng.normal(m * 2 * inter, 0.f, 2.f));
      Tensor y = s.make(Kind::act, {m, inter}, rng.normal(m * inter));
      s.be().swiglu(y, gu);
      return std::vector<Tensor>{y};
    });
  }
}

// ---- q/k norm + RoPE ----

TEST_F(BackendOps, QkvNormRope) {
  struct Case {
    int64_t t;
    int nq, nkv, hd;
    bool q_norm, k_norm, round_tables;
  };
  const Case cases[] = {
      {6, 4, 2, 16, true, true, true},        // tiny text
      {10, 2, 2, 16, false, false, false},    // tiny vision
      {5, 4, 2, 16, true, false, true},       // q norm only
      {37, 16, 8, 128, true, true, true},     // text, real dims
      {50, 16, 16, 72, false, false, false},  // vision hd 72
      {40, 16, 16, 64, false, false, false},  // vision hd 64
  };
  for (const Case& c : cases) {
    compare(
        "qkv_norm_rope T=" + std::to_string(c.t) + " " + std::to_string(c.nq) + "/" +
            std::to_string(c.nkv) + " hd " + std::to_string(c.hd) +
            (c.round_tables ? " bf16 tables" : " f32 tables"),
        kRope, [&](Side& s) {
          Rng rng(50);
          const int64_t width = int64_t{c.nq + 2 * c.nkv} * c.hd;
          Tensor qkv = s.make(Kind::act, {c.t, width}, rng.normal(c.t * width, 0.f, 2.f));
          Tensor qn = c.q_norm ? s.make(Kind::act, {c.hd}, rng.normal(c.hd, 1.f, 0.3f)) : Tensor();
          Tensor kn = c.k_norm ? s.make(Kind::act, {c.hd}, rng.normal(c.hd, 1.f, 0.3f)) : Tensor();
          // Real tables: positions times inverse frequencies, cos/sin of concat(f, f).
          std::vector<float> cs(c.t * c.hd), sn(c.t * c.hd);
          for (int64_t p = 0; p < c.t; ++p)
            for (int i = 0; i < c.hd / 2; ++i) {
              const float f = float(p * 7 + 3) * std::pow(10000.f, -2.f * i / c.hd);
              cs[p * c.hd + i] = cs[p * c.hd + i + c.hd / 2] = std::cos(f);
              sn[p * c.hd + i] = sn[p * c.hd + i + c.hd / 2] = std::sin(f);
            }
          Tensor cos_t = s.make(Kind::f32, {c.t, c.hd}, cs);
          Tensor sin_t = s.make(Kind::f32, {c.t, c.hd}, sn);
          s.be().qkv_norm_rope(qkv, qn, kn, 1e-6f, cos_t, sin_t, c.nq, c.nkv, c.hd, c.round_tables);
          return std::vector<Tensor>{qkv};
        });
  }
}

// ---- attention ----

TEST_F(BackendOps, AttentionSegments) {
  struct Case {
    std::vector<int32_t> lengths;
    int heads, hd;
  };
  // Kernels as pick_segment_kernel chooses them on an H100 (132 SMs): the grouped kernel with 32
  // rows x 4 key groups (the first five), with 128 rows x 2 key groups (the next four), the
  // 64-row kernel for many short segments, and the wide kernel (the last three) -- except that
  // an sm_90a build runs every head_dim-64 case on the wgmma kernel, whose 128-key tiles and
  // two alternating probability sets the last case works through (1, 2, 3 and 6 tiles).
  const Case cases[] = {
      {{5, 0, 32, 63}, 2, 16},     // tiny vision, a zero-length segment
      {{64, 0, 200, 37}, 16, 64},  // a segment of exactly one tile
      {{256, 130}, 16, 72},        // hd 72: padded to 80 in shared memory only
      {{100, 1, 90, 0}, 4, 80},    // one-row segment, trailing empty segment
      {{256}, 16, 64},             // one small image: a key tile per warp
      {{784}, 16, 64},             // 128 rows x 2 key groups: 13 key tiles, 7 and 6 per group
      {{900, 20, 700}, 8, 80},     // 128-row blocks with idle row groups, hd 80
      {{600, 424}, 8, 72},         // 128-row blocks, hd 72
      {{1024}, 16, 64},            // 128 rows x 2 key groups, 16 key tiles
      {std::vector<int32_t>(20, 200), 16, 64},  // many short segments: the 64-row kernel
      // The wide kernel:
      {{600, 600, 600}, 24, 64},        // vision-like segments
      {{700, 0, 900, 300}, 16, 80},     // hd 80 (odd k-step count), an empty segment
      {{520, 530}, 32, 72},             // hd 72 padded to 80
      {{129, 1, 383, 0, 700}, 16, 64},  // segment ends inside 128-key tiles
      {{2100}, 4, 72},                  // a large hd-72 image: the wgmma kernel's 16-column tail
  };
  for (const Case& c : cases) {
    std::vector<int32_t> cu = {0};
    for (int32_t len : c.lengths) cu.push_back(cu.back() + len);
    const int64_t rows = cu.back(), hidden = int64_t{c.heads} * c.hd;
    compare("attention_segments S=" + std::to_string(rows) + " heads " + std::to_string(c.heads) +
                " hd " + std::to_string(c.hd),
            kAttention, [&](Side& s) {
              Rng rng(60);
              Tensor qkv = s.make(Kind::act, {rows, 3 * hidden}, rng.normal(rows * 3 * hidden));
              Tensor cu_t = s.make_i32({static_cast<int64_t>(cu.size())}, cu);
              Tensor out = s.make(Kind::act, {rows, hidden}, rng.normal(rows * hidden));
              s.be().attention_segments(out, qkv, cu_t, static_cast<int>(c.lengths.size()), c.heads,
                                        c.hd, 1.f / std::sqrt(float(c.hd)), Tensor());
              return std::vector<Tensor>{out};
            });
  }
}

// Keys past a segment's end inside its last key tile belong to the next image. Their weight is
// exactly 0, but 0 * inf is NaN on the tensor cores, so a kernel must not multiply them at all:
// with the next image's V rows infinite (or NaN), this image's rows still match the oracle.
TEST_F(BackendOps, AttentionSegmentsIgnoreNonFiniteNeighbours) {
  struct Case {
    std::vector<int32_t> lengths;
    int heads, hd;
  };
  const Case cases[] = {
      // head_dim 64 takes the wgmma kernel (TMA tiles) on sm_90a, the grouped one elsewhere;
      // the first image ends inside a 128-key tile
      {{200, 300}, 16, 64},  {{100, 156}, 4, 64},
      {{700, 324}, 16, 72},   // grouped kernel, 128-row blocks
      {{300, 200}, 4, 72},    // grouped kernel, 32-row blocks
      {{2100, 2100}, 4, 72},  // wgmma kernel at head_dim 72 (2048+ rows per segment)
      {{600, 600}, 24, 72},   // wide kernel
  };
  for (const Case& c : cases) {
    const int32_t first = c.lengths[0];
    const int64_t rows = first + c.lengths[1], hidden = int64_t{c.heads} * c.hd;
    Rng rng(62);
    std::vector<float> qkv_v = rng.normal(rows * 3 * hidden);
    for (int64_t r = first; r < rows; ++r)
      for (int64_t i = 0; i < hidden; ++i)
        qkv_v[r * 3 * hidden + 2 * hidden + i] =
            (i % 2 == 0) ? INFINITY : std::numeric_limits<float>::quiet_NaN();
    const std::vector<int32_t> cu = {0, first, static_cast<int32_t>(rows)};
    compare(
        "attention_segments beside non-finite V, S=" + std::to_string(rows) + " heads " +
            std::to_string(c.heads) + " hd " + std::to_string(c.hd),
        kAttention, [&](Side& s) {
          Tensor qkv = s.make(Kind::act, {rows, 3 * hidden}, qkv_v);
          Tensor cu_t = s.make_i32({3}, cu);
          Tensor out = s.make(Kind::act, {rows, hidden}, std::vector<float>(rows * hidden, 0.f));
          s.be().attention_segments(out, qkv, cu_t, 2, c.heads, c.hd, 1.f / std::sqrt(float(c.hd)),
                                    Tensor());
          return std::vector<Tensor>{out.slice(0, first)};  // the finite image only
        });
  }
}

// A vision call padded up to a graph bucket passes its real patch count: the padding segment
// (which starts there) comes out as zeros, on every kernel the shapes select.
TEST_F(BackendOps, AttentionSegmentsZeroThePaddingSegment) {
  struct Case {
    std::vector<int32_t> lengths;  // the last one is the padding
    int heads, hd;
  };
  const Case cases[] = {
      {{100, 37, 91}, 4, 64},    // grouped kernel, 32-row blocks
      {{256, 130}, 16, 72},      // grouped kernel, 32-row blocks, hd 72
      {{600, 600, 336}, 8, 64},  // grouped kernel, 128-row blocks
      {{700, 324}, 16, 64},      // grouped kernel, 128-row blocks
      {{200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 300}, 16, 64},  // 64-row kernel
      {{600, 600, 600, 300}, 24, 64},                                     // wide kernel
      {{520, 530, 0, 0, 250}, 32, 72},  // wide kernel, empty segments before the padding
      {{1000, 24}, 16, 64},             // a 1024-row bucket (wgmma kernel on sm_90a)
  };
  for (const Case& c : cases) {
    std::vector<int32_t> cu = {0};
    for (int32_t len : c.lengths) cu.push_back(cu.back() + len);
    const int32_t real = cu[cu.size() - 2];
    const int64_t rows = cu.back(), hidden = int64_t{c.heads} * c.hd;
    compare("attention_segments padded S=" + std::to_string(rows) + " real " +
                std::to_string(real) + " heads " + std::to_string(c.heads) + " hd " +
                std::to_string(c.hd),
            kAttention, [&](Side& s) {
              Rng rng(61);
              Tensor qkv = s.make(Kind::act, {rows, 3 * hidden}, rng.normal(rows * 3 * hidden));
              Tensor cu_t = s.make_i32({static_cast<int64_t>(cu.size())}, cu);
              Tensor real_t = s.make_i32({1}, {real});
              Tensor out = s.make(Kind::act, {rows, hidden}, rng.normal(rows * hidden));
              s.be().attention_segments(out, qkv, cu_t, static_cast<int>(c.lengths.size()), c.heads,
                                        c.hd, 1.f / std::sqrt(float(c.hd)), real_t);
              return std::vector<Tensor>{out};
            });
  }
}

struct CausalCase {
  int nq, nkv, hd;
  int64_t max_len, past, t;
};

std::string causal_name(const CausalCase& c) {
  return std::to_string(c.nq) + "/" + std::to_string(c.nkv) + " hd " + std::to_string(c.hd) +
         " past " + std::to_string(c.past) + " T " + std::to_string(c.t) + " max " +
         std::to_string(c.max_len);
}

// Caches hold random history below past_len and loud values past the new rows: if a kernel
// reads beyond the causal limit, those dominate its softmax.
std::vector<float> cache_values(Rng& rng, const CausalCase& c) {
  const int64_t width = int64_t{c.nkv} * c.hd;
  std::vector<float> v = rng.normal(c.max_len * width);
  for (int64_t r = c.past + c.t; r < c.max_len; ++r)
    for (int64_t i = 0; i < width; ++i) v[r * width + i] = 40.f;
  return v;
}

TEST_F(BackendOps, KvStore) {
  const CausalCase cases[] = {{4, 2, 16, 32, 5, 7},
                              {16, 8, 128, 300, 100, 33},
                              {16, 8, 128, 300, 299, 1},
                              {4, 2, 16, 32, 0, 32}};
  for (const CausalCase& c : cases) {
    compare("kv_store " + causal_name(c), kExact, [&](Side& s) {
      Rng rng(70);
      const int64_t width = int64_t{c.nkv} * c.hd, qkv_w = int64_t{c.nq + 2 * c.nkv} * c.hd;
      Tensor qkv = s.make(Kind::act, {c.t, qkv_w}, rng.normal(c.t * qkv_w));
      Tensor kc = s.make(Kind::act, {c.max_len, width}, cache_values(rng, c));
      Tensor vc = s.make(Kind::act, {c.max_len, width}, cache_values(rng, c));
      Tensor past = s.make_i32({1}, {static_cast<int32_t>(c.past)});
      s.be().kv_store(kc, vc, qkv, past, c.nq, c.nkv, c.hd);
      return std::vector<Tensor>{kc, vc};
    });
  }
}

// The fused op against the CPU's two-op reference, and on the GPU bit for bit against the two
// separate kernels it replaces (the decode path depends on both giving the same cache).
TEST_F(BackendOps, QkvNormRopeKvStore) {
  const CausalCase cases[] = {{4, 2, 16, 32, 5, 7},       // tiny
                              {16, 8, 128, 300, 100, 1},  // decode step
                              {16, 8, 128, 300, 0, 37},   // prefill
                              {16, 8, 128, 300, 295, 5},  // up to the last cache row
                              {8, 4, 64, 128, 20, 3}};    // hd 64
  for (const CausalCase& c : cases) {
    const int64_t width = int64_t{c.nkv} * c.hd, qkv_w = int64_t{c.nq + 2 * c.nkv} * c.hd;
    struct Made {
      Tensor qkv, kc, vc, past, qn, kn, cos_t, sin_t;
    };
    auto make = [&](Side& s) {
      Rng rng(75);
      Made m;
      m.qkv = s.make(Kind::act, {c.t, qkv_w}, rng.normal(c.t * qkv_w, 0.f, 2.f));
      m.kc = s.make(Kind::act, {c.max_len, width}, cache_values(rng, c));
      m.vc = s.make(Kind::act, {c.max_len, width}, cache_values(rng, c));
      m.past = s.make_i32({1}, {static_cast<int32_t>(c.past)});
      m.qn = s.make(Kind::act, {c.hd}, rng.normal(c.hd, 1.f, 0.3f));
      m.kn = s.make(Kind::act, {c.hd}, rng.normal(c.hd, 1.f, 0.3f));
      std::vector<float> cs(c.t * c.hd), sn(c.t * c.hd);
      for (int64_t p = 0; p < c.t; ++p)
        for (int i = 0; i < c.hd / 2; ++i) {
          const float f = float(c.past + p) * std::pow(5e6f, -2.f * i / c.hd);
          cs[p * c.hd + i] = cs[p * c.hd + i + c.hd / 2] = std::cos(f);
          sn[p * c.hd + i] = sn[p * c.hd + i + c.hd / 2] = std::sin(f);
        }
      m.cos_t = s.make(Kind::f32, {c.t, c.hd}, cs);
      m.sin_t = s.make(Kind::f32, {c.t, c.hd}, sn);
      return m;
    };
    compare("qkv_norm_rope_kv_store " + causal_name(c), kRope, [&](Side& s) {
      Made m = make(s);
      s.be().qkv_norm_rope_kv_store(m.qkv, m.qn, m.kn, 1e-6f, m.cos_t, m.sin_t, c.nq, c.nkv, c.hd,
                                    true, m.kc, m.vc, m.past);
      return std::vector<Tensor>{m.qkv, m.kc, m.vc};
    });
    Side gpu(*gpu_);
    Made fused = make(gpu), separate = make(gpu);
    gpu_->qkv_norm_rope_kv_store(fused.qkv, fused.qn, fused.kn, 1e-6f, fused.cos_t, fused.sin_t,
                                 c.nq, c.nkv, c.hd, true, fused.kc, fused.vc, fused.past);
    gpu_->qkv_norm_rope(separate.qkv, separate.qn, separate.kn, 1e-6f, separate.cos_t,
                        separate.sin_t, c.nq, c.nkv, c.hd, true);
    gpu_->kv_store(separate.kc, separate.vc, separate.qkv, separate.past, c.nq, c.nkv, c.hd);
    EXPECT_TRUE(matches(gpu.get(fused.qkv), gpu.get(separate.qkv), kExact)) << causal_name(c);
    EXPECT_TRUE(matches(gpu.get(fused.kc), gpu.get(separate.kc), kExact)) << causal_name(c);
    EXPECT_TRUE(matches(gpu.get(fused.vc), gpu.get(separate.vc), kExact)) << causal_name(c);
    EXPECT_TRUE(gpu.guards_intact());
  }
}

// On sm_90a builds every head_dim-128 case with more than one token runs on the wgmma kernel
// (64-key tiles; causal masks inside and across tiles, cached prefixes, groups 1 to 8); the
// cases named after the wide kernel keep covering it elsewhere.
TEST_F(BackendOps, AttentionCausal) {
  const CausalCase cases[] = {
      {4, 2, 16, 64, 0, 7},           // tiny prefill
      {4, 2, 16, 64, 5, 3},           // tiny continuation
      {4, 2, 16, 64, 20, 1},          // tiny decode
      {16, 8, 128, 512, 0, 100},      // prefill
      {16, 8, 128, 512, 40, 33},      // chunked prefill
      {16, 8, 128, 200, 0, 1},        // first token
      {16, 8, 128, 4096, 1000, 1},    // decode, 1k context
      {16, 8, 128, 4096, 4000, 1},    // decode, 4k context
      {32, 8, 128, 2048, 2047, 1},    // decode filling the cache, group 4
      {64, 8, 128, 1024, 700, 1},     // group 8
      {8, 8, 128, 512, 100, 1},       // no GQA
      {8, 4, 64, 512, 300, 1},        // decode hd 64
      {8, 4, 64, 512, 63, 1},         // decode: one split (its block writes the output)
      {8, 4, 64, 512, 64, 1},         // decode: the first length with two splits
      {72, 72, 16, 256, 100, 1},      // more kv heads than decode tickets: the flash kernel
      {4, 2, 72, 128, 50, 1},         // single token through the prefill kernel (hd 72)
      {16, 8, 128, 512, 0, 200},      // several query tiles
      {64, 8, 128, 1024, 0, 700},     // wide kernel: long prefill
      {32, 8, 128, 2048, 300, 1100},  // wide kernel: chunked prefill after a cached prefix
      {32, 4, 64, 1200, 17, 1100},    // wide kernel, hd 64
  };
  for (const CausalCase& c : cases) {
    compare("attention_causal " + causal_name(c), kAttention, [&](Side& s) {
      Rng rng(80);
      const int64_t width = int64_t{c.nkv} * c.hd, qkv_w = int64_t{c.nq + 2 * c.nkv} * c.hd;
      Tensor qkv = s.make(Kind::act, {c.t, qkv_w}, rng.normal(c.t * qkv_w));
      Tensor kc = s.make(Kind::act, {c.max_len, width}, cache_values(rng, c));
      Tensor vc = s.make(Kind::act, {c.max_len, width}, cache_values(rng, c));
      Tensor past = s.make_i32({1}, {static_cast<int32_t>(c.past)});
      Tensor out = s.make(Kind::act, {c.t, int64_t{c.nq} * c.hd}, rng.normal(c.t * c.nq * c.hd));
      s.be().kv_store(kc, vc, qkv, past, c.nq, c.nkv, c.hd);
      // Twice: a decode call must leave its split-merge state (CUDA tickets) ready for the next.
      for (int rep = 0; rep < 2; ++rep)
        s.be().attention_causal(out, qkv, kc, vc, past, c.nq, c.nkv, c.hd,
                                1.f / std::sqrt(float(c.hd)));
      return std::vector<Tensor>{out};
    });
  }
}

// Cache rows past the causal limit may hold anything (a previous, longer sequence; memory never
// written). Keys there get weight 0, but 0 * NaN is NaN: the prefill kernels must keep them out
// of the product, not only out of the softmax.
TEST_F(BackendOps, AttentionCausalIgnoresNonFiniteCacheRowsPastTheLimit) {
  const CausalCase cases[] = {
      {16, 8, 128, 512, 0, 100},      // prefill ending inside a key tile
      {16, 8, 128, 512, 40, 33},      // chunked prefill
      {32, 8, 128, 2048, 300, 1100},  // several query tiles after a cached prefix
      {4, 2, 16, 64, 5, 3},           // the mma.sync kernels
  };
  for (const CausalCase& c : cases) {
    compare("attention_causal beside non-finite cache rows " + causal_name(c), kAttention,
            [&](Side& s) {
              Rng rng(81);
              const int64_t width = int64_t{c.nkv} * c.hd, qkv_w = int64_t{c.nq + 2 * c.nkv} * c.hd;
              std::vector<float> cache = cache_values(rng, c);
              for (int64_t i = (c.past + c.t) * width; i < c.max_len * width; ++i)
                cache[i] = (i % 2 == 0) ? std::numeric_limits<float>::quiet_NaN() : INFINITY;
              Tensor qkv = s.make(Kind::act, {c.t, qkv_w}, rng.normal(c.t * qkv_w));
              Tensor kc = s.make(Kind::act, {c.max_len, width}, cache);
              Tensor vc = s.make(Kind::act, {c.max_len, width}, cache);
              Tensor past = s.make_i32({1}, {static_cast<int32_t>(c.past)});
              Tensor out = s.make(Kind::act, {c.t, int64_t{c.nq} * c.hd},
                                  std::vector<float>(c.t * c.nq * c.hd, 0.f));
              s.be().kv_store(kc, vc, qkv, past, c.nq, c.nkv, c.hd);
              s.be().attention_causal(out, qkv, kc, vc, past, c.nq, c.nkv, c.hd,
                                      1.f / std::sqrt(float(c.hd)));
              return std::vector<Tensor>{out};
            });
  }
}

// ---- gathers, scatters, reductions ----

TEST_F(BackendOps, Embedding) {
  const std::tuple<int64_t, int64_t, int64_t> cases[] = {
      {1000, 64, 9}, {5000, 2048, 17}, {100, 36, 5}, {151, 32, 1}};
  for (const auto& c : cases) {
    const int64_t vocab = std::get<0>(c), hidden = std::get<1>(c), n = std::get<2>(c);
    compare("embedding " + dims_str({vocab, hidden, n}), kExact, [&](Side& s) {
      Rng rng(90);
      Tensor table = s.make(Kind::act, {vocab, hidden}, rng.normal(vocab * hidden));
      std::vector<int32_t> ids(n);
      for (auto& id : ids) id = rng.integer(0, static_cast<int32_t>(vocab - 1));
      ids[0] = static_cast<int32_t>(vocab - 1);
      Tensor ids_t = s.make_i32({n}, ids);
      Tensor y = s.make(Kind::act, {n, hidden}, rng.normal(n * hidden));
      s.be().embedding(y, table, ids_t);
      return std::vector<Tensor>{y};
    });
  }
}

// The rows of image bytes the CUDA kernel writes equal the CPU op's: exactly in f32, and in the
// compute dtype as the host's round to nearest even of the same values (what a write of host rows
// gave before images went up as bytes). Sizes: a 448 image (Qwen3-VL), a 14-pixel-patch image
// with CLIP statistics (Qwen2.5-VL), and a two-frame temporal slice; rows scattered backwards.
TEST_F(BackendOps, ImagePatches) {
  struct Case {
    int height, width, patch, frames;
    float mean, stdv;
  };
  const Case cases[] = {{448, 448, 16, 1, 127.5f, 127.5f},
                        {84, 140, 14, 1, 0.48145466f * 255.f, 0.26862954f * 255.f},
                        {64, 96, 16, 2, 127.5f, 127.5f}};
  for (const Case& c : cases) {
    ImagePatchGeometry g;
    g.height = c.height;
    g.width = c.width;
    g.patch_size = c.patch;
    const int64_t n = g.patches(), cols = g.row_values();
    std::mt19937 gen(7);
    std::vector<uint8_t> bytes(static_cast<size_t>(c.frames) * c.height * c.width * 3);
    for (uint8_t& b : bytes) b = static_cast<uint8_t>(gen() & 0xff);
    std::vector<float> table(768);
    for (int i = 0; i < 768; ++i) table[i] = (float(i % 256) - c.mean) / c.stdv;
    std::vector<int32_t> where(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) where[static_cast<size_t>(i)] = static_cast<int32_t>(n - 1 - i);
    auto run = [&](Backend& be, DType out_dtype) {
      Arena a(be, size_t{64} << 20);
      const Tensor frames = a.alloc(DType::u8, {static_cast<int64_t>(bytes.size())});
      be.write(frames, bytes.data(), DType::u8);
      const Tensor table_t = a.alloc(DType::f32, {768});
      be.write(table_t, table.data(), DType::f32);
      const Tensor where_t = a.alloc(DType::i32, {n});
      be.write(where_t, where.data(), DType::i32);
      const Tensor dst = a.alloc(out_dtype, {n, cols});
      be.image_patches(dst, frames, table_t, where_t, g);
      std::vector<uint32_t> raw(static_cast<size_t>(n * cols));
      be.read(raw.data(), out_dtype, dst);  // the device's own bits
      raw.resize(static_cast<size_t>(n * cols * dtype_size(out_dtype) / 4));
      return raw;
    };
    SCOPED_TRACE(std::to_string(c.height) + "x" + std::to_string(c.width));
    const std::vector<uint32_t> want = run(*cpu_, DType::f32);
    EXPECT_EQ(run(*gpu_, DType::f32), want);
    std::vector<uint16_t> want_bf16(want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      float f;
      std::memcpy(&f, &want[i], 4);
      want_bf16[i] = f32_to_bf16(f);
    }
    const std::vector<uint32_t> got = run(*gpu_, DType::bf16);
    EXPECT_EQ(0, std::memcmp(got.data(), want_bf16.data(), want_bf16.size() * 2));
  }
}

TEST_F(BackendOps, ScatterRows) {
  const std::tuple<int64_t, int64_t, int64_t> cases[] = {
      {50, 64, 10}, {300, 2048, 64}, {20, 36, 7}, {16, 32, 16}};
  for (const auto& c : cases) {
    const int64_t rows = std::get<0>(c), cols = std::get<1>(c), n = std::get<2>(c);
    for (bool accumulate : {false, true}) {
      compare("scatter_rows " + dims_str({rows, cols, n}) + (accumulate ? " acc" : ""),
              accumulate ? kElementwise : kExact, [&](Side& s) {
                Rng rng(100);
                Tensor dst = s.make(Kind::act, {rows, cols}, rng.normal(rows * cols));
                Tensor src = s.make(Kind::act, {n, cols}, rng.normal(n * cols));
                Tensor idx = s.make_i32({n}, rng.permutation_prefix(static_cast<int32_t>(rows),
                                                                    static_cast<int32_t>(n)));
                s.be().scatter_rows(dst, src, idx, accumulate);
                return std::vector<Tensor>{dst};
              });
    }
  }
}

TEST_F(BackendOps, AddInterpolatedRows) {
  const std::tuple<int64_t, int64_t, int64_t> cases[] = {
      {2304, 1024, 100}, {64, 32, 20}, {50, 36, 7}, {2304, 1152, 64}};
  for (const auto& c : cases) {
    const int64_t table_rows = std::get<0>(c), cols = std::get<1>(c), n = std::get<2>(c);
    compare("add_interpolated_rows " + dims_str({table_rows, cols, n}), kElementwise, [&](Side& s) {
      Rng rng(110);
      Tensor table = s.make(Kind::act, {table_rows, cols}, rng.normal(table_rows * cols));
      std::vector<int32_t> idx(n * 4);
      for (auto& i : idx) i = rng.integer(0, static_cast<int32_t>(table_rows - 1));
      // Bilinear weights of random fractional offsets, f32 on both backends.
      std::vector<float> w(n * 4);
      const std::vector<float> frac = rng.uniform_f32(n * 2, 0.f, 1.f);
      for (int64_t r = 0; r < n; ++r) {
        const float dh = frac[2 * r], dw = frac[2 * r + 1];
        w[4 * r] = (1 - dh) * (1 - dw), w[4 * r + 1] = (1 - dh) * dw;
        w[4 * r + 2] = dh * (1 - dw), w[4 * r + 3] = dh * dw;
      }
      Tensor idx_t = s.make_i32({n, 4}, idx);
      Tensor w_t = s.make(Kind::f32, {n, 4}, w);
      Tensor y = s.make(Kind::act, {n, cols}, rng.normal(n * cols));
      s.be().add_interpolated_rows(y, table, idx_t, w_t);
      return std::vector<Tensor>{y};
    });
  }
}

// ids must match exactly (the ranking is by logit on both backends, ties to the lower index),
// weights within one rounding to the compute dtype, probs within f32 rounding.
TEST_F(BackendOps, MoeRoute) {
  for (const auto& [T, E, k] : std::vector<std::tuple<int64_t, int64_t, int>>{
           {300, 128, 8}, {64, 8, 2}, {33, 512, 32}, {5, 3, 3}, {17, 64, 1}}) {
    SCOPED_TRACE(dims_str({T, E, k}));
    Side cpu(*cpu_), gpu(*gpu_);
    Rng rng(120);
    std::vector<float> x = rng.normal(T * E, 0.f, 2.f);
    for (float& v : x) v = round_bf16(v);
    // Exact ties in the first row: experts 1 and 2 share the row's largest logit.
    x[1] = x[2] = 9.f;
    const int64_t real = T - T / 4;
    std::vector<int32_t> ids_cpu(T * k), ids_gpu(T * k);
    std::vector<std::vector<float>> outs[2];
    int side = 0;
    for (Side* s : {&cpu, &gpu}) {
      Tensor logits = s->make(Kind::act, {T, E}, x);
      Tensor ids = s->make_i32({T, k}, std::vector<int32_t>(T * k, 7));
      Tensor weights = s->make(Kind::act, {T, k}, std::vector<float>(T * k, 3.f));
      Tensor probs = s->make(Kind::f32, {T, E}, std::vector<float>(T * E, 3.f));
      Tensor real_rows = s->make_i32({1}, {static_cast<int32_t>(real)});
      s->be().moe_route(ids, weights, probs, logits, k, real_rows);
      s->be().read((side == 0 ? ids_cpu : ids_gpu).data(), DType::i32, ids);
      outs[side] = {s->get(weights), s->get(probs)};
      EXPECT_TRUE(s->guards_intact());
      ++side;
    }
    EXPECT_EQ(ids_gpu, ids_cpu);
    EXPECT_EQ(ids_cpu[0], 1);
    if (k > 1) EXPECT_EQ(ids_cpu[1], 2);
    EXPECT_EQ(ids_cpu[static_cast<size_t>(real * k)], -1);
    // The CPU's weights rounded as the GPU's are: within one bf16 step of them.
    const std::vector<float>&wc = outs[0][0], &wg = outs[1][0];
    for (size_t i = 0; i < wc.size(); ++i)
      ASSERT_NEAR(wg[i], round_bf16(wc[i]), std::ldexp(std::fabs(wc[i]), -7) + 1e-30f) << i;
    EXPECT_TRUE(matches(outs[1][1], outs[0][1], kElementwise));
  }
}

// The routing metadata and row order must match the CPU exactly (ids from moe_route, padding
// rows included); the projections and the combine within rounding.
TEST_F(BackendOps, MoeDispatchGroupedLinearCombine) {
  struct Case {
    int64_t T;
    int k;
    int64_t E, H, N;
    bool one_expert;  // every token's first choice the same expert (a tile boundary inside it)
  };
  for (const Case& c : std::vector<Case>{{300, 8, 128, 64, 96, false},
                                         {7, 2, 4, 33, 17, false},
                                         {1, 8, 128, 128, 64, false},
                                         {200, 1, 8, 40, 24, true},
                                         {64, 4, 512, 32, 16, false}}) {
    SCOPED_TRACE(dims_str({c.T, c.k, c.E, c.H, c.N}));
    Rng rng(130);
    std::vector<float> logits = rng.normal(c.T * c.E);
    for (float& v : logits) v = round_bf16(v);
    if (c.one_expert)
      for (int64_t t = 0; t < c.T; ++t) logits[static_cast<size_t>(t * c.E + 3)] = 20.f;
    std::vector<float> x = rng.normal(c.T * c.H), w = rng.normal(c.E * c.N * c.H, 0.f, 0.2f);
    for (std::vector<float>* v : {&x, &w})
      for (float& f : *v) f = round_bf16(f);
    const int64_t slots = c.T * c.k, real = c.T - c.T / 5;
    std::vector<int32_t> off[2], rows[2];
    std::vector<float> xs[2], ys[2], y[2];
    int side = 0;
    for (Backend* be : {cpu_.get(), gpu_.get()}) {
      Side s(*be);
      Tensor lg = s.make(Kind::act, {c.T, c.E}, logits);
      Tensor ids = s.make_i32({c.T, c.k}, std::vector<int32_t>(slots, 0));
      Tensor weights = s.make(Kind::act, {c.T, c.k}, std::vector<float>(slots, 0.f));
      Tensor real_rows = s.make_i32({1}, {static_cast<int32_t>(real)});
      be->moe_route(ids, weights, Tensor(), lg, c.k, real_rows);
      Tensor xt = s.make(Kind::act, {c.T, c.H}, x);
      Tensor x_sorted = s.make(Kind::act, {slots, c.H}, std::vector<float>(slots * c.H, 0.f));
      Tensor offsets = s.make_i32({c.E + 1}, std::vector<int32_t>(c.E + 1, 0));
      Tensor slot_rows = s.make_i32({c.T, c.k}, std::vector<int32_t>(slots, 0));
      be->moe_dispatch(x_sorted, offsets, slot_rows, xt, ids, 0);
      Tensor wt = s.make(Kind::act, {c.E, c.H, c.N}, w);
      Tensor y_sorted = s.make(Kind::act, {slots, c.N}, std::vector<float>(slots * c.N, 0.f));
      be->moe_grouped_linear(y_sorted, x_sorted, wt, offsets, 0);
      Tensor out = s.make(Kind::act, {c.T, c.N}, std::vector<float>(c.T * c.N, 1.f));
      be->moe_combine(out, y_sorted, slot_rows, weights, true);
      off[side].resize(static_cast<size_t>(c.E + 1));
      rows[side].resize(static_cast<size_t>(slots));
      be->read(off[side].data(), DType::i32, offsets);
      be->read(rows[side].data(), DType::i32, slot_rows);
      const int64_t routed = off[side].back();
      xs[side] = s.get(x_sorted.slice(0, routed));
      ys[side] = s.get(y_sorted.slice(0, routed));
      y[side] = s.get(out);
      EXPECT_TRUE(s.guards_intact());
      ++side;
    }
    EXPECT_EQ(off[1], off[0]);
    EXPECT_EQ(rows[1], rows[0]);
    EXPECT_EQ(off[0].back(), real * c.k);
    if (c.one_expert) EXPECT_EQ(off[0][4] - off[0][3], real);
    EXPECT_TRUE(matches(xs[1], xs[0], kExact));
    EXPECT_TRUE(matches(ys[1], ys[0], kElementwise));
    EXPECT_TRUE(matches(y[1], y[0], kElementwise));
  }
}

// The drop over capacity and the padded permutation against the CPU oracle, exactly: the same
// slots kept (weights in bf16 on both, ties included), the same count dropped, offsets, rows and
// sorted rows; every token on one expert, experts with no token, a capacity over every count and
// more slots than one block's step.
TEST_F(BackendOps, MoeCapacityDropAndPaddedDispatch) {
  struct Case {
    int64_t T;
    int k;
    int64_t E, H, capacity;
    int policy;
    bool one_expert;
  };
  for (const Case& c : std::vector<Case>{{300, 8, 128, 16, 10, 0, false},
                                         {300, 8, 128, 16, 10, 1, false},
                                         {200, 1, 8, 8, 5, 0, true},
                                         {64, 4, 16, 8, 1, 0, false},
                                         {7, 2, 4, 8, 100, 0, false},
                                         {2048, 8, 128, 8, 128, 0, false},
                                         {2048, 8, 128, 8, 100, 1, false}}) {
    SCOPED_TRACE(dims_str({c.T, c.k, c.E, c.H, c.capacity}) + " policy " +
                 std::to_string(c.policy));
    Rng rng(170);
    // k distinct experts a token (from a random ranking), bf16 weights with many ties.
    std::vector<int32_t> ids(static_cast<size_t>(c.T * c.k));
    std::vector<float> weights(ids.size());
    for (int64_t t = 0; t < c.T; ++t) {
      std::vector<float> score = rng.normal(c.E);
      if (c.one_expert) score[3] = 100.f;
      for (int j = 0; j < c.k; ++j) {
        const auto best = std::max_element(score.begin(), score.end()) - score.begin();
        ids[static_cast<size_t>(t * c.k + j)] = static_cast<int32_t>(best);
        score[static_cast<size_t>(best)] = -1e30f;
        weights[static_cast<size_t>(t * c.k + j)] =
            round_bf16(std::floor(std::fabs(rng.normal(1)[0]) * 8.f) / 16.f);
      }
    }
    for (int j = 0; j < c.k; ++j) ids[static_cast<size_t>((c.T - 1) * c.k + j)] = -1;  // padding
    const int64_t rows = c.E * c.capacity;
    std::vector<float> x = rng.normal(c.T * c.H);
    for (float& f : x) f = round_bf16(f);
    std::vector<int32_t> kept[2], count[2], off[2], srows[2];
    std::vector<float> xs[2];
    // The padded experts' projection, forward and backward (one batched GEMM on CUDA).
    const int64_t N = 24;
    std::vector<float> w = rng.normal(c.E * c.H * N, 0.f, 0.2f), dy = rng.normal(rows * N);
    for (std::vector<float>* v : {&w, &dy})
      for (float& f : *v) f = round_bf16(f);
    std::vector<std::vector<float>> proj[2];
    int side = 0;
    for (Backend* be : {cpu_.get(), gpu_.get()}) {
      Side s(*be);
      Tensor idt = s.make_i32({c.T, c.k}, ids);
      Tensor wt = s.make(Kind::act, {c.T, c.k}, weights);
      Tensor kt = s.make_i32({c.T, c.k}, std::vector<int32_t>(ids.size(), 77));
      Tensor dropped = s.make_i32({1}, {3});
      be->moe_capacity_drop(kt, dropped, idt, wt, static_cast<int>(c.E), c.capacity, c.policy);
      Tensor xt = s.make(Kind::act, {c.T, c.H}, x);
      Tensor x_sorted = s.make(Kind::act, {rows, c.H}, std::vector<float>(rows * c.H, 5.f));
      Tensor offsets = s.make_i32({c.E + 1}, std::vector<int32_t>(c.E + 1, 0));
      Tensor slot_rows = s.make_i32({c.T, c.k}, std::vector<int32_t>(ids.size(), 0));
      be->moe_dispatch(x_sorted, offsets, slot_rows, xt, kt, c.capacity);
      Tensor proj_w = s.make(Kind::act, {c.E, c.H, N}, w);
      Tensor y = s.make(Kind::act, {rows, N}, std::vector<float>(rows * N, 0.f));
      be->moe_grouped_linear(y, x_sorted, proj_w, offsets, c.capacity);
      Tensor dyt = s.make(Kind::act, {rows, N}, dy);
      Tensor dx = s.make(Kind::act, {rows, c.H}, std::vector<float>(rows * c.H, 0.f));
      Tensor dw = s.make(Kind::f32, {c.E, c.H, N}, std::vector<float>(c.E * c.H * N, 0.25f));
      be->moe_grouped_linear_backward(dx, dw, dyt, x_sorted, proj_w, offsets, c.capacity);
      proj[side] = {s.get(y), s.get(dx), s.get(dw)};
      for (auto [dst, src] : {std::pair{&kept[side], &kt},
                              {&count[side], &dropped},
                              {&off[side], &offsets},
                              {&srows[side], &slot_rows}}) {
        dst->resize(static_cast<size_t>(src->numel()));
        be->read(dst->data(), DType::i32, *src);
      }
      xs[side] = s.get(x_sorted);
      EXPECT_TRUE(s.guards_intact());
      ++side;
    }
    EXPECT_EQ(kept[1], kept[0]);
    EXPECT_EQ(count[1], count[0]);
    EXPECT_EQ(off[1], off[0]);
    EXPECT_EQ(srows[1], srows[0]);
    EXPECT_TRUE(matches(xs[1], xs[0], kExact));
    EXPECT_TRUE(matches(proj[1][0], proj[0][0], kElementwise)) << "y";
    EXPECT_TRUE(matches(proj[1][1], proj[0][1], kElementwise)) << "dx";
    EXPECT_TRUE(matches(proj[1][2], proj[0][2], kChained)) << "dw";
    // The oracle's own count: what each expert holds over the capacity.
    std::vector<int64_t> per_expert(static_cast<size_t>(c.E), 0);
    for (int32_t e : ids)
      if (e >= 0) ++per_expert[static_cast<size_t>(e)];
    int64_t over = 0;
    for (int64_t n : per_expert) over += std::max<int64_t>(0, n - c.capacity);
    EXPECT_EQ(count[0][0], 3 + over);
    if (c.one_expert) EXPECT_GT(over, 0);
  }
}

// The backwards on random routing with padding, against the CPU oracle: the sorted gradients and
// dx within rounding, the weight and routing-weight gradients (f32) within accumulation order.
TEST_F(BackendOps, MoeBackward) {
  for (const auto& [T, k, E, H, N] :
       std::vector<std::tuple<int64_t, int, int64_t, int64_t, int64_t>>{
           {300, 8, 128, 64, 96}, {7, 2, 4, 33, 17}, {200, 1, 8, 40, 24}}) {
    SCOPED_TRACE(dims_str({T, k, E, H, N}));
    Rng rng(150);
    auto bf = [](std::vector<float> v) {
      for (float& f : v) f = round_bf16(f);
      return v;
    };
    const std::vector<float> logits = bf(rng.normal(T * E)), x = bf(rng.normal(T * H)),
                             w = bf(rng.normal(E * H * N, 0.f, 0.2f)), dout = rng.normal(T * N),
                             gsort = bf(rng.normal(T * k * H));
    const int64_t slots = T * k, real = T - T / 5;
    std::vector<std::vector<float>> got[2];
    int side = 0;
    for (Backend* be : {cpu_.get(), gpu_.get()}) {
      Side s(*be);
      Tensor lg = s.make(Kind::act, {T, E}, logits);
      Tensor ids = s.make_i32({T, k}, std::vector<int32_t>(slots, 0));
      Tensor weights = s.make(Kind::act, {T, k}, std::vector<float>(slots, 0.f));
      Tensor real_rows = s.make_i32({1}, {static_cast<int32_t>(real)});
      be->moe_route(ids, weights, Tensor(), lg, k, real_rows);
      Tensor xt = s.make(Kind::act, {T, H}, x);
      Tensor x_sorted = s.make(Kind::act, {slots, H}, std::vector<float>(slots * H, 0.f));
      Tensor offsets = s.make_i32({E + 1}, std::vector<int32_t>(E + 1, 0));
      Tensor slot_rows = s.make_i32({T, k}, std::vector<int32_t>(slots, 0));
      be->moe_dispatch(x_sorted, offsets, slot_rows, xt, ids, 0);
      Tensor wt = s.make(Kind::act, {E, H, N}, w);
      Tensor y_sorted = s.make(Kind::act, {slots, N}, std::vector<float>(slots * N, 0.f));
      be->moe_grouped_linear(y_sorted, x_sorted, wt, offsets, 0);
      // The residual stream's gradient is f32 on both backends.
      Tensor dy = s.make(Kind::f32, {T, N}, dout);
      Tensor dy_sorted = s.make(Kind::act, {slots, N}, std::vector<float>(slots * N, 0.f));
      Tensor dweights = s.make(Kind::f32, {T, k}, std::vector<float>(slots, 3.f));
      be->moe_combine_backward(dy_sorted, dweights, dy, y_sorted, slot_rows, weights);
      Tensor dxs = s.make(Kind::act, {slots, H}, std::vector<float>(slots * H, 0.f));
      Tensor dw = s.make(Kind::f32, {E, H, N}, std::vector<float>(E * H * N, 0.5f));
      be->moe_grouped_linear_backward(dxs, dw, dy_sorted, x_sorted, wt, offsets, 0);
      Tensor gs = s.make(Kind::act, {slots, H}, gsort);
      Tensor dx = s.make(Kind::f32, {T, H}, std::vector<float>(T * H, 1.f));
      be->moe_dispatch_backward(dx, gs, slot_rows);
      const int64_t routed = real * k;
      got[side] = {s.get(dy_sorted.slice(0, routed)), s.get(dweights), s.get(dxs.slice(0, routed)),
                   s.get(dw), s.get(dx)};
      EXPECT_TRUE(s.guards_intact());
      ++side;
    }
    const char* names[] = {"dy_sorted", "dweights", "dx_sorted", "dw", "dx"};
    for (size_t i = 0; i < got[0].size(); ++i)
      EXPECT_TRUE(matches(got[1][i], got[0][i], kChained)) << names[i];
  }
}

// The router's backward and the load-balancing loss: the statistics and the loss bit for bit (both
// backends add in the same order), the logits' gradient within bf16 rounding.
TEST_F(BackendOps, MoeRouteBackwardAndAuxLoss) {
  for (const auto& [T, k, E] :
       std::vector<std::tuple<int64_t, int, int64_t>>{{300, 8, 128}, {7, 2, 4}, {50, 4, 200}}) {
    SCOPED_TRACE(dims_str({T, k, E}));
    Rng rng(160);
    std::vector<float> logits = rng.normal(T * E);
    for (float& f : logits) f = round_bf16(f);
    const std::vector<float> dw = rng.normal(T * k), aux = rng.normal(E, 0.f, 0.1f);
    const int64_t real = T - T / 4;
    std::vector<std::vector<float>> got[2];
    int side = 0;
    for (Backend* be : {cpu_.get(), gpu_.get()}) {
      Side s(*be);
      Tensor lg = s.make(Kind::act, {T, E}, logits);
      Tensor ids = s.make_i32({T, k}, std::vector<int32_t>(T * k, 0));
      Tensor weights = s.make(Kind::act, {T, k}, std::vector<float>(T * k, 0.f));
      Tensor probs = s.make(Kind::f32, {T, E}, std::vector<float>(T * E, 0.f));
      Tensor real_rows = s.make_i32({1}, {static_cast<int32_t>(real)});
      be->moe_route(ids, weights, probs, lg, k, real_rows);
      // Both sides differentiate the CPU's probabilities, so that only the backward differs.
      if (side == 1) be->write(probs, got[0][0].data(), DType::f32);
      Tensor dweights = s.make(Kind::f32, {T, k}, dw);
      Tensor aux_dprob = s.make(Kind::f32, {E}, aux);
      Tensor dlogits = s.make(Kind::act, {T, E}, std::vector<float>(T * E, 9.f));
      be->moe_route_backward(dlogits, dweights, probs, ids, aux_dprob);
      Tensor load = s.make(Kind::f32, {E}, std::vector<float>(E, 1.f));
      Tensor prob_sum = s.make(Kind::f32, {E}, std::vector<float>(E, 0.5f));
      be->moe_route_stats(load, prob_sum, ids, probs);
      be->moe_route_stats(load, prob_sum, ids, probs);
      Tensor aux_sum = s.make(Kind::f32, {1}, {0.25f});
      Tensor dprob = s.make(Kind::f32, {E}, std::vector<float>(E, 9.f));
      be->moe_aux_loss(aux_sum, dprob, load, prob_sum, real_rows, 2, 0.125f);
      got[side] = {s.get(probs),    s.get(dlogits), s.get(load),
                   s.get(prob_sum), s.get(aux_sum), s.get(dprob)};
      EXPECT_TRUE(s.guards_intact());
      ++side;
    }
    EXPECT_TRUE(matches(got[1][1], got[0][1], kChained)) << "dlogits";
    EXPECT_EQ(got[1][2], got[0][2]) << "load";
    EXPECT_EQ(got[1][3], got[0][3]) << "prob_sum";
    EXPECT_EQ(got[1][4], got[0][4]) << "aux_sum";
    EXPECT_TRUE(matches(got[1][5], got[0][5], kExact)) << "dprob";
  }
}

TEST_F(BackendOps, ArgmaxRows) {
  // 151936 and 40000 columns spread a row over many blocks; 40001 (unaligned rows) and the short
  // rows take one block per row.
  const std::pair<int64_t, int64_t> cases[] = {{3, 151936}, {2, 40000}, {2, 40001},
                                               {5, 1000},   {1, 17},    {4, 1003}};
  for (const auto& c : cases) {
    const int64_t m = c.first, n = c.second;
    compare("argmax_rows " + dims_str({m, n}), kExact, [&](Side& s) {
      Rng rng(120);
      std::vector<float> x = rng.normal(m * n);
      // Ties: the lowest index must win.
      for (int64_t r = 0; r < m; ++r) {
        const int64_t a = rng.integer(0, static_cast<int32_t>(n - 1));
        const int64_t b = rng.integer(0, static_cast<int32_t>(n - 1));
        x[r * n + a] = x[r * n + b] = 8.f + float(r % 2);
      }
      Tensor xt = s.make(Kind::act, {m, n}, x);
      Tensor out = s.make_i32({m}, std::vector<int32_t>(m, -1));
      s.be().argmax_rows(out, xt);
      return std::vector<Tensor>{out};
    });
  }
}

// Distance in units in the last place between two finite floats (their bit patterns ordered so
// that the count runs through zero).
int64_t ulp_distance(float a, float b) {
  auto ordered = [](float f) {
    int32_t i;
    std::memcpy(&i, &f, sizeof i);
    return i < 0 ? int64_t{std::numeric_limits<int32_t>::min()} - i : int64_t{i};
  };
  return std::llabs(ordered(a) - ordered(b));
}

// The CUDA kernel computes the tables from the grids on the device; indices, weights, segments
// and the real row count must be the CPU's bit for bit (the linspace and weight arithmetic is
// rounded step by step, as on the host). cos/sin round a double-precision sincos, where the CPU
// calls glibc's cosf/sinf: those differ by an ulp in about 1% of the values, so they may differ
// by at most 2 ulps here.
TEST_F(BackendOps, VisionTables) {
  struct Case {
    const char* name;
    int head_dim, grid_side;
    float theta;
    std::vector<int32_t> grids;  // t, h, w per image
    int64_t rows;
    int capacity;
  };
  const Case cases[] = {
      {"one 448 image", 64, 48, 10000.0f, {1, 28, 28}, 784, 2},
      {"eight 448 images",
       64,
       48,
       10000.0f,
       {1, 28, 28, 1, 28, 28, 1, 28, 28, 1, 28, 28, 1, 28, 28, 1, 28, 28, 1, 28, 28, 1, 28, 28},
       6272,
       9},
      {"eight mixed images",
       72,
       48,
       10000.0f,
       {1, 28, 28, 1, 16, 40, 1, 56, 14, 1, 2, 2, 1, 30, 18, 1, 8, 64, 1, 84, 84, 1, 4, 6},
       10344,
       9},
      {"three images in a 4096 bucket",
       64,
       48,
       10000.0f,
       {1, 28, 28, 1, 20, 36, 1, 12, 12},
       4096,
       17},
      {"frames in a bucket", 16, 32, 1000000.0f, {2, 16, 16, 3, 8, 12, 1, 10, 10}, 1024, 8},
      {"the tiny grid", 8, 4, 10000.0f, {1, 2, 2, 1, 2, 6}, 32, 4},
      {"all padding", 64, 48, 10000.0f, {}, 256, 4},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const int64_t R = c.rows, hd = c.head_dim;
    const int n = static_cast<int>(c.grids.size() / 3);
    std::vector<int32_t> packed(static_cast<size_t>(vision_grids_numel(c.capacity)), 5);
    packed[0] = n;  // entries past the images stay 5, a grid the kernel must not read
    std::copy(c.grids.begin(), c.grids.end(), packed.begin() + 1);
    const std::vector<float> inv_freq = vision_rope_inv_freq(c.head_dim, c.theta);
    Side cpu(*cpu_), gpu(*gpu_);
    auto run = [&](Side& s) {
      // Outputs start as sentinels, so an element the kernel skips cannot match the CPU's.
      std::vector<Tensor> t = {
          s.make(Kind::f32, {R, hd}, std::vector<float>(R * hd, kSentinel)),
          s.make(Kind::f32, {R, hd}, std::vector<float>(R * hd, kSentinel)),
          s.make_i32({R, 4}, std::vector<int32_t>(R * 4, -1)),
          s.make(Kind::f32, {R, 4}, std::vector<float>(R * 4, kSentinel)),
          s.make_i32({c.capacity + 1}, std::vector<int32_t>(c.capacity + 1, -1)),
          s.make_i32({1}, {-1})};
      const Tensor grids = s.make_i32({vision_grids_numel(c.capacity)}, packed);
      s.be().vision_tables(t[0], t[1], t[2], t[3], t[4], t[5], grids, inv_freq, 2, c.grid_side);
      return t;
    };
    const std::vector<Tensor> want = run(cpu), got = run(gpu);
    int64_t worst = 0, differing = 0;
    for (int k : {0, 1}) {
      const std::vector<float> a = gpu.get(got[k]), b = cpu.get(want[k]);
      for (size_t e = 0; e < a.size(); ++e) {
        const int64_t d = ulp_distance(a[e], b[e]);
        worst = std::max(worst, d);
        differing += d != 0;
      }
    }
    EXPECT_LE(worst, 2) << "cos/sin ulps";
    std::printf("[ ulps     ] vision_tables %-30s cos/sin: %lld of %lld differ, at most %lld ulp\n",
                c.name, static_cast<long long>(differing), static_cast<long long>(2 * R * hd),
                static_cast<long long>(worst));
    for (int k : {2, 3, 4, 5})
      EXPECT_TRUE(matches(gpu.get(got[k]), cpu.get(want[k]), kExact)) << "output " << k;
    EXPECT_TRUE(cpu.guards_intact());
    EXPECT_TRUE(gpu.guards_intact());
  }
}

#ifdef IRIS_WITH_CUDA

// Ops of one decode step of the tiny model, on tensors allocated up front.
struct StepTensors {
  Tensor x, norm_w, qkv_w, qkv, cos, sin, kc, vc, past, attn, o_w, gate_up_w, gate_up, mlp, down_w,
      logits_w, logits, ids, table, next;
};

StepTensors alloc_step(Arena& arena, Backend& be, Rng& rng, int64_t hidden, int nq, int nkv, int hd,
                       int64_t max_len, int64_t vocab) {
  auto fill = [&](Tensor t, float stddev) {
    const std::vector<float> v = rng.normal(t.numel(), 0.f, stddev);
    be.write(t, v.data(), DType::f32);
    return t;
  };
  const int64_t qkv_w = int64_t{nq + 2 * nkv} * hd, inter = 3 * hidden;
  StepTensors s;
  s.table = fill(arena.alloc(DType::bf16, {vocab, hidden}), 1.f);
  s.ids = arena.alloc(DType::i32, {1});
  s.x = arena.alloc(DType::bf16, {1, hidden});
  s.norm_w = fill(arena.alloc(DType::bf16, {hidden}), 1.f);
  s.qkv_w = fill(arena.alloc(DType::bf16, {qkv_w, hidden}), 0.1f);
  s.qkv = arena.alloc(DType::bf16, {1, qkv_w});
  s.cos = fill(arena.alloc(DType::f32, {1, hd}), 0.5f);
  s.sin = fill(arena.alloc(DType::f32, {1, hd}), 0.5f);
  s.kc = fill(arena.alloc(DType::bf16, {max_len, int64_t{nkv} * hd}), 1.f);
  s.vc = fill(arena.alloc(DType::bf16, {max_len, int64_t{nkv} * hd}), 1.f);
  s.past = arena.alloc(DType::i32, {1});
  s.attn = arena.alloc(DType::bf16, {1, int64_t{nq} * hd});
  s.o_w = fill(arena.alloc(DType::bf16, {hidden, int64_t{nq} * hd}), 0.1f);
  s.gate_up_w = fill(arena.alloc(DType::bf16, {2 * inter, hidden}), 0.1f);
  s.gate_up = arena.alloc(DType::bf16, {1, 2 * inter});
  s.mlp = arena.alloc(DType::bf16, {1, inter});
  s.down_w = fill(arena.alloc(DType::bf16, {hidden, inter}), 0.1f);
  s.logits_w = fill(arena.alloc(DType::bf16, {vocab, hidden}), 0.1f);
  s.logits = arena.alloc(DType::bf16, {1, vocab});
  s.next = arena.alloc(DType::i32, {1});
  return s;
}

void run_step(Backend& be, const StepTensors& s, int nq, int nkv, int hd) {
  be.embedding(s.x, s.table, s.ids);
  be.rms_norm(s.x, s.x, s.norm_w, 1e-6f);
  be.linear(s.qkv, s.x, s.qkv_w, Tensor(), false);
  be.qkv_norm_rope(s.qkv, s.norm_w.slice(0, hd), s.norm_w.slice(0, hd), 1e-6f, s.cos, s.sin, nq,
                   nkv, hd, true);
  be.kv_store(s.kc, s.vc, s.qkv, s.past, nq, nkv, hd);
  be.attention_causal(s.attn, s.qkv, s.kc, s.vc, s.past, nq, nkv, hd, 0.25f);
  be.linear(s.x, s.attn, s.o_w, Tensor(), true);
  be.linear(s.gate_up, s.x, s.gate_up_w, Tensor(), false);
  be.swiglu(s.mlp, s.gate_up);
  be.linear(s.x, s.mlp, s.down_w, Tensor(), true);
  be.gelu_tanh(s.mlp, s.mlp);
  be.add(s.x, s.x, s.x);
  be.layer_norm(s.x, s.x, s.norm_w, s.norm_w, 1e-6f);
  be.linear(s.logits, s.x, s.logits_w, Tensor(), false);
  be.argmax_rows(s.next, s.logits);
  be.copy(s.ids, s.next);
}

TEST_F(BackendOps, RepeatedStepsAllocateNothing) {
  const int nq = 4, nkv = 2, hd = 16;
  const int64_t hidden = 64, max_len = 64, vocab = 151;
  Arena arena(*gpu_, size_t{16} << 20);
  Rng rng(130);
  const StepTensors s = alloc_step(arena, *gpu_, rng, hidden, nq, nkv, hd, max_len, vocab);
  const int32_t zero = 0;
  gpu_->write(s.ids, &zero, DType::i32);
  gpu_->write(s.past, &zero, DType::i32);
  run_step(*gpu_, s, nq, nkv, hd);  // first use: GEMM plans are made here
  gpu_->synchronize();
  const size_t allocations = arena.allocation_count();
  // Free device memory is device-wide: other test processes on the GPU move it too. An op that
  // allocates does so on every round of steps; another process's allocation is rarely in step
  // with ours, so one round of several with unchanged free memory shows the ops allocate nothing.
  // A round takes well under a millisecond; under `ctest -j16` five rounds were once all
  // disturbed, so there are fifty.
  bool unchanged = false;
  size_t free_before = 0, free_after = 0, total = 0;
  int32_t step = 1;
  for (int round = 0; round < 50 && !unchanged; ++round) {
    IRIS_CUDA_CHECK(cudaMemGetInfo(&free_before, &total));
    for (int i = 0; i < 8; ++i, ++step) {
      gpu_->write(s.past, &step, DType::i32);
      run_step(*gpu_, s, nq, nkv, hd);
    }
    gpu_->synchronize();
    IRIS_CUDA_CHECK(cudaMemGetInfo(&free_after, &total));
    unchanged = free_after == free_before;
  }
  EXPECT_EQ(arena.allocation_count(), allocations);
  EXPECT_TRUE(unchanged) << "device memory was allocated inside ops (free " << free_before << " -> "
                         << free_after << " bytes)";
  int32_t next = -1;
  gpu_->read(&next, DType::i32, s.next);
  EXPECT_GE(next, 0);
  EXPECT_LT(next, vocab);
}

// A decode step captured once as a CUDA graph must give the eager result at every later
// past_len: the kernels read past_len from device memory at replay.
TEST_F(BackendOps, CapturedDecodeStepMatchesEagerAtEveryPosition) {
  const int nq = 16, nkv = 8, hd = 128;
  const int64_t hidden = 256, max_len = 512, vocab = 1000;
  Arena arena(*gpu_, size_t{64} << 20);
  Rng rng_a(140), rng_b(140);
  const StepTensors graph_side =
      alloc_step(arena, *gpu_, rng_a, hidden, nq, nkv, hd, max_len, vocab);
  const StepTensors eager_side =
      alloc_step(arena, *gpu_, rng_b, hidden, nq, nkv, hd, max_len, vocab);
  const int32_t start_id = 3, start_past = 200;
  for (const StepTensors* s : {&graph_side, &eager_side}) {
    gpu_->write(s->ids, &start_id, DType::i32);
    gpu_->write(s->past, &start_past, DType::i32);
  }
  run_step(*gpu_, eager_side, nq, nkv, hd);  // plans made before capture; warms the eager side
  run_step(*gpu_, graph_side, nq, nkv, hd);
  gpu_->synchronize();

  cudaStream_t stream = cuda_stream(*gpu_);
  ASSERT_EQ(gpu_->native_stream(), static_cast<void*>(stream));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  IRIS_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  run_step(*gpu_, graph_side, nq, nkv, hd);
  IRIS_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  IRIS_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int32_t past = start_past + 1; past < start_past + 40; past += 3) {
    for (const StepTensors* s : {&graph_side, &eager_side}) gpu_->write(s->past, &past, DType::i32);
    IRIS_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    run_step(*gpu_, eager_side, nq, nkv, hd);
    std::vector<float> a(hidden), b(hidden);
    gpu_->read(a.data(), DType::f32, graph_side.x);
    gpu_->read(b.data(), DType::f32, eager_side.x);
    ASSERT_TRUE(matches(a, b, kExact)) << "past_len " << past;
    std::vector<float> ka(nkv * hd), kb(nkv * hd);
    gpu_->read(ka.data(), DType::f32, graph_side.kc.slice(past, past + 1));
    gpu_->read(kb.data(), DType::f32, eager_side.kc.slice(past, past + 1));
    ASSERT_TRUE(matches(ka, kb, kExact)) << "k cache row " << past;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

#endif  // IRIS_WITH_CUDA

// ---- mixture of experts ----

// The router's definition on small rows worked by hand: softmax over all experts, the k largest
// (the lower index first among equal logits), renormalised; padding rows route nowhere.
TEST(MoeRouteOnTheCpu, PicksRenormalisesAndSkipsPadding) {
  auto cpu = make_cpu_backend();
  Side s(*cpu);
  const float ln2 = std::log(2.0f), ln3 = std::log(3.0f);
  // Row 0: probabilities 1/6, 2/6, 3/6 -> experts 2, 1 with weights 3/5, 2/5. Row 1: a tie
  // between experts 1 and 2 -> 1 first. Row 2: padding.
  Tensor logits = s.make(Kind::act, {3, 3}, {0.f, ln2, ln3, 0.f, 1.f, 1.f, 5.f, 6.f, 7.f});
  Tensor ids = s.make_i32({3, 2}, std::vector<int32_t>(6, 99));
  Tensor weights = s.make(Kind::act, {3, 2}, std::vector<float>(6, 9.f));
  Tensor probs = s.make(Kind::f32, {3, 3}, std::vector<float>(9, 9.f));
  Tensor real = s.make_i32({1}, {2});
  cpu->moe_route(ids, weights, probs, logits, 2, real);
  std::vector<int32_t> got_ids(6);
  cpu->read(got_ids.data(), DType::i32, ids);
  EXPECT_EQ(got_ids, (std::vector<int32_t>{2, 1, 1, 2, -1, -1}));
  const std::vector<float> w = s.get(weights), p = s.get(probs);
  EXPECT_NEAR(w[0], 0.6f, 1e-6f);
  EXPECT_NEAR(w[1], 0.4f, 1e-6f);
  EXPECT_NEAR(w[2], 0.5f, 1e-6f);
  EXPECT_NEAR(w[3], 0.5f, 1e-6f);
  EXPECT_EQ(w[4], 0.f);
  EXPECT_EQ(w[5], 0.f);
  EXPECT_NEAR(p[0], 1.f / 6, 1e-6f);
  EXPECT_NEAR(p[1], 2.f / 6, 1e-6f);
  EXPECT_NEAR(p[2], 3.f / 6, 1e-6f);
  const float e = std::exp(1.f);
  EXPECT_NEAR(p[4], e / (1 + 2 * e), 1e-6f);
  for (int i = 6; i < 9; ++i) EXPECT_EQ(p[i], 0.f);
  EXPECT_TRUE(s.guards_intact());
  // Without real_rows every row routes; without probs none is written.
  Tensor top1 = s.make_i32({3, 1}, std::vector<int32_t>(3, 99));
  Tensor top1_weight = s.make(Kind::act, {3, 1}, std::vector<float>(3, 9.f));
  cpu->moe_route(top1, top1_weight, Tensor(), logits, 1, Tensor());
  std::vector<int32_t> got_top1(3);
  cpu->read(got_top1.data(), DType::i32, top1);
  EXPECT_EQ(got_top1, (std::vector<int32_t>{2, 1, 2}));
  EXPECT_EQ(s.get(top1_weight), (std::vector<float>{1.f, 1.f, 1.f}));
  // k must fit the experts and the ids' shape.
  EXPECT_THROW(cpu->moe_route(ids, weights, probs, logits, 4, Tensor()), Error);
  Tensor wide = s.make_i32({3, 3}, std::vector<int32_t>(9, 0));
  EXPECT_THROW(cpu->moe_route(wide, weights, probs, logits, 2, Tensor()), Error);
}

// The permutation and the experts' projections worked by hand: slots sorted by expert, stable by
// slot; padding slots get no row; the combine adds each token's slots in order.
TEST(MoeDispatchOnTheCpu, SortsSlotsProjectsPerExpertAndCombines) {
  auto cpu = make_cpu_backend();
  Side s(*cpu);
  // Slots (t, j): e2 e0 | e0 pad | e2 e1.
  Tensor ids = s.make_i32({3, 2}, {2, 0, 0, -1, 2, 1});
  Tensor x = s.make(Kind::act, {3, 2}, {1, 2, 3, 4, 5, 6});
  Tensor x_sorted = s.make(Kind::act, {6, 2}, std::vector<float>(12, 7.f));
  Tensor offsets = s.make_i32({4}, std::vector<int32_t>(4, 99));
  Tensor slot_rows = s.make_i32({3, 2}, std::vector<int32_t>(6, 99));
  cpu->moe_dispatch(x_sorted, offsets, slot_rows, x, ids, 0);
  std::vector<int32_t> off(4), rows(6);
  cpu->read(off.data(), DType::i32, offsets);
  cpu->read(rows.data(), DType::i32, slot_rows);
  EXPECT_EQ(off, (std::vector<int32_t>{0, 2, 3, 5}));
  EXPECT_EQ(rows, (std::vector<int32_t>{3, 0, 1, -1, 4, 2}));
  EXPECT_EQ(s.get(x_sorted), (std::vector<float>{1, 2, 3, 4, 5, 6, 1, 2, 5, 6, 7, 7}));

  // Expert 0 reads column 0, expert 1 column 1, expert 2 their sum (w [E, K, N]).
  Tensor w = s.make(Kind::act, {3, 2, 1}, {1, 0, 0, 1, 1, 1});
  Tensor y_sorted = s.make(Kind::act, {6, 1}, std::vector<float>(6, 7.f));
  cpu->moe_grouped_linear(y_sorted, x_sorted, w, offsets, 0);
  EXPECT_EQ(s.get(y_sorted), (std::vector<float>{1, 3, 6, 3, 11, 7}));

  Tensor weights = s.make(Kind::act, {3, 2}, {0.5f, 0.25f, 1.f, 0.f, 0.75f, 0.25f});
  Tensor y = s.make(Kind::act, {3, 1}, {1, 1, 1});
  cpu->moe_combine(y, y_sorted, slot_rows, weights, true);
  EXPECT_EQ(s.get(y), (std::vector<float>{2.75f, 4.f, 10.75f}));
  cpu->moe_combine(y, y_sorted, slot_rows, weights, false);
  EXPECT_EQ(s.get(y), (std::vector<float>{1.75f, 3.f, 9.75f}));
  EXPECT_TRUE(s.guards_intact());

  // An expert id the layer does not have is refused, as is a grouped weight of other experts.
  Tensor bad = s.make_i32({3, 2}, {2, 0, 0, 3, 2, 1});
  EXPECT_THROW(cpu->moe_dispatch(x_sorted, offsets, slot_rows, x, bad, 0), Error);
  Tensor w4 = s.make(Kind::act, {4, 2, 1}, std::vector<float>(8, 1.f));
  EXPECT_THROW(cpu->moe_grouped_linear(y_sorted, x_sorted, w4, offsets, 0), Error);
}

// Megatron's drop over a static capacity, worked by hand: per expert, the slots of the largest
// weights stay ("probs"; the lower slot first among equal weights) or the first slots
// ("position"); ids stay as routed. Padded to capacity, every expert owns capacity rows, its
// slots first and zeros after.
TEST(MoeCapacityOnTheCpu, DropsOverCapacityAndPadsEachExpertsRows) {
  auto cpu = make_cpu_backend();
  Side s(*cpu);
  // Slots (t, j): e0 e1 | e0 e2 | e0 e1 | e1 e0 | pad pad.
  Tensor ids = s.make_i32({5, 2}, {0, 1, 0, 2, 0, 1, 1, 0, -1, -1});
  Tensor weights = s.make(Kind::act, {5, 2}, {.6f, .4f, .5f, .5f, .7f, .3f, .8f, .2f, 0.f, 0.f});
  Tensor kept = s.make_i32({5, 2}, std::vector<int32_t>(10, 99));
  Tensor dropped = s.make_i32({1}, {5});
  const int probs = static_cast<int>(MoeDropPolicy::probs),
            position = static_cast<int>(MoeDropPolicy::position);
  auto got = [&](const Tensor& t) {
    std::vector<int32_t> v(static_cast<size_t>(t.numel()));
    cpu->read(v.data(), DType::i32, t);
    return v;
  };
  // Expert 0 keeps .7 and .6 (slots 4, 0), expert 1 .8 and .4 (slots 6, 1); expert 2 is under.
  cpu->moe_capacity_drop(kept, dropped, ids, weights, 3, 2, probs);
  EXPECT_EQ(got(kept), (std::vector<int32_t>{0, 1, -1, 2, 0, -1, 1, -1, -1, -1}));
  EXPECT_EQ(got(dropped), (std::vector<int32_t>{8}));  // 5 + 3
  EXPECT_EQ(got(ids), (std::vector<int32_t>{0, 1, 0, 2, 0, 1, 1, 0, -1, -1}));
  // By position the first two slots of each expert stay.
  cpu->moe_capacity_drop(kept, Tensor(), ids, weights, 3, 2, position);
  EXPECT_EQ(got(kept), (std::vector<int32_t>{0, 1, 0, 2, -1, 1, -1, -1, -1, -1}));
  // Equal weights: the lower slot stays.
  Tensor ties = s.make(Kind::act, {5, 2}, std::vector<float>(10, .5f));
  cpu->moe_capacity_drop(kept, Tensor(), ids, ties, 3, 1, probs);
  EXPECT_EQ(got(kept), (std::vector<int32_t>{0, 1, -1, 2, -1, -1, -1, -1, -1, -1}));
  // A capacity no expert reaches drops nothing.
  cpu->moe_capacity_drop(kept, dropped, ids, weights, 3, 4, probs);
  EXPECT_EQ(got(kept), got(ids));
  EXPECT_EQ(got(dropped), (std::vector<int32_t>{8}));

  // Padded to capacity 2 after the probs drop: expert e's rows are [2e, 2e + 2).
  cpu->moe_capacity_drop(kept, Tensor(), ids, weights, 3, 2, probs);
  Tensor x = s.make(Kind::act, {5, 1}, {1, 2, 3, 4, 5});
  Tensor x_sorted = s.make(Kind::act, {6, 1}, std::vector<float>(6, 7.f));
  Tensor offsets = s.make_i32({4}, std::vector<int32_t>(4, 99));
  Tensor slot_rows = s.make_i32({5, 2}, std::vector<int32_t>(10, 99));
  cpu->moe_dispatch(x_sorted, offsets, slot_rows, x, kept, 2);
  EXPECT_EQ(got(offsets), (std::vector<int32_t>{0, 2, 4, 6}));
  EXPECT_EQ(got(slot_rows), (std::vector<int32_t>{0, 2, -1, 4, 1, -1, 3, -1, -1, -1}));
  EXPECT_EQ(s.get(x_sorted), (std::vector<float>{1, 3, 1, 4, 2, 0}));
  // A dropped slot adds nothing to its token.
  Tensor y = s.make(Kind::act, {5, 1}, std::vector<float>(5, 0.f));
  cpu->moe_combine(y, x_sorted, slot_rows, weights, false);
  EXPECT_EQ(s.get(y), (std::vector<float>{.6f * 1 + .4f * 1, .5f * 2, .7f * 3, .8f * 4, 0.f}));
  EXPECT_TRUE(s.guards_intact());

  // The padded experts' projection: expert e's weight [1, 1] is e + 1, so each row is scaled by
  // its expert's; rows_per_expert must be the segments dispatch made.
  Tensor w3 = s.make(Kind::act, {3, 1, 1}, {1, 2, 3});
  Tensor y3 = s.make(Kind::act, {6, 1}, std::vector<float>(6, 9.f));
  cpu->moe_grouped_linear(y3, x_sorted, w3, offsets, 2);
  EXPECT_EQ(s.get(y3), (std::vector<float>{1, 3, 2, 8, 6, 0}));
  EXPECT_THROW(cpu->moe_grouped_linear(y3, x_sorted, w3, offsets, 3), Error);
  Tensor compact = s.make_i32({4}, {0, 2, 4, 5});
  EXPECT_THROW(cpu->moe_grouped_linear(y3, x_sorted, w3, compact, 2), Error);

  // Undropped routing does not fit the padded segments; the wrong rows are refused.
  EXPECT_THROW(cpu->moe_dispatch(x_sorted, offsets, slot_rows, x, ids, 2), Error);
  Tensor short_sorted = s.make(Kind::act, {5, 1}, std::vector<float>(5, 0.f));
  EXPECT_THROW(cpu->moe_dispatch(short_sorted, offsets, slot_rows, x, kept, 2), Error);
  EXPECT_THROW(cpu->moe_capacity_drop(kept, Tensor(), ids, weights, 3, 0, probs), Error);
  EXPECT_THROW(cpu->moe_capacity_drop(kept, Tensor(), ids, weights, 3, 2, 2), Error);
  EXPECT_THROW(cpu->moe_capacity_drop(ids, Tensor(), ids, weights, 3, 2, probs), Error);
}

// Each backward is the adjoint of its forward, which is linear in the input it differentiates:
// <dy, f(x)> = <f^T(dy), x> for the permutation, the projections (in x and in w) and the combine
// (in y_sorted and in the weights), on random routing with padding.
TEST(MoeBackwardOnTheCpu, EachBackwardIsItsForwardsAdjoint) {
  auto cpu = make_cpu_backend();
  Side s(*cpu);
  const int64_t T = 37, E = 6, H = 12, N = 10;
  const int k = 3;
  Rng rng(140);
  auto dot = [](const std::vector<float>& a, const std::vector<float>& b) {
    double d = 0;
    for (size_t i = 0; i < a.size(); ++i) d += double(a[i]) * b[i];
    return d;
  };
  Tensor logits = s.make(Kind::act, {T, E}, rng.normal(T * E));
  Tensor ids = s.make_i32({T, k}, std::vector<int32_t>(T * k, 0));
  Tensor weights = s.make(Kind::act, {T, k}, std::vector<float>(T * k, 0.f));
  Tensor real = s.make_i32({1}, {30});
  cpu->moe_route(ids, weights, Tensor(), logits, k, real);
  const std::vector<float> xv = rng.normal(T * H);
  Tensor x = s.make(Kind::act, {T, H}, xv);
  Tensor x_sorted = s.make(Kind::act, {T * k, H}, std::vector<float>(T * k * H, 0.f));
  Tensor offsets = s.make_i32({E + 1}, std::vector<int32_t>(E + 1, 0));
  Tensor slot_rows = s.make_i32({T, k}, std::vector<int32_t>(T * k, 0));
  cpu->moe_dispatch(x_sorted, offsets, slot_rows, x, ids, 0);
  std::vector<int32_t> off(static_cast<size_t>(E + 1));
  cpu->read(off.data(), DType::i32, offsets);
  const int64_t R = off.back();
  ASSERT_EQ(R, 30 * k);

  // Dispatch: <dx_sorted, x_sorted> over the routed rows = <dispatch^T(dx_sorted), x>.
  const std::vector<float> g_sorted = rng.normal(T * k * H);
  Tensor dx_sorted = s.make(Kind::act, {T * k, H}, g_sorted);
  Tensor dx = s.make(Kind::act, {T, H}, std::vector<float>(T * H, 0.f));
  cpu->moe_dispatch_backward(dx, dx_sorted, slot_rows);
  const std::vector<float> xs = s.get(x_sorted.slice(0, R)),
                           gs(g_sorted.begin(), g_sorted.begin() + R * H);
  EXPECT_NEAR(dot(gs, xs), dot(s.get(dx), xv), 1e-4 * std::fabs(dot(gs, xs)) + 1e-6);

  // Projections: <dy, x_sorted . w> = <dx, x_sorted> = <dw, w>.
  const std::vector<float> wv = rng.normal(E * H * N);
  Tensor w = s.make(Kind::act, {E, H, N}, wv);
  Tensor y_sorted = s.make(Kind::act, {T * k, N}, std::vector<float>(T * k * N, 0.f));
  cpu->moe_grouped_linear(y_sorted, x_sorted, w, offsets, 0);
  const std::vector<float> dyv = rng.normal(T * k * N);
  Tensor dy = s.make(Kind::act, {T * k, N}, dyv);
  Tensor dxs = s.make(Kind::act, {T * k, H}, std::vector<float>(T * k * H, 0.f));
  Tensor dw = s.make(Kind::f32, {E, H, N}, std::vector<float>(E * H * N, 0.f));
  cpu->moe_grouped_linear_backward(dxs, dw, dy, x_sorted, w, offsets, 0);
  const std::vector<float> ys = s.get(y_sorted.slice(0, R)), dys(dyv.begin(), dyv.begin() + R * N);
  const double forward = dot(dys, ys);
  EXPECT_NEAR(dot(s.get(dxs.slice(0, R)), xs), forward, 1e-4 * std::fabs(forward));
  EXPECT_NEAR(dot(s.get(dw), wv), forward, 1e-4 * std::fabs(forward));
  // dw accumulates.
  cpu->moe_grouped_linear_backward(dxs, dw, dy, x_sorted, w, offsets, 0);
  EXPECT_NEAR(dot(s.get(dw), wv), 2 * forward, 2e-4 * std::fabs(forward));

  // Combine: <dout, combine(y_sorted, weights)> = <dy_sorted, y_sorted> = <dweights, weights>.
  Tensor out = s.make(Kind::act, {T, N}, std::vector<float>(T * N, 0.f));
  cpu->moe_combine(out, y_sorted, slot_rows, weights, false);
  const std::vector<float> doutv = rng.normal(T * N);
  Tensor dout = s.make(Kind::act, {T, N}, doutv);
  Tensor dy_sorted = s.make(Kind::act, {T * k, N}, std::vector<float>(T * k * N, 0.f));
  Tensor dweights = s.make(Kind::f32, {T, k}, std::vector<float>(T * k, 5.f));
  cpu->moe_combine_backward(dy_sorted, dweights, dout, y_sorted, slot_rows, weights);
  const double combined = dot(doutv, s.get(out));
  EXPECT_NEAR(dot(s.get(dy_sorted.slice(0, R)), ys), combined, 1e-4 * std::fabs(combined));
  EXPECT_NEAR(dot(s.get(dweights), s.get(weights)), combined, 1e-4 * std::fabs(combined));
  // Padding slots (tokens 30 on) get no weight gradient.
  EXPECT_EQ(s.get(dweights)[static_cast<size_t>(30 * k)], 0.f);
  EXPECT_TRUE(s.guards_intact());
}

// The router's backward against central differences of its forward: L = sum_j c_j w_j + sum_e
// a_e p_e, whose gradient moe_route_backward gives from dweights = c and aux_dprob = a. Padding
// rows get zeros.
TEST(MoeBackwardOnTheCpu, RouterBackwardIsTheForwardsDerivative) {
  auto cpu = make_cpu_backend();
  Side s(*cpu);
  const int64_t T = 9, E = 7;
  const int k = 3;
  Rng rng(170);
  const std::vector<float> logits = rng.normal(T * E, 0.f, 2.f), c = rng.normal(T * k),
                           a = rng.normal(E);
  Tensor lg = s.make(Kind::act, {T, E}, logits);
  Tensor ids = s.make_i32({T, k}, std::vector<int32_t>(T * k, 0));
  Tensor weights = s.make(Kind::act, {T, k}, std::vector<float>(T * k, 0.f));
  Tensor probs = s.make(Kind::f32, {T, E}, std::vector<float>(T * E, 0.f));
  Tensor real = s.make_i32({1}, {T - 1});
  cpu->moe_route(ids, weights, probs, lg, k, real);
  Tensor dlogits = s.make(Kind::act, {T, E}, std::vector<float>(T * E, 9.f));
  cpu->moe_route_backward(dlogits, s.make(Kind::f32, {T, k}, c), probs, ids,
                          s.make(Kind::f32, {E}, a));
  const std::vector<float> analytic = s.get(dlogits);
  auto loss_of_row = [&](int64_t t, const std::vector<float>& row) {
    Side r(*cpu);
    Tensor l1 = r.make(Kind::act, {1, E}, row);
    Tensor i1 = r.make_i32({1, k}, std::vector<int32_t>(k, 0));
    Tensor w1 = r.make(Kind::act, {1, k}, std::vector<float>(k, 0.f));
    Tensor p1 = r.make(Kind::f32, {1, E}, std::vector<float>(E, 0.f));
    cpu->moe_route(i1, w1, p1, l1, k, Tensor());
    const std::vector<float> w = r.get(w1), p = r.get(p1);
    double L = 0;
    for (int j = 0; j < k; ++j) L += double(c[t * k + j]) * w[j];
    for (int64_t e = 0; e < E; ++e) L += double(a[e]) * p[e];
    return L;
  };
  const float h = 1e-2f;
  for (int64_t t = 0; t < T - 1; ++t)
    for (int64_t e = 0; e < E; ++e) {
      std::vector<float> up(logits.begin() + t * E, logits.begin() + (t + 1) * E), down = up;
      up[e] += h;
      down[e] -= h;
      const double numeric = (loss_of_row(t, up) - loss_of_row(t, down)) / (2 * h);
      EXPECT_NEAR(analytic[t * E + e], numeric, 2e-3) << "row " << t << " expert " << e;
    }
  for (int64_t e = 0; e < E; ++e) EXPECT_EQ(analytic[(T - 1) * E + e], 0.f);
  EXPECT_TRUE(s.guards_intact());
}

// The load-balancing loss as HF writes it, worked by hand: two layers' statistics of 2 real rows
// each (N = 4), 3 experts, k = 1.
TEST(MoeBackwardOnTheCpu, AuxLossIsHFsLoadBalancingLoss) {
  auto cpu = make_cpu_backend();
  Side s(*cpu);
  Tensor load = s.make(Kind::f32, {3}, {0.f, 0.f, 0.f});
  Tensor prob_sum = s.make(Kind::f32, {3}, {0.f, 0.f, 0.f});
  // Layer 1 routes rows to experts 0, 2; layer 2 to 0, 0; the third row is padding.
  cpu->moe_route_stats(
      load, prob_sum, s.make_i32({3, 1}, {0, 2, -1}),
      s.make(Kind::f32, {3, 3}, {0.5f, 0.25f, 0.25f, 0.25f, 0.25f, 0.5f, 0, 0, 0}));
  cpu->moe_route_stats(load, prob_sum, s.make_i32({3, 1}, {0, 0, -1}),
                       s.make(Kind::f32, {3, 3}, {0.75f, 0.25f, 0.f, 0.5f, 0.5f, 0.f, 0, 0, 0}));
  EXPECT_EQ(s.get(load), (std::vector<float>{3.f, 0.f, 1.f}));
  EXPECT_EQ(s.get(prob_sum), (std::vector<float>{2.f, 1.25f, 0.75f}));
  Tensor aux = s.make(Kind::f32, {1}, {1.f});
  Tensor dprob = s.make(Kind::f32, {3}, {9.f, 9.f, 9.f});
  cpu->moe_aux_loss(aux, dprob, load, prob_sum, s.make_i32({1}, {2}), 2, 0.5f);
  // E * sum_e f_e P_e = 3 * (3/4 * 2/4 + 0 + 1/4 * 0.75/4) = 1.265625, added to 1.
  EXPECT_FLOAT_EQ(s.get(aux)[0], 2.265625f);
  // 0.5 * 3 * load_e / 16.
  EXPECT_EQ(s.get(dprob), (std::vector<float>{0.28125f, 0.f, 0.09375f}));
  // No real rows: nothing added, no gradient.
  cpu->moe_aux_loss(aux, dprob, load, prob_sum, s.make_i32({1}, {0}), 2, 0.5f);
  EXPECT_FLOAT_EQ(s.get(aux)[0], 2.265625f);
  EXPECT_EQ(s.get(dprob), (std::vector<float>{0.f, 0.f, 0.f}));
  EXPECT_THROW(cpu->moe_route_stats(load, prob_sum, s.make_i32({1, 1}, {3}),
                                    s.make(Kind::f32, {1, 3}, {1.f, 0.f, 0.f})),
               Error);
  EXPECT_TRUE(s.guards_intact());
}

}  // namespace
// The CPU oracle's padding semantics (runs everywhere): rows of segments starting at or past
// real_rows are zeros, and the real rows are exactly what they are without real_rows.
TEST(CpuAttentionSegments, PaddingSegmentIsZeroAndRealRowsAreUnchanged) {
  auto cpu = make_cpu_backend();
  const int heads = 2, hd = 16;
  const int64_t rows = 100, hidden = int64_t{heads} * hd;
  const std::vector<int32_t> cu = {0, 40, 64, 100, 100};
  Arena arena(*cpu, size_t{1} << 20);
  Tensor qkv = arena.alloc(DType::f32, {rows, 3 * hidden});
  Tensor cu_t = arena.alloc(DType::i32, {5});
  Tensor real_t = arena.alloc(DType::i32, {1});
  Tensor plain = arena.alloc(DType::f32, {rows, hidden});
  Tensor padded = arena.alloc(DType::f32, {rows, hidden});
  Rng rng(62);
  const std::vector<float> x = rng.normal(rows * 3 * hidden);
  cpu->write(qkv, x.data(), DType::f32);
  cpu->write(cu_t, cu.data(), DType::i32);
  const int32_t real = 64;
  cpu->write(real_t, &real, DType::i32);
  const std::vector<float> junk(static_cast<size_t>(rows * hidden), 7.0f);
  cpu->write(padded, junk.data(), DType::f32);
  const float scale = 0.25f;
  cpu->attention_segments(plain, qkv, cu_t, 4, heads, hd, scale, Tensor());
  cpu->attention_segments(padded, qkv, cu_t, 4, heads, hd, scale, real_t);
  const float* p = plain.as<float>();
  const float* q = padded.as<float>();
  for (int64_t i = 0; i < rows * hidden; ++i) {
    if (i < real * hidden) {
      ASSERT_EQ(q[i], p[i]) << "real element " << i;
    } else {
      ASSERT_EQ(q[i], 0.0f) << "padding element " << i;
    }
  }
  // The padding segment is attended when no count is given.
  EXPECT_NE(p[real * hidden], 0.0f);
}

}  // namespace iris
