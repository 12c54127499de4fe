#include "training/param_spec.h"

namespace iris {

int64_t ParamSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

ParamSpecs::ParamSpecs(const ModelWeights& layout, const FreezeSpec& frozen, DType compute_dtype)
    : frozen_(frozen) {
  build(layout, compute_dtype);
}

ParamSpecs::ParamSpecs(const ModelConfig& cfg, const FreezeSpec& frozen, DType compute_dtype)
    : frozen_(frozen) {
  // Keeping no tensor allocates nothing: the backend is never asked for memory.
  const std::unique_ptr<Backend> cpu = make_cpu_backend();
  const auto layout =
      allocate_weights(*cpu, cfg, DType::f32, [](const std::string&) { return false; });
  build(*layout, compute_dtype);
}

void ParamSpecs::build(const ModelWeights& layout, DType compute_dtype) {
  specs_.reserve(layout.bindings.size());
  for (const WeightBinding& b : layout.bindings) {
    ParamSpec s;
    s.hf_name = b.hf_name;
    s.shape = b.hf_shape;
    s.dtype = compute_dtype;
    s.part = model_part(b.hf_name);
    s.trainable = !frozen_.frozen(b.hf_name);
    specs_.push_back(std::move(s));
  }
}

bool ParamSpecs::trainable(const std::string& hf_name) const {
  return !frozen_.frozen(hf_name);
}

std::function<bool(const std::string&)> ParamSpecs::trainable_filter() const {
  return [frozen = frozen_](const std::string& name) { return !frozen.frozen(name); };
}

int64_t ParamSpecs::parameters(const std::function<bool(const std::string&)>& holds) const {
  int64_t n = 0;
  for (const ParamSpec& s : specs_)
    if (!holds || holds(s.hf_name)) n += s.numel();
  return n;
}

int64_t ParamSpecs::trainable_parameters(
    const std::function<bool(const std::string&)>& holds) const {
  int64_t n = 0;
  for (const ParamSpec& s : specs_)
    if (s.trainable && (!holds || holds(s.hf_name))) n += s.numel();
  return n;
}

std::unique_ptr<ModelWeights> allocate_state(Backend& backend, const ModelConfig& cfg,
                                             const ParamSpecs& specs) {
  return allocate_weights(backend, cfg, DType::f32, specs.trainable_filter());
}

size_t allocated_bytes(const ModelWeights& w) {
  return w.arena.capacity();
}

}  // namespace iris
