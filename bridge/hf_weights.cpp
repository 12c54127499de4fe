#include "bridge/hf_weights.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <set>

#include "bridge/architecture.h"
#include "bridge/peft.h"
#include "core/json_read.h"

namespace iris {

void WeightTable::add(const std::string& hf_name, Tensor& dst, std::vector<int64_t> dims,
                      std::vector<int64_t> hf_shape) {
  if (hf_shape.empty()) hf_shape = dims;
  planned_.emplace_back(&dst, std::move(dims));
  w_.bindings.push_back({hf_name, std::move(hf_shape), &dst, 0});
}

void WeightTable::add_stacked(Tensor& dst, std::vector<int64_t> dims) {
  planned_.emplace_back(&dst, std::move(dims));
}

void WeightTable::part(const std::string& hf_name, std::vector<int64_t> hf_shape, Tensor& dst,
                       int64_t row_offset) {
  w_.bindings.push_back({hf_name, std::move(hf_shape), &dst, row_offset});
}

void WeightTable::linear(const std::string& prefix, Tensor& w, Tensor& b, int64_t n, int64_t k) {
  add(prefix + ".weight", w, {n, k});
  add(prefix + ".bias", b, {n});
}

void WeightTable::norm(const std::string& prefix, Tensor& w, Tensor* b, int64_t n) {
  add(prefix + ".weight", w, {n});
  w_.bindings.back().norm_weight = true;
  if (b != nullptr) add(prefix + ".bias", *b, {n});
}

void WeightTable::lora(const LoraConfig& lora, const std::string& prefix,
                       const std::vector<std::pair<std::string, int64_t>>& modules, int64_t in,
                       LoraAdapters& dst) {
  if (!lora.enabled()) return;
  int64_t offset = 0, adapted = 0;
  for (const auto& [name, rows] : modules) adapted += lora.adapts(prefix + name);
  // The parts are bound by address: sized once, before any binding.
  dst.parts.assign(static_cast<size_t>(adapted), LoraAdapter{});
  dst.scale = lora.scale();
  dst.dropout = static_cast<float>(lora.dropout);
  size_t k = 0;
  for (const auto& [name, rows] : modules) {
    if (lora.adapts(prefix + name)) {
      LoraAdapter& p = dst.parts[k++];
      p.out_offset = offset;
      // Each module its own mask, the same in every process: FNV-1a of its name.
      p.dropout_stream = 1469598103934665603ULL;
      for (const char c : prefix + name)
        p.dropout_stream = (p.dropout_stream ^ static_cast<unsigned char>(c)) * 1099511628211ULL;
      add(prefix + name + ".lora_A.weight", p.a, {lora.rank, in});
      add(prefix + name + ".lora_B.weight", p.b, {rows, lora.rank});
    }
    offset += rows;
  }
}

void declare_decoder(const ModelConfig& cfg, ModelWeights& w, WeightTable& t,
                     const std::string& prefix, DecoderTensors kind) {
  const TextConfig& tc = cfg.text;
  const int64_t H = tc.hidden_size, V = tc.vocab_size, hd = tc.head_dim;
  DecoderWeights& tw = w.text;
  t.add(prefix + "embed_tokens.weight", tw.embed, {V, H});
  tw.layers.resize(static_cast<size_t>(tc.num_hidden_layers));
  const int64_t qw = tc.q_width(), kvw = tc.kv_width(), It = tc.intermediate_size;
  for (int l = 0; l < tc.num_hidden_layers; ++l) {
    const std::string pre = prefix + "layers." + std::to_string(l) + ".";
    DecoderLayerWeights& L = tw.layers[l];
    t.norm(pre + "input_layernorm", L.input_norm_w, nullptr, H);
    t.add_stacked(L.qkv_w, {qw + 2 * kvw, H});
    t.part(pre + "self_attn.q_proj.weight", {qw, H}, L.qkv_w, 0);
    t.part(pre + "self_attn.k_proj.weight", {kvw, H}, L.qkv_w, qw);
    t.part(pre + "self_attn.v_proj.weight", {kvw, H}, L.qkv_w, qw + kvw);
    if (kind == DecoderTensors::qwen2) {
      t.add_stacked(L.qkv_b, {qw + 2 * kvw});
      t.part(pre + "self_attn.q_proj.bias", {qw}, L.qkv_b, 0);
      t.part(pre + "self_attn.k_proj.bias", {kvw}, L.qkv_b, qw);
      t.part(pre + "self_attn.v_proj.bias", {kvw}, L.qkv_b, qw + kvw);
    }
    t.add(pre + "self_attn.o_proj.weight", L.o_w, {H, qw});
    t.lora(cfg.lora, pre + "self_attn.", {{"q_proj", qw}, {"k_proj", kvw}, {"v_proj", kvw}}, H,
           L.qkv_lora);
    t.lora(cfg.lora, pre + "self_attn.", {{"o_proj", H}}, qw, L.o_lora);
    if (kind == DecoderTensors::qwen3) {
      t.norm(pre + "self_attn.q_norm", L.q_norm_w, nullptr, hd);
      t.norm(pre + "self_attn.k_norm", L.k_norm_w, nullptr, hd);
    }
    t.norm(pre + "post_attention_layernorm", L.post_norm_w, nullptr, H);
    if (tc.sparse_layer(l)) {
      // The router and the fused experts, stored [E, in, out] (no .weight suffix on the experts).
      const int64_t E = tc.num_experts, Ie = tc.moe_intermediate_size;
      t.add(pre + "mlp.gate.weight", L.router_w, {E, H});
      t.add(pre + "mlp.experts.gate_up_proj", L.experts_gate_up_w, {E, H, 2 * Ie});
      t.add(pre + "mlp.experts.down_proj", L.experts_down_w, {E, Ie, H});
      continue;
    }
    t.add_stacked(L.gate_up_w, {2 * It, H});
    t.part(pre + "mlp.gate_proj.weight", {It, H}, L.gate_up_w, 0);
    t.part(pre + "mlp.up_proj.weight", {It, H}, L.gate_up_w, It);
    t.add(pre + "mlp.down_proj.weight", L.down_w, {H, It});
    t.lora(cfg.lora, pre + "mlp.", {{"gate_proj", It}, {"up_proj", It}}, H, L.gate_up_lora);
    t.lora(cfg.lora, pre + "mlp.", {{"down_proj", H}}, It, L.down_lora);
  }
  t.norm(prefix + "norm", tw.norm_w, nullptr, H);
  if (!cfg.tie_word_embeddings) t.add("lm_head.weight", tw.lm_head, {V, H});
}

namespace {

struct Planner {
  std::vector<std::pair<Tensor*, std::vector<int64_t>>> tensors;
};

void declare(const ModelConfig& cfg, ModelWeights& w, Planner& p) {
  WeightTable table(w);
  cfg.arch->declare_weights(cfg, w, table);
  p.tensors = table.planned();
  w.tied_lm_head = cfg.tie_word_embeddings;
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

// The two layouts of every family's tensors: the hub's original one (visual.*, model.layers.*)
// and transformers 5.x's module names (model.visual.*, model.language_model.layers.*); HF loads
// either, and so does Iris.
std::vector<std::string> name_candidates(const std::string& name) {
  static const std::string visual = "visual.", model = "model.", new_visual = "model.visual.",
                           new_language = "model.language_model.";
  std::vector<std::string> c{name};
  auto starts = [&](const std::string& p) { return name.rfind(p, 0) == 0; };
  if (starts(new_visual))
    c.push_back(visual + name.substr(new_visual.size()));
  else if (starts(new_language))
    c.push_back(model + name.substr(new_language.size()));
  else if (starts(visual))
    c.push_back(new_visual + name.substr(visual.size()));
  else if (starts(model))
    c.push_back(new_language + name.substr(model.size()));
  return c;
}

// Tensors a checkpoint may hold beyond the model's: rotary inv_freq buffers that older exports
// saved, and an lm_head that duplicates tied embeddings (HF ignores both on load).
bool ignorable_extra_tensor(const std::string& name, const ModelConfig& cfg) {
  const std::string suffix = ".inv_freq";
  if (name.size() > suffix.size() &&
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
    return true;
  return cfg.tie_word_embeddings && name == "lm_head.weight";
}

}  // namespace

std::unique_ptr<ModelWeights> allocate_weights(Backend& backend, const ModelConfig& cfg) {
  return allocate_weights(backend, cfg, backend.compute_dtype());
}

std::unique_ptr<ModelWeights> allocate_weights(Backend& backend, const ModelConfig& cfg,
                                               DType dtype) {
  return allocate_weights(backend, cfg, dtype, {});
}

namespace {

// Declares cfg's weights and places each tensor `keep` accepts: make_arena(bytes) makes the
// arena for allocate_weights' layout of `bytes`, and place(offset) gives the byte offset in it of
// the tensor at `offset` of that layout.
std::unique_ptr<ModelWeights> lay_out_weights(const ModelConfig& cfg, DType dtype,
                                              const std::function<bool(const std::string&)>& keep,
                                              Device device,
                                              const std::function<Arena(size_t bytes)>& make_arena,
                                              const std::function<size_t(size_t)>& place) {
  auto w = std::make_unique<ModelWeights>();
  Planner p;
  declare(cfg, *w, p);
  std::set<const Tensor*> kept;
  for (const WeightBinding& b : w->bindings)
    if (!keep || keep(b.hf_name)) kept.insert(b.target);
  std::vector<std::pair<Tensor*, Tensor>> planned;  // target, its tensor at its layout offset
  Arena plan;
  for (auto& [t, dims] : p.tensors) {
    if (!kept.count(t)) continue;
    const size_t offset = plan.used();
    Tensor x = plan.alloc(dtype, dims);
    x.data = reinterpret_cast<void*>(offset);
    planned.push_back({t, x});
  }
  w->arena = make_arena(plan.used());
  for (auto& [t, x] : planned) {
    const size_t at = place(reinterpret_cast<size_t>(x.data));
    IRIS_CHECK(at + x.nbytes() <= w->arena.capacity(), "weights: a tensor placed at ", at, " (",
               x.nbytes(), " bytes) leaves the arena of ", w->arena.capacity(), " bytes");
    x.data = static_cast<char*>(w->arena.base()) + at;
    x.device = device;
    *t = x;
  }
  if (w->tied_lm_head) w->text.lm_head = w->text.embed;
  return w;
}

size_t same_place(size_t offset) {
  return offset;
}

}  // namespace

std::unique_ptr<ModelWeights> allocate_weights(
    Backend& backend, const ModelConfig& cfg, DType dtype,
    const std::function<bool(const std::string&)>& keep) {
  return lay_out_weights(
      cfg, dtype, keep, backend.device(),
      [&backend](size_t bytes) { return bytes > 0 ? Arena(backend, bytes) : Arena(); }, same_place);
}

std::unique_ptr<ModelWeights> reserve_weights(Device device, const ModelConfig& cfg, DType dtype,
                                              const std::function<bool(const std::string&)>& keep) {
  return lay_out_weights(
      cfg, dtype, keep, device,
      [device](size_t bytes) { return Arena::addresses_only(device, bytes); }, same_place);
}

std::unique_ptr<ModelWeights> allocate_weights_placed(
    Backend& backend, const ModelConfig& cfg, DType dtype,
    const std::function<bool(const std::string&)>& keep, size_t capacity,
    const std::function<size_t(size_t offset)>& place) {
  return lay_out_weights(
      cfg, dtype, keep, backend.device(),
      [&backend, capacity](size_t) { return capacity > 0 ? Arena(backend, capacity) : Arena(); },
      place);
}

std::unique_ptr<ModelWeights> load_weights(Backend& backend, const ModelConfig& cfg,
                                           const std::string& dir, WeightLoadTimes* times) {
  SafetensorsCheckpoint ckpt(dir);
  // Match every declared tensor to the checkpoint before allocating anything, so that a config
  // that disagrees with its weights is a clear error rather than a huge allocation.
  ModelWeights layout;
  Planner unused_planner;
  declare(cfg, layout, unused_planner);
  std::vector<const SafetensorsEntry*> sources;
  std::set<std::string> used;
  for (const WeightBinding& b : layout.bindings) {
    const SafetensorsEntry* e = nullptr;
    for (const std::string& n : name_candidates(b.hf_name))
      if (ckpt.contains(n)) {
        e = &ckpt.at(n);
        break;
      }
    // LoRA adapters come from a training run's own checkpoints; a base model has none, and they
    // start at zero (no change to the model) until initialised or loaded from an adapter.
    if (e == nullptr && is_lora_tensor(b.hf_name)) {
      sources.push_back(nullptr);
      continue;
    }
    IRIS_CHECK(e != nullptr, "checkpoint ", dir, " is missing tensor '", b.hf_name,
               "' (expected shape ", shape_text(b.hf_shape), "); is this a ",
               cfg.arch->display_name(),
               " checkpoint matching its config.json (num_hidden_layers, "
               "vision depth, deepstack_visual_indexes, tie_word_embeddings)?");
    IRIS_CHECK(e->dtype == DType::bf16 || e->dtype == DType::f16 || e->dtype == DType::f32, e->file,
               ": tensor '", e->name, "' has dtype ", dtype_name(e->dtype),
               "; weights must be bf16, f16 or f32");
    IRIS_CHECK(e->shape == b.hf_shape, e->file, ": tensor '", e->name, "' has shape ",
               shape_text(e->shape), " but config.json implies ", shape_text(b.hf_shape));
    sources.push_back(e);
    used.insert(e->name);
  }
  // A tensor nothing reads means config.json describes a smaller model than the weights (fewer
  // layers, blocks or deepstack mergers): running it would silently drop part of the model.
  std::vector<std::string> unused;
  for (const std::string& name : ckpt.names())
    if (!used.count(name) && !ignorable_extra_tensor(name, cfg)) unused.push_back(name);
  IRIS_CHECK(unused.empty(), "checkpoint ", dir, " holds ", unused.size(),
             " tensor(s) that its config.json does not describe, e.g. '",
             unused.empty() ? std::string() : clip_text(unused.front(), 120),
             "'; config.json and the weights disagree (check text_config.num_hidden_layers, "
             "vision_config.depth and deepstack_visual_indexes)");

  auto w = allocate_weights(backend, cfg);
  using Clock = std::chrono::steady_clock;
  auto ms = [](Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); };
  WeightLoadTimes t;
  const auto t0 = Clock::now();
  // Every tensor in one call, so that a backend with host staging reads the file on several
  // threads. A NaN or Inf weight otherwise surfaces only as NaN logits, far from its cause: the
  // backend checks each block as it stages it, so the file is read once.
  std::vector<Backend::HostWrite> writes;
  std::vector<const SafetensorsEntry*> written;
  for (size_t i = 0; i < w->bindings.size(); ++i) {
    const WeightBinding& b = w->bindings[i];
    if (sources[i] == nullptr) {
      backend.fill_zero(b.tensor());
      continue;
    }
    const int64_t rows = b.hf_shape[0];
    writes.push_back(
        {b.target->slice(b.row_offset, b.row_offset + rows), sources[i]->data, sources[i]->dtype});
    written.push_back(sources[i]);
  }
  const std::vector<int64_t> bad = backend.write_all_finite(writes);
  for (size_t i = 0; i < written.size(); ++i) {
    if (bad[i] < 0) continue;
    const SafetensorsEntry& e = *written[i];
    SafetensorsEntry one = e;
    one.data = static_cast<const char*>(e.data) + bad[i] * int64_t(dtype_size(e.dtype));
    one.nbytes = dtype_size(e.dtype);
    float value = 0;
    convert_to_f32(one, &value);
    IRIS_FAIL(e.file, ": tensor '", e.name, "' holds a non-finite value (", value, " at element ",
              bad[i], "); the checkpoint is corrupt");
  }
  t.read_ms = ms(Clock::now() - t0);
  const auto t2 = Clock::now();
  backend.synchronize();
  t.upload_ms += ms(Clock::now() - t2);
  if (times != nullptr) *times = t;
  return w;
}

void save_weights(Backend& backend, const ModelWeights& w, const std::string& path, DType dtype) {
  save_weights(backend, w, path, dtype, {});
}

void save_weights(Backend& backend, const ModelWeights& w, const std::string& path, DType dtype,
                  const std::function<bool(const std::string&)>& keep) {
  std::vector<std::vector<uint64_t>> storage;
  std::vector<SafetensorsWriteItem> items;
  storage.reserve(w.bindings.size());
  for (const WeightBinding& b : w.bindings) {
    if (keep && !keep(b.hf_name)) continue;
    const int64_t rows = b.hf_shape[0];
    const Tensor src = b.target->slice(b.row_offset, b.row_offset + rows);
    storage.emplace_back((src.numel() * dtype_size(dtype) + 7) / 8);
    backend.read(storage.back().data(), dtype, src);
    items.push_back({b.hf_name, dtype, b.hf_shape, storage.back().data()});
  }
  write_safetensors(path, items, {{"format", "pt"}});
}

}  // namespace iris
