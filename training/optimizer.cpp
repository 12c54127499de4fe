#include "training/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include <omp.h>

#ifdef __SSE2__
#include <immintrin.h>
#endif

#include "core/safetensors.h"

namespace iris {
namespace {

// The memory of binding b: rows [row_offset, row_offset + hf_shape[0]) of its target.
Tensor bound(const WeightBinding& b) {
  return b.target->slice(b.row_offset, b.row_offset + b.hf_shape[0]);
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

void check_same_bindings(const ModelWeights& a, const ModelWeights& b, const char* what) {
  IRIS_CHECK(a.bindings.size() == b.bindings.size(), "AdamW: the ", what, " hold ",
             b.bindings.size(), " tensors but the parameters ", a.bindings.size(),
             "; build both with allocate_weights from the same config");
  for (size_t i = 0; i < a.bindings.size(); ++i) {
    IRIS_CHECK(a.bindings[i].hf_name == b.bindings[i].hf_name &&
                   a.bindings[i].hf_shape == b.bindings[i].hf_shape,
               "AdamW: ", what, " tensor ", i, " is '", b.bindings[i].hf_name, "' ",
               shape_text(b.bindings[i].hf_shape), ", the parameter is '", a.bindings[i].hf_name,
               "' ", shape_text(a.bindings[i].hf_shape));
    IRIS_CHECK(bound(a.bindings[i]).dtype == DType::f32 && bound(b.bindings[i]).dtype == DType::f32,
               "AdamW: '", a.bindings[i].hf_name, "' must be f32 (master weights)");
  }
}

// Below this many elements a loop runs on one thread: a parallel region costs barriers, and on a
// loaded machine a barrier waits for a descheduled thread.
constexpr int64_t kParallelGrain = int64_t(1) << 16;

// Per-thread partial sums combined in thread order: an OpenMP reduction combines in arrival
// order, and a norm that differs in the last bit between runs would break bit-exact resumption
// (it sets the clipping coefficient).
double sum_of_squares(const float* p, int64_t n) {
  constexpr int kMaxThreads = 256;
  double partial[kMaxThreads] = {};
  const int n_threads = std::min(omp_get_max_threads(), kMaxThreads);
#pragma omp parallel num_threads(n_threads) if (n > kParallelGrain)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    // Eight independent accumulators: one f64 sum would be bound by the add latency.
    double acc[8] = {};
    const int64_t b = n * tid / nt, e = n * (tid + 1) / nt;
    int64_t i = b;
    for (; i + 8 <= e; i += 8)
      for (int k = 0; k < 8; ++k) acc[k] += double(p[i + k]) * double(p[i + k]);
    for (; i < e; ++i) acc[0] += double(p[i]) * double(p[i]);
    double s = 0.0;
    for (double a : acc) s += a;
    partial[tid] = s;
  }
  double total = 0.0;
  for (int k = 0; k < n_threads; ++k) total += partial[k];
  return total;
}

// AdamW on elements [b, e), in the order of torch's foreach kernels. decay is exactly 1 without
// weight decay, so the multiply needs no branch. torch.lerp has two forms, chosen by the weight.
struct AdamWScalars {
  float decay, one_minus_b1, b2, one_minus_b2, bc2_sqrt, eps, neg_step_size;
};

inline void adamw_element(float& p, float& m, float& v, float g, const AdamWScalars& s) {
  const float mk =
      s.one_minus_b1 < 0.5f ? m + s.one_minus_b1 * (g - m) : g - (g - m) * (1.0f - s.one_minus_b1);
  const float vk = v * s.b2 + s.one_minus_b2 * (g * g);
  p = p * s.decay + s.neg_step_size * (mk / (std::sqrt(vk) / s.bc2_sqrt + s.eps));
  m = mk;
  v = vk;
}

// The square root keeps the compiler from vectorising the scalar loop (errno semantics), and the
// update is a third of a tiny model's training step, so x86 runs four lanes with SSE. Each lane
// performs the scalar element's IEEE operations in the same order: results are bit-identical.
void adamw_range(float* p, const float* g, float* m, float* v, int64_t b, int64_t e,
                 const AdamWScalars& s) {
  int64_t k = b;
#ifdef __SSE2__
  const __m128 w = _mm_set1_ps(s.one_minus_b1), omw = _mm_set1_ps(1.0f - s.one_minus_b1),
               b2 = _mm_set1_ps(s.b2), w2 = _mm_set1_ps(s.one_minus_b2),
               bc2 = _mm_set1_ps(s.bc2_sqrt), eps = _mm_set1_ps(s.eps),
               decay = _mm_set1_ps(s.decay), step = _mm_set1_ps(s.neg_step_size);
  const bool low = s.one_minus_b1 < 0.5f;
  for (; k + 4 <= e; k += 4) {
    const __m128 gk = _mm_loadu_ps(g + k), mk0 = _mm_loadu_ps(m + k);
    const __m128 mk = low ? _mm_add_ps(mk0, _mm_mul_ps(w, _mm_sub_ps(gk, mk0)))
                          : _mm_sub_ps(gk, _mm_mul_ps(_mm_sub_ps(gk, mk0), omw));
    const __m128 vk =
        _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(v + k), b2), _mm_mul_ps(w2, _mm_mul_ps(gk, gk)));
    const __m128 denom = _mm_add_ps(_mm_div_ps(_mm_sqrt_ps(vk), bc2), eps);
    const __m128 pk =
        _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(p + k), decay), _mm_mul_ps(step, _mm_div_ps(mk, denom)));
    _mm_storeu_ps(p + k, pk);
    _mm_storeu_ps(m + k, mk);
    _mm_storeu_ps(v + k, vk);
  }
