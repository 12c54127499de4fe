#include "bridge/hf_weights.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <set>

#include "core/json_read.h"

namespace iris {
namespace {

// Naming of the released Qwen3-VL checkpoints (transformers 5.x module names).
constexpr const char* kVisual = "model.visual.";
constexpr const char* kLanguage = "model.language_model.";

struct Planner {
  std::vector<std::pair<Tensor*, std::vector<int64_t>>> tensors;
  void add(Tensor& t, std::vector<int64_t> dims) { tensors.emplace_back(&t, std::move(dims)); }
};

void declare(const ModelConfig& cfg, ModelWeights& w, Planner& p) {
  const VisionConfig& v = cfg.vision;
  const TextConfig& t = cfg.text;
  const int64_t D = v.hidden_size, I = v.intermediate_size, M = v.merged_dim(),
                out = v.out_hidden_size;
  const int64_t H = t.hidden_size, V = t.vocab_size, hd = t.head_dim;
  auto& b = w.bindings;
  auto bind = [&](const std::string& name, std::vector<int64_t> shape, Tensor& dst,
                  int64_t row_offset = 0) {
    b.push_back({name, std::move(shape), &dst, row_offset});
  };
  auto linear = [&](const std::string& prefix, Tensor& wt, Tensor& bias, int64_t n, int64_t k) {
    p.add(wt, {n, k});
    p.add(bias, {n});
    bind(prefix + ".weight", {n, k}, wt);
    bind(prefix + ".bias", {n}, bias);
  };
  auto norm = [&](const std::string& prefix, Tensor& wt, Tensor& bias, int64_t n) {
    p.add(wt, {n});
    p.add(bias, {n});
    bind(prefix + ".weight", {n}, wt);
    bind(prefix + ".bias", {n}, bias);
  };

  VisionWeights& vw = w.vision;
  const std::string vis = kVisual;
  p.add(vw.patch_w, {D, v.patch_dim()});
  p.add(vw.patch_b, {D});
  bind(vis + "patch_embed.proj.weight",
       {D, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size}, vw.patch_w);
  bind(vis + "patch_embed.proj.bias", {D}, vw.patch_b);
  p.add(vw.pos_embed, {v.num_position_embeddings, D});
  bind(vis + "pos_embed.weight", {v.num_position_embeddings, D}, vw.pos_embed);
  vw.blocks.resize(static_cast<size_t>(v.depth));
  for (int i = 0; i < v.depth; ++i) {
    const std::string pre = vis + "blocks." + std::to_string(i) + ".";
    VisionBlockWeights& bl = vw.blocks[i];
    norm(pre + "norm1", bl.norm1_w, bl.norm1_b, D);
    norm(pre + "norm2", bl.norm2_w, bl.norm2_b, D);
    linear(pre + "attn.qkv", bl.qkv_w, bl.qkv_b, 3 * D, D);
    linear(pre + "attn.proj", bl.proj_w, bl.proj_b, D, D);
    linear(pre + "mlp.linear_fc1", bl.fc1_w, bl.fc1_b, I, D);
    linear(pre + "mlp.linear_fc2", bl.fc2_w, bl.fc2_b, D, I);
  }
  auto merger = [&](const std::string& pre, PatchMergerWeights& m, int64_t norm_dim) {
    norm(pre + "norm", m.norm_w, m.norm_b, norm_dim);
    linear(pre + "linear_fc1", m.fc1_w, m.fc1_b, M, M);
    linear(pre + "linear_fc2", m.fc2_w, m.fc2_b, out, M);
  };
  merger(vis + "merger.", vw.merger, D);
  vw.deepstack_mergers.resize(v.deepstack_visual_indexes.size());
  for (size_t k = 0; k < vw.deepstack_mergers.size(); ++k)
    merger(vis + "deepstack_merger_list." + std::to_string(k) + ".", vw.deepstack_mergers[k], M);

  DecoderWeights& tw = w.text;
  const std::string lang = kLanguage;
  p.add(tw.embed, {V, H});
  bind(lang + "embed_tokens.weight", {V, H}, tw.embed);
  tw.layers.resize(static_cast<size_t>(t.num_hidden_layers));
  const int64_t qw = t.q_width(), kvw = t.kv_width(), It = t.intermediate_size;
  for (int l = 0; l < t.num_hidden_layers; ++l) {
    const std::string pre = lang + "layers." + std::to_string(l) + ".";
    DecoderLayerWeights& L = tw.layers[l];
    p.add(L.input_norm_w, {H});
    bind(pre + "input_layernorm.weight", {H}, L.input_norm_w);
    p.add(L.qkv_w, {qw + 2 * kvw, H});
    bind(pre + "self_attn.q_proj.weight", {qw, H}, L.qkv_w, 0);
    bind(pre + "self_attn.k_proj.weight", {kvw, H}, L.qkv_w, qw);
    bind(pre + "self_attn.v_proj.weight", {kvw, H}, L.qkv_w, qw + kvw);
    p.add(L.o_w, {H, qw});
    bind(pre + "self_attn.o_proj.weight", {H, qw}, L.o_w);
    p.add(L.q_norm_w, {hd});
    bind(pre + "self_attn.q_norm.weight", {hd}, L.q_norm_w);
    p.add(L.k_norm_w, {hd});
    bind(pre + "self_attn.k_norm.weight", {hd}, L.k_norm_w);
    p.add(L.post_norm_w, {H});
    bind(pre + "post_attention_layernorm.weight", {H}, L.post_norm_w);
    p.add(L.gate_up_w, {2 * It, H});
    bind(pre + "mlp.gate_proj.weight", {It, H}, L.gate_up_w, 0);
    bind(pre + "mlp.up_proj.weight", {It, H}, L.gate_up_w, It);
    p.add(L.down_w, {H, It});
    bind(pre + "mlp.down_proj.weight", {H, It}, L.down_w);
  }
  p.add(tw.norm_w, {H});
  bind(lang + "norm.weight", {H}, tw.norm_w);
  w.tied_lm_head = cfg.tie_word_embeddings;
  if (!w.tied_lm_head) {
    p.add(tw.lm_head, {V, H});
    bind("lm_head.weight", {V, H}, tw.lm_head);
  }
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

// Older and flat layouts (visual.*, model.layers.*) name the same tensors differently.
std::vector<std::string> name_candidates(const std::string& name) {
  std::vector<std::string> c{name};
  if (name.rfind(kVisual, 0) == 0) c.push_back("visual." + name.substr(std::strlen(kVisual)));
  if (name.rfind(kLanguage, 0) == 0) c.push_back("model." + name.substr(std::strlen(kLanguage)));
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

std::unique_ptr<ModelWeights> allocate_weights(
    Backend& backend, const ModelConfig& cfg, DType dtype,
    const std::function<bool(const std::string&)>& keep) {
  auto w = std::make_unique<ModelWeights>();
  Planner p;
  declare(cfg, *w, p);
  std::set<const Tensor*> kept;
  for (const WeightBinding& b : w->bindings)
    if (!keep || keep(b.hf_name)) kept.insert(b.target);
  Arena plan;
  for (auto& [t, dims] : p.tensors)
    if (kept.count(t)) plan.alloc(dtype, dims);
  if (plan.used() > 0) w->arena = Arena(backend, plan.used());
  for (auto& [t, dims] : p.tensors)
    if (kept.count(t)) *t = w->arena.alloc(dtype, dims);
  if (w->tied_lm_head) w->text.lm_head = w->text.embed;
  return w;
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
    IRIS_CHECK(e != nullptr, "checkpoint ", dir, " is missing tensor '", b.hf_name,
               "' (expected shape ", shape_text(b.hf_shape),
               "); is this a Qwen3-VL checkpoint matching its config.json (num_hidden_layers, "
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
  std::vector<float> host;
  for (size_t i = 0; i < w->bindings.size(); ++i) {
    const WeightBinding& b = w->bindings[i];
    const SafetensorsEntry& e = *sources[i];
    const auto t0 = Clock::now();
    // The check reads every element anyway, so it costs little beside the copy; a NaN or Inf
    // weight otherwise surfaces only as NaN logits, far from its cause.
    const int64_t bad = first_non_finite(e);
    if (bad >= 0) {
      SafetensorsEntry one = e;
      one.data = static_cast<const char*>(e.data) + bad * int64_t(dtype_size(e.dtype));
      one.nbytes = dtype_size(e.dtype);
      float value = 0;
      convert_to_f32(one, &value);
      IRIS_FAIL(e.file, ": tensor '", e.name, "' holds a non-finite value (", value, " at element ",
                bad, "); the checkpoint is corrupt");
    }
    const void* src = e.data;
    DType src_dtype = e.dtype;
    if (e.dtype != b.target->dtype) {
      host.resize(e.nbytes / dtype_size(e.dtype));
      convert_to_f32(e, host.data());
      src = host.data();
      src_dtype = DType::f32;
    }
    const auto t1 = Clock::now();
    const int64_t rows = b.hf_shape[0];
    backend.write(b.target->slice(b.row_offset, b.row_offset + rows), src, src_dtype);
    t.read_ms += ms(t1 - t0);
    t.upload_ms += ms(Clock::now() - t1);
  }
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
