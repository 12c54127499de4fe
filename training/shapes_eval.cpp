#include "training/shapes_eval.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "bridge/chat_prompt.h"
#include "bridge/generator.h"
#include "bridge/model_config.h"
#include "core/fs.h"
#include "core/json_read.h"
#include "language/tokenizer.h"
#include "training/dataset.h"
#include "vision/image.h"
#include "vision/preprocess.h"

namespace iris {
namespace {

struct HeldoutSample {
  std::string image, prompt, reference;
};

// The shapes set's messages lines: user [image, text], assistant caption.
HeldoutSample parse_sample(const std::string& line, const std::string& where,
                           const std::filesystem::path& base) {
  HeldoutSample s;
  try {
    const auto j = parse_json(line, where, kJsonLineLimits);
    for (const auto& m : j.at("messages")) {
      const std::string role = m.at("role").get<std::string>();
      const auto& c = m.at("content");
      if (role == "assistant") s.reference = c.is_string() ? c.get<std::string>() : "";
      if (role != "user" || !c.is_array()) continue;
      for (const auto& part : c) {
        const std::string type = part.at("type").get<std::string>();
        if (type == "image") s.image = (base / part.at("image").get<std::string>()).string();
        if (type == "text") s.prompt = part.at("text").get<std::string>();
      }
    }
  } catch (const nlohmann::json::exception& e) {
    IRIS_FAIL(where, ": not a shapes messages line (", json_error_text(e), ")");
  }
  IRIS_CHECK(!s.image.empty() && !s.reference.empty(), where,
             ": a shapes line needs a user image and an assistant caption");
  return s;
}

}  // namespace

ShapesScore evaluate_shapes(
    const std::string& model_dir, const std::string& heldout_jsonl, const ShapesEvalOptions& opt,
    const std::function<void(const std::string&, const std::string&)>& on_sample) {
  namespace fs = std::filesystem;
  check_regular_file(heldout_jsonl, "held-out file");
  std::ifstream in(heldout_jsonl);
  IRIS_CHECK(in.good(), "cannot open ", heldout_jsonl,
             " (make it with: iris data shapes --out DIR)");
  std::vector<HeldoutSample> samples;
  int line_no = 0;
  for (std::string line;
       read_bounded_line(in, line, kMaxJsonlLineBytes, heldout_jsonl, line_no + 1);) {
    ++line_no;
    if (line.empty()) continue;
    samples.push_back(parse_sample(line, heldout_jsonl + ":" + std::to_string(line_no),
                                   fs::path(heldout_jsonl).parent_path()));
    if (opt.limit > 0 && static_cast<int>(samples.size()) >= opt.limit) break;
  }
  IRIS_CHECK(!samples.empty(), heldout_jsonl, " holds no samples");

  const Tokenizer tok = Tokenizer::from_file((fs::path(model_dir) / "tokenizer.json").string());
  const ModelConfig cfg = ModelConfig::from_file((fs::path(model_dir) / "config.json").string());
  const PreprocessorConfig pre = model_preprocessor(model_dir, cfg);
  const ChatFormat chat = ChatFormat::from_dir(model_dir);
  // Size the model for the largest image of the split: every sample is planned within it.
  std::vector<PreprocessedImage> images;
  int64_t max_patches = 0;
  for (const auto& s : samples) {
    images.push_back(preprocess_image(load_image(s.image), pre));
    max_patches = std::max(max_patches, images.back().pixel_values.dim(0));
  }
  auto backend = make_backend(opt.device);
  ModelLimits limits;
  limits.max_context = 512;
  limits.max_step_tokens = 512;
  limits.max_images = 1;
  limits.max_vision_patches = std::max<int64_t>(4, max_patches);
  Qwen3VLModel model(*backend, model_dir, limits);
  const auto stop =
      default_stop_ids(model_dir, [&](const std::string& t) { return tok.token_id(t); });

  const std::vector<uint8_t> sampleable = sampleable_ids(tok, model.config().text.vocab_size);
  ShapesScore total;
  for (size_t i = 0; i < samples.size(); ++i) {
    GenerationRequest req;
    req.grids = {images[i].grid_thw};
    req.pixel_values = images[i].pixel_values.data<float>();
    req.prompt_ids = build_generation_prompt(tok, chat, req.grids, samples[i].prompt, "",
                                             model.config().vision.spatial_merge_size);
    req.max_new_tokens = opt.max_new_tokens;
    req.stop_ids = stop;
    req.sampling.temperature = 0;
    req.sampleable = sampleable;
    GenerationResult res = generate(model, req);
    if (res.stopped) res.tokens.pop_back();
    const std::string predicted = tok.decode(res.tokens);
    total += score_shapes_caption(predicted, samples[i].reference);
    if (on_sample) on_sample(predicted, samples[i].reference);
  }
  return total;
}

}  // namespace iris