#endif
  for (; k < e; ++k) adamw_element(p[k], m[k], v[k], g[k], s);
}

void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, const AdamWScalars& s) {
#pragma omp parallel if (n > kParallelGrain)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    adamw_range(p, g, m, v, n * tid / nt, n * (tid + 1) / nt, s);
  }
}

}  // namespace

double grad_norm(const ModelWeights& grads, const FreezeSpec& frozen) {
  double ss = 0.0;
  for (const WeightBinding& b : grads.bindings) {
    if (frozen.frozen(b.hf_name)) continue;
    const Tensor g = bound(b);
    const float* p = g.as<float>();
    const int64_t n = g.numel();
    ss += sum_of_squares(p, n);
  }
  return std::sqrt(ss);
}

AdamW::AdamW(Backend& cpu, const ModelConfig& cfg, ModelWeights& params, ModelWeights& grads,
             const AdamWConfig& config)
    : be_(cpu), config_(config), params_(params), grads_(grads) {
  IRIS_CHECK(cpu.device() == Device::cpu && cpu.compute_dtype() == DType::f32,
             "AdamW runs on the fp32 CPU backend, got ", cpu.name());
  IRIS_CHECK(
      config.beta1 >= 0.0f && config.beta1 < 1.0f && config.beta2 >= 0.0f && config.beta2 < 1.0f,
      "AdamW betas must lie in [0, 1), got ", config.beta1, ", ", config.beta2);
  IRIS_CHECK(config.eps > 0.0f, "AdamW eps must be positive, got ", config.eps);
  IRIS_CHECK(config.weight_decay >= 0.0f, "AdamW weight_decay must not be negative");
  check_same_bindings(params, grads, "gradients");
  m_ = allocate_weights(cpu, cfg);
  v_ = allocate_weights(cpu, cfg);
  check_same_bindings(params, *m_, "moments (config differs from the parameters')");
  for (const WeightBinding& b : m_->bindings) be_.fill_zero(bound(b));
  for (const WeightBinding& b : v_->bindings) be_.fill_zero(bound(b));
  param_steps_.assign(params.bindings.size(), 0);
}

float AdamWConfig::lr_scale(ModelPart part) const {
  switch (part) {
    case ModelPart::vision_tower:
      return vision_tower_lr_scale;
    case ModelPart::merger:
      return merger_lr_scale;
    case ModelPart::language_model:
      return 1.0f;
  }
  return 1.0f;
}

