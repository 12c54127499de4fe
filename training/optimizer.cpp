#include "training/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include "core/safetensors.h"

namespace iris {
namespace {

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
    IRIS_CHECK(
        a.bindings[i].tensor().dtype == DType::f32 && b.bindings[i].tensor().dtype == DType::f32,
        "AdamW: '", a.bindings[i].hf_name, "' must be f32 (master weights)");
  }
}

}  // namespace

double grad_norm(const ModelWeights& grads, const FreezeSpec& frozen) {
  double ss = 0.0;
  for (const WeightBinding& b : grads.bindings) {
    if (frozen.frozen(b.hf_name)) continue;
    const Tensor g = b.tensor();
    IRIS_CHECK(g.device == Device::cpu, "grad_norm reads CPU gradients");
    const float* p = g.as<float>();
    for (int64_t i = 0, n = g.numel(); i < n; ++i) ss += double(p[i]) * double(p[i]);
  }
  return std::sqrt(ss);
}

namespace {

// Element offset of a tensor inside its weights' arena.
int64_t offset_in(const ModelWeights& w, const Tensor& t) {
  return static_cast<int64_t>(
      (static_cast<const char*>(t.data) - static_cast<const char*>(w.arena.base())) /
      static_cast<ptrdiff_t>(dtype_size(t.dtype)));
}

Tensor flat(Backend& be, const ModelWeights& w, DType dtype) {
  return Tensor(w.arena.base(), dtype, be.device(),
                {static_cast<int64_t>(w.arena.capacity() / dtype_size(dtype))});
}

}  // namespace

