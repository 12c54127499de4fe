#include "bridge/qwen3vl_model.h"

#include <algorithm>
#include <filesystem>

#include "bridge/vision_cuda_graph_helper.h"
#include "language/mrope.h"

namespace iris {

Qwen3VLModel::Qwen3VLModel(Backend& backend, const std::string& dir, const ModelLimits& limits)
    : backend_(backend), limits_(limits) {
  namespace fs = std::filesystem;
  IRIS_CHECK(fs::is_directory(dir), "model directory ", dir,
             " does not exist (pass -m with a Hugging Face checkpoint directory)");
  cfg_ = ModelConfig::from_file((fs::path(dir) / "config.json").string());
  weights_ = load_weights(backend, cfg_, dir, &weight_load_times_);
  build();
}

Qwen3VLModel::Qwen3VLModel(Backend& backend, const ModelConfig& cfg,
                           std::unique_ptr<ModelWeights> weights, const ModelLimits& limits)
    : backend_(backend), cfg_(cfg), limits_(limits), weights_(std::move(weights)) {
  build();
}

Qwen3VLModel::~Qwen3VLModel() {
  for (VisionCudaGraphHelper* h : graphs_) h->model_destroyed();
}

void Qwen3VLModel::attach_graphs(VisionCudaGraphHelper* helper) {
  IRIS_CHECK(helper != nullptr && helper->model() == this,
             "attach_graphs: the CUDA graph helper was built from another model");
  if (std::find(graphs_.begin(), graphs_.end(), helper) == graphs_.end()) graphs_.push_back(helper);
}

void Qwen3VLModel::detach_graphs(VisionCudaGraphHelper* helper) noexcept {
  graphs_.erase(std::remove(graphs_.begin(), graphs_.end(), helper), graphs_.end());
}

void Qwen3VLModel::build() {
  IRIS_CHECK(limits_.max_step_tokens <= limits_.max_context,
             "the prefill chunk cannot exceed the context length");
  vision_ = std::make_unique<VisionEncoder>(backend_, cfg_.vision, weights_->vision,
                                            limits_.max_vision_patches, limits_.max_images + 1);
  DecoderLimits dl;
  dl.max_context = limits_.max_context;
  dl.max_step_tokens = limits_.max_step_tokens;
  dl.max_logit_rows = limits_.all_logits ? limits_.max_step_tokens : 1;
  decoder_ = std::make_unique<TextDecoder>(backend_, cfg_.text, weights_->text, dl);
  Arena plan;
  plan.alloc(DType::i32, {limits_.max_step_tokens});
  arena_ = Arena(backend_, plan.used());
  scatter_index_ = arena_.alloc(DType::i32, {limits_.max_step_tokens});
  cos_.resize(static_cast<size_t>(limits_.max_step_tokens * cfg_.text.head_dim));
  sin_.resize(cos_.size());
  index_host_.reserve(static_cast<size_t>(limits_.max_step_tokens));
}

void Qwen3VLModel::encode_images(const float* pixel_values, const std::vector<GridTHW>& grids) {
  encode_vision(pixel_values, grids,
                image_runs(grids, cfg_.image_token_id, cfg_.vision.spatial_merge_size));
}

void Qwen3VLModel::encode_vision(const float* pixel_values, const std::vector<GridTHW>& grids,
                                 std::vector<VisionRun> runs) {
  int64_t segments = 0;
  for (const GridTHW& g : grids) segments += g[0];
  IRIS_CHECK(segments <= limits_.max_images, "the call's images and video frame pairs (", segments,
             ") exceed the planned maximum of ", limits_.max_images);
  int64_t grid_tokens = 0, run_tokens = 0;
  for (const GridTHW& g : grids) grid_tokens += g[0] * g[1] * g[2] / cfg_.vision.merge_unit();
  for (const VisionRun& r : runs) run_tokens += r.tokens();
  IRIS_CHECK(grid_tokens == run_tokens, "the prompt's vision runs hold ", run_tokens,
             " tokens but the grids encode ", grid_tokens);
  grids_ = grids;
  runs_ = std::move(runs);
  if (grids.empty()) {
    vision_rows_ = 0;
    return;
  }
  vision_out_ = graphs_.empty() ? vision_->encode(pixel_values, grids)
                                : encode_with_graph_helpers(graphs_, *vision_, pixel_values, grids);
  vision_rows_ = vision_out_.embeds.dim(0);
}

void Qwen3VLModel::clear_cache() {
  n_past_ = 0;
  delta_ = 0;
  next_position_after_.clear();
}

void Qwen3VLModel::truncate_cache(int64_t rows) {
  IRIS_CHECK(rows >= 0 && rows <= n_past_, "cannot keep ", rows, " of the ", n_past_,
             " cached tokens");
  if (rows == n_past_) return;
  if (rows == 0) {
    clear_cache();
    return;
  }
  const int64_t next = next_position_after_[static_cast<size_t>(rows - 1)];
  IRIS_CHECK(next >= 0, "cannot cut the cached tokens inside an image");
  n_past_ = rows;
  delta_ = next - rows;
  next_position_after_.resize(static_cast<size_t>(rows));
}

void Qwen3VLModel::prefill(const std::vector<int32_t>& ids, const HiddenObserver& observer) {
  clear_cache();
  extend(ids, observer);
}

void Qwen3VLModel::extend(const std::vector<int32_t>& ids, const HiddenObserver& observer) {
  const int64_t L = static_cast<int64_t>(ids.size());
  IRIS_CHECK(L > 0, "the prompt is empty");
  if (n_past_ == 0)
    IRIS_CHECK(L <= limits_.max_context, "the prompt has ", L,
               " tokens, more than the maximum context of ", limits_.max_context,
               " (raise --ctx-size)");
  else
    IRIS_CHECK(n_past_ + L <= limits_.max_context, "the conversation so far (", n_past_,
               " tokens) and ", L, " new tokens exceed the maximum context of ",
               limits_.max_context, " (raise --ctx-size)");
  // The ids index the embedding table; the CUDA gather does not check them.
  const int32_t vocab = cfg_.text.vocab_size;
  for (int64_t i = 0; i < L; ++i)
    IRIS_CHECK(ids[i] >= 0 && ids[i] < vocab, "prompt token ", i, " has id ", ids[i],
               ", outside the model's vocabulary of ", vocab,
               " (text_config.vocab_size); the tokenizer and config.json disagree");
  const int32_t image_pad = cfg_.image_token_id, video_pad = cfg_.video_token_id;
  auto is_pad = [&](int32_t id) { return id == image_pad || id == video_pad; };
  const int64_t n_pads = std::count_if(ids.begin(), ids.end(), is_pad);
  IRIS_CHECK(n_pads == vision_rows_, "the prompt has ", n_pads,
             " <|image_pad|> and <|video_pad|> tokens but the ", grids_.size(),
             " encoded images and videos produce ", vision_rows_, " embeddings");
  rope_ = compute_rope_index(ids, runs_, image_pad, video_pad, next_position());
  delta_ = rope_.delta - n_past_;
  // A text token's three M-RoPE rows are equal; the token after it takes the next position.
  for (int64_t i = 0; i < L; ++i)
    next_position_after_.push_back(is_pad(ids[i]) ? -1 : rope_.positions[i] + 1);
  prompt_logits_.clear();
  int64_t image_rank = 0;  // image rows consumed by earlier chunks
  for (int64_t c0 = 0; c0 < L; c0 += limits_.max_step_tokens) {
    const int64_t T = std::min(limits_.max_step_tokens, L - c0);
    // Rotary tables for this chunk from the 3-row positions.
    std::vector<int64_t> pos(static_cast<size_t>(3 * T));
    for (int a = 0; a < 3; ++a)
      std::copy_n(rope_.positions.begin() + a * L + c0, T, pos.begin() + a * T);
    mrope_tables(cfg_.text, pos.data(), T, cos_.data(), sin_.data());
    decoder_->upload_step(ids.data() + c0, cos_.data(), sin_.data(), T, n_past_);
    index_host_.clear();
    for (int64_t i = 0; i < T; ++i)
      if (is_pad(ids[c0 + i])) index_host_.push_back(static_cast<int32_t>(i));
    const int64_t n_img = static_cast<int64_t>(index_host_.size());
    if (n_img > 0) backend_.write(scatter_index_.slice(0, n_img), index_host_.data(), DType::i32);

    decoder_->embed(T);
    Tensor x = decoder_->hidden(T);
    Tensor index = scatter_index_.slice(0, n_img);
    if (n_img > 0)
      backend_.scatter_rows(x, vision_out_.embeds.slice(image_rank, image_rank + n_img), index,
                            false);
    if (observer) observer(0, c0, x);
    const int n_layers = cfg_.text.num_hidden_layers;
    for (int l = 0; l < n_layers; ++l) {
      decoder_->layer(l, T);
      if (observer && l + 1 < n_layers) observer(l + 1, c0, x);
      if (n_img > 0 && l < static_cast<int>(vision_out_.deepstack.size()))
        backend_.scatter_rows(x, vision_out_.deepstack[l].slice(image_rank, image_rank + n_img),
                              index, true);
    }
    decoder_->final_norm(T);
    if (observer) observer(n_layers, c0, decoder_->normed(T));
    if (limits_.all_logits) {
      decoder_->lm_head(0, T);
      const size_t V = static_cast<size_t>(cfg_.text.vocab_size);
      const size_t old = prompt_logits_.size();
      prompt_logits_.resize(old + static_cast<size_t>(T) * V);
      backend_.read(prompt_logits_.data() + old, DType::f32, decoder_->logits(T));
      last_row_in_step_ = T - 1;
    } else {
      decoder_->lm_head(T - 1, 1);
      last_row_in_step_ = 0;
    }
    image_rank += n_img;
    n_past_ += T;
  }
}

void Qwen3VLModel::decode(int32_t token) {
  IRIS_CHECK(n_past_ > 0, "decode() needs a prefilled prompt");
  IRIS_CHECK(token >= 0 && token < cfg_.text.vocab_size, "token id ", token,
             " is outside the model's vocabulary of ", cfg_.text.vocab_size);
  const int64_t position = next_position();
  mrope_tables_1d(cfg_.text, position, 1, cos_.data(), sin_.data());
  decoder_->upload_step(&token, cos_.data(), sin_.data(), 1, n_past_);
  if (graphs_.empty()) {
    decoder_->embed(1);
    for (int l = 0; l < cfg_.text.num_hidden_layers; ++l) decoder_->layer(l, 1);
    decoder_->final_norm(1);
    decoder_->lm_head(0, 1);
  } else {
    decode_step_with_graph_helpers(graphs_);
  }
  last_row_in_step_ = 0;
  next_position_after_.push_back(position + 1);
  ++n_past_;
}

std::vector<float> Qwen3VLModel::last_logits() {
  std::vector<float> out(static_cast<size_t>(cfg_.text.vocab_size));
  Tensor rows = decoder_->logits(last_row_in_step_ + 1);
  backend_.read(out.data(), DType::f32, rows.slice(last_row_in_step_, last_row_in_step_ + 1));
  return out;
}

}  // namespace iris