double AdamW::step(float scheduled_lr, const FreezeSpec& frozen) {
  const double norm = grad_norm(grads_, frozen);
  IRIS_CHECK(std::isfinite(norm), "AdamW: the gradient norm is ", norm,
             " (NaN or overflow in the backward); lower the learning rate or check the data");
  // torch computes the clip coefficient in f32 from the f32 norm.
  const float clip_coef = config_.clip_grad_norm > 0.0f
                              ? config_.clip_grad_norm / (static_cast<float>(norm) + 1e-6f)
                              : 1.0f;
  const float b1 = config_.beta1, b2 = config_.beta2;
  const float one_minus_b1 = static_cast<float>(1.0 - double(b1));
  const float one_minus_b2 = static_cast<float>(1.0 - double(b2));
  for (size_t i = 0; i < params_.bindings.size(); ++i) {
    const WeightBinding& pb = params_.bindings[i];
    if (frozen.frozen(pb.hf_name)) continue;
    const float scale = config_.lr_scale(model_part(pb.hf_name));
    // A scale of exactly 1 keeps the f32 learning rate bit for bit (the HF golden trajectory).
    const float lr =
        scale == 1.0f ? scheduled_lr : static_cast<float>(double(scheduled_lr) * scale);
    const Tensor pt = bound(pb);
    float* p = pt.as<float>();
    float* g = bound(grads_.bindings[i]).as<float>();
    float* m = bound(m_->bindings[i]).as<float>();
    float* v = bound(v_->bindings[i]).as<float>();
    const int64_t n = pt.numel();
    const int64_t t = ++param_steps_[i];
    // Scalars as torch's foreach AdamW forms them: Python doubles, cast to f32 in the kernel.
    const double wd = pb.hf_shape.size() >= 2 ? double(config_.weight_decay) : 0.0;
    const float decay = static_cast<float>(1.0 - double(lr) * wd);
    const double bc1 = 1.0 - std::pow(double(b1), double(t));
    const double bc2 = 1.0 - std::pow(double(b2), double(t));
    const float neg_step_size = static_cast<float>(-(double(lr) / bc1));
    const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    if (clip_coef < 1.0f) {
#pragma omp parallel for schedule(static) if (n > kParallelGrain)
      for (int64_t k = 0; k < n; ++k) g[k] *= clip_coef;
    }
    adamw_update(p, g, m, v, n,
                 {decay, one_minus_b1, b2, one_minus_b2, bc2_sqrt, config_.eps, neg_step_size});
  }
  ++steps_;
  return norm;
}

void AdamW::save(const std::string& path) const {
  std::vector<SafetensorsWriteItem> items;
  items.reserve(3 * params_.bindings.size());
  for (size_t i = 0; i < params_.bindings.size(); ++i) {
    const WeightBinding& b = params_.bindings[i];
    items.push_back({"exp_avg." + b.hf_name, DType::f32, b.hf_shape, bound(m_->bindings[i]).data});
    items.push_back(
        {"exp_avg_sq." + b.hf_name, DType::f32, b.hf_shape, bound(v_->bindings[i]).data});
    items.push_back({"step." + b.hf_name, DType::i64, {1}, &param_steps_[i]});
  }
  write_safetensors(path, items,
                    {{"format", "iris-adamw"},
                     {"steps", std::to_string(steps_)},
                     {"beta1", std::to_string(config_.beta1)},
                     {"beta2", std::to_string(config_.beta2)},
                     {"eps", std::to_string(config_.eps)},
                     {"weight_decay", std::to_string(config_.weight_decay)}});
}

void AdamW::load(const std::string& path) {
  SafetensorsFile file(path);
  const auto& meta = file.metadata();
  const auto fmt = meta.find("format");
  IRIS_CHECK(fmt != meta.end() && fmt->second == "iris-adamw", path,
             " is not an Iris AdamW state file (metadata format != iris-adamw)");
  const auto st = meta.find("steps");
  IRIS_CHECK(st != meta.end(), path, " has no 'steps' metadata entry");
  int64_t steps = 0;
  try {
    steps = std::stoll(st->second);
  } catch (const std::exception&) {
    IRIS_FAIL(path, " has a malformed 'steps' metadata entry '", st->second, "'");
  }
  auto entry = [&](const std::string& name, DType dtype, const std::vector<int64_t>& shape) {
    IRIS_CHECK(file.contains(name), path, " lacks '", name,
               "'; was it saved for a model with another config?");
    const SafetensorsEntry& e = file.at(name);
    IRIS_CHECK(e.dtype == dtype && e.shape == shape, path, ": '", name, "' is ",
               dtype_name(e.dtype), " ", shape_text(e.shape), ", expected ", dtype_name(dtype), " ",
               shape_text(shape));
    return e.data;
  };
  // Check everything before touching the state, so a bad file leaves the optimizer as it was.
  std::vector<const void*> src;
  for (const WeightBinding& b : params_.bindings) {
    src.push_back(entry("exp_avg." + b.hf_name, DType::f32, b.hf_shape));
    src.push_back(entry("exp_avg_sq." + b.hf_name, DType::f32, b.hf_shape));
    src.push_back(entry("step." + b.hf_name, DType::i64, {1}));
  }
  for (size_t i = 0; i < params_.bindings.size(); ++i) {
    const Tensor m = bound(m_->bindings[i]), v = bound(v_->bindings[i]);
    std::memcpy(m.data, src[3 * i], m.nbytes());
    std::memcpy(v.data, src[3 * i + 1], v.nbytes());
    std::memcpy(&param_steps_[i], src[3 * i + 2], sizeof(int64_t));
  }
  steps_ = steps;
}

}  // namespace iris