AdamW::AdamW(Backend& backend, const ModelConfig& cfg, ModelWeights& master, ModelWeights& grads,
             const AdamWConfig& config, ModelWeights* working)
    : be_(backend), config_(config), master_(master), grads_(grads), working_(working) {
  IRIS_CHECK(
      config.beta1 >= 0.0f && config.beta1 < 1.0f && config.beta2 >= 0.0f && config.beta2 < 1.0f,
      "AdamW betas must lie in [0, 1), got ", config.beta1, ", ", config.beta2);
  IRIS_CHECK(config.eps > 0.0f, "AdamW eps must be positive, got ", config.eps);
  IRIS_CHECK(config.weight_decay >= 0.0f, "AdamW weight_decay must not be negative");
  check_same_bindings(master, grads, "gradients");
  m_ = allocate_weights(backend, cfg, DType::f32);
  v_ = allocate_weights(backend, cfg, DType::f32);
  check_same_bindings(master, *m_, "moments (config differs from the parameters')");
  const size_t n = master.bindings.size();
  // The flat buffers are walked with the master's offsets: every f32 copy must share its layout.
  for (size_t i = 0; i < n; ++i) {
    const int64_t off = offset_in(master, master.bindings[i].tensor());
    IRIS_CHECK(offset_in(grads, grads.bindings[i].tensor()) == off &&
                   offset_in(*m_, m_->bindings[i].tensor()) == off,
               "AdamW: the gradients of '", master.bindings[i].hf_name,
               "' are laid out unlike the master weights; allocate both with allocate_weights");
  }
  if (working) {
    IRIS_CHECK(working->bindings.size() == n, "AdamW: the working weights hold ",
               working->bindings.size(), " tensors, the master weights ", n);
    IRIS_CHECK(working->text.embed.dtype == backend.compute_dtype(),
               "AdamW: the working weights must be in the backend's compute dtype");
  }
  flat_master_ = flat(be_, master, DType::f32);
  flat_grads_ = flat(be_, grads, DType::f32);
  flat_m_ = flat(be_, *m_, DType::f32);
  flat_v_ = flat(be_, *v_, DType::f32);
  if (working) flat_working_ = flat(be_, *working, backend.compute_dtype());
  be_.fill_zero(flat_m_);
  be_.fill_zero(flat_v_);

  const auto nt = static_cast<int64_t>(n);
  auto plan = [&](Arena& a) {
    spans_ = a.alloc(DType::i64, {nt, 3});
    hyper_ = a.alloc(DType::f32, {nt, 2});
    steps_dev_ = a.alloc(DType::i64, {nt});
    lr_ = a.alloc(DType::f32, {1});
    grad_stats_ = a.alloc(DType::f32, {2});
    norm_history_ = a.alloc(DType::f32, {kNormHistory});
  };
  Arena planning;
  plan(planning);
  tables_ = Arena(backend, planning.used());
  plan(tables_);
  std::vector<int64_t> spans(static_cast<size_t>(3 * n));
  for (size_t i = 0; i < n; ++i) {
    const Tensor t = master.bindings[i].tensor();
    spans[3 * i] = offset_in(master, t);
    spans[3 * i + 1] = t.numel();
    spans[3 * i + 2] = working ? offset_in(*working, working->bindings[i].tensor()) : 0;
  }
  be_.write(spans_, spans.data(), DType::i64);
  const std::vector<int64_t> zeros(n, 0);
  be_.write(steps_dev_, zeros.data(), DType::i64);
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

void AdamW::write_hyper(const FreezeSpec& frozen) {
  std::vector<float> hyper(2 * master_.bindings.size());
  for (size_t i = 0; i < master_.bindings.size(); ++i) {
    const WeightBinding& b = master_.bindings[i];
    hyper[2 * i] = b.hf_shape.size() >= 2 ? config_.weight_decay : 0.0f;
    hyper[2 * i + 1] = frozen.frozen(b.hf_name) ? 0.0f : config_.lr_scale(model_part(b.hf_name));
  }
  be_.write(hyper_, hyper.data(), DType::f32);
  hyper_frozen_ = frozen;
  hyper_written_ = true;
}

void AdamW::step(float scheduled_lr, const FreezeSpec& frozen) {
  if (!hyper_written_ || frozen.vision_tower != hyper_frozen_.vision_tower ||
      frozen.merger != hyper_frozen_.merger ||
      frozen.language_model != hyper_frozen_.language_model)
    write_hyper(frozen);
  if (unread_norms_ == kNormHistory) read_norm_history();
  be_.write(lr_, &scheduled_lr, DType::f32);
  be_.grad_norm_clip(grad_stats_, flat_grads_, spans_, hyper_, config_.clip_grad_norm);
  be_.copy(norm_history_.slice(unread_norms_, unread_norms_ + 1), grad_stats_.slice(0, 1));
  ++unread_norms_;
  be_.adamw_step(flat_master_, flat_grads_, flat_m_, flat_v_, flat_working_, spans_, hyper_,
                 steps_dev_, lr_, grad_stats_, config_.beta1, config_.beta2, config_.eps);
  ++steps_;
}

void AdamW::read_norm_history() {
  const size_t done = read_norms_.size();
  read_norms_.resize(done + static_cast<size_t>(unread_norms_));
  if (unread_norms_ > 0)
    be_.read(read_norms_.data() + done, DType::f32, norm_history_.slice(0, unread_norms_));
  unread_norms_ = 0;
}

std::vector<float> AdamW::take_grad_norms() {
  read_norm_history();
  std::vector<float> out;
  out.swap(read_norms_);
  if (!out.empty()) last_norm_ = out.back();
  return out;
}

void AdamW::save(const std::string& path) const {
  const size_t n = master_.bindings.size();
  // Host copies of the device state, written in one pass.
  std::vector<float> m(static_cast<size_t>(flat_m_.numel())), v(m.size());
  std::vector<int64_t> param_steps(n);
  be_.read(m.data(), DType::f32, flat_m_);
  be_.read(v.data(), DType::f32, flat_v_);
  be_.read(param_steps.data(), DType::i64, steps_dev_);
  std::vector<SafetensorsWriteItem> items;
  items.reserve(3 * n);
  for (size_t i = 0; i < n; ++i) {
    const WeightBinding& b = master_.bindings[i];
    const int64_t off = offset_in(master_, b.tensor());
    items.push_back({"exp_avg." + b.hf_name, DType::f32, b.hf_shape, m.data() + off});
    items.push_back({"exp_avg_sq." + b.hf_name, DType::f32, b.hf_shape, v.data() + off});
    items.push_back({"step." + b.hf_name, DType::i64, {1}, &param_steps[i]});
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
  for (const WeightBinding& b : master_.bindings) {
    src.push_back(entry("exp_avg." + b.hf_name, DType::f32, b.hf_shape));
    src.push_back(entry("exp_avg_sq." + b.hf_name, DType::f32, b.hf_shape));
    src.push_back(entry("step." + b.hf_name, DType::i64, {1}));
  }
  std::vector<int64_t> param_steps(master_.bindings.size());
  for (size_t i = 0; i < master_.bindings.size(); ++i) {
    be_.write(m_->bindings[i].tensor(), src[3 * i], DType::f32);
    be_.write(v_->bindings[i].tensor(), src[3 * i + 1], DType::f32);
    std::memcpy(&param_steps[i], src[3 * i + 2], sizeof(int64_t));
  }
  be_.write(steps_dev_, param_steps.data(), DType::i64);
  steps_ = steps;
}

}  // namespace iris
