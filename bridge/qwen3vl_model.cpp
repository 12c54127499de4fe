#include "bridge/qwen3vl_model.h"

#include <algorithm>
#include <filesystem>

#include "bridge/joined_model.h"
#include "bridge/vision_cuda_graph_helper.h"
#include "language/mrope.h"

namespace iris {

namespace {

// One prefill chunk of T rows at prompt row c0, whose n_img pad rows (at `index` within the
// chunk) take the vision rows from `vision_row` on.
class PrefillChunk final : public JoinedForwardSteps {
 public:
  PrefillChunk(Backend& be, TextDecoder& decoder, const VisionEncoder::Output& vision,
               int64_t vision_row, const Tensor& index, int64_t T, int64_t c0,
               const HiddenObserver& observer, std::vector<float>* all_logits)
      : be_(be),
        decoder_(decoder),
        vision_(vision),
        vision_row_(vision_row),
        index_(index),
        T_(T),
        c0_(c0),
        observer_(observer),
        all_logits_(all_logits) {}

  void embed() override { decoder_.embed(T_); }
  void scatter_vision() override {
    if (n_img() > 0) be_.scatter_rows(decoder_.hidden(T_), rows(vision_.embeds), index_, false);
  }
  void layer(int l) override { decoder_.layer(l, T_); }
  void add_deepstack(int l) override {
    if (n_img() > 0 && l < static_cast<int>(vision_.deepstack.size()))
      be_.scatter_rows(decoder_.hidden(T_), rows(vision_.deepstack[l]), index_, true);
  }
  void final_norm() override { decoder_.final_norm(T_); }
  void head() override {
    if (all_logits_ == nullptr) {
      decoder_.lm_head(T_ - 1, 1);
      return;
    }
    decoder_.lm_head(0, T_);
    const size_t V = static_cast<size_t>(decoder_.config().vocab_size);
    const size_t old = all_logits_->size();
    all_logits_->resize(old + static_cast<size_t>(T_) * V);
    be_.read(all_logits_->data() + old, DType::f32, decoder_.logits(T_));
  }
  void hidden_state(int index) override {
    if (!observer_) return;
    const bool last = index == decoder_.config().num_hidden_layers;
    observer_(index, c0_, last ? decoder_.normed(T_) : decoder_.hidden(T_));
  }

 private:
  int64_t n_img() const { return index_.numel(); }
  Tensor rows(const Tensor& t) const { return t.slice(vision_row_, vision_row_ + n_img()); }

  Backend& be_;
  TextDecoder& decoder_;
  const VisionEncoder::Output& vision_;
  int64_t vision_row_;
  Tensor index_;
  int64_t T_, c0_;
  const HiddenObserver& observer_;
  std::vector<float>* all_logits_;
};

}  // namespace

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
  whole_model_ = split_stages(cfg_, 1).front();
  Arena plan;
  plan.alloc(DType::i32, {limits_.max_step_tokens});
  arena_ = Arena(backend_, plan.used());
  scatter_index_ = arena_.alloc(DType::i32, {limits_.max_step_tokens});
  cos_.resize(static_cast<size_t>(limits_.max_step_tokens * cfg_.text.head_dim));
  sin_.resize(cos_.size());
  index_host_.reserve(static_cast<size_t>(limits_.max_step_tokens));
}

void Qwen3VLModel::encode_images(const VisionPixels& pixels, const std::vector<GridTHW>& grids) {
  encode_vision(pixels, grids,
                image_runs(grids, cfg_.image_token_id, cfg_.vision.spatial_merge_size));
}

void Qwen3VLModel::encode_vision(const VisionPixels& pixels, const std::vector<GridTHW>& grids,
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
  vision_out_ = graphs_.empty() ? vision_->encode(pixels, grids)
                                : encode_with_graph_helpers(graphs_, *vision_, pixels, grids);
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

    PrefillChunk chunk(backend_, *decoder_, vision_out_, image_rank, scatter_index_.slice(0, n_img),
                       T, c0, observer, limits_.all_logits ? &prompt_logits_ : nullptr);
    joined_forward(cfg_, whole_model_, chunk);
    last_row_in_step_ = limits_.all_logits ? T - 1 : 0;
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
    DecodeSteps step(*decoder_, false);
    joined_forward(cfg_, whole_model_, step);
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
