#include "bridge/generator.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/fs.h"
#include "core/json_read.h"

namespace iris {
namespace {

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

double GenerationTimings::prefill_tokens_per_s() const {
  return prefill_ms > 0 ? 1000.0 * double(prompt_tokens) / prefill_ms : 0.0;
}

double GenerationTimings::decode_tokens_per_s() const {
  // The first token comes from the prefill's logits; every later one costs a decode step.
  const int64_t steps = generated_tokens > 0 ? generated_tokens - 1 : 0;
  return decode_ms > 0 ? 1000.0 * double(steps) / decode_ms : 0.0;
}

GenerationResult generate(Qwen3VLModel& model, const GenerationRequest& req,
                          const std::function<void(int32_t)>& on_token,
                          const std::function<bool()>& stop) {
  IRIS_CHECK(req.max_new_tokens >= 0, "the number of tokens to predict must be >= 0");
  GenerationResult res;
  GenerationTimings& t = res.timings;
  t.prompt_tokens = static_cast<int64_t>(req.prompt_ids.size());
  t.image_patches = count_patches(req.grids);
  const int64_t cached = static_cast<int64_t>(req.cached_ids.size());
  IRIS_CHECK(cached == 0 || cached == model.n_past(), "the request continues ", cached,
             " cached tokens but the model's KV cache holds ", model.n_past());
  IRIS_CHECK(cached + t.prompt_tokens + req.max_new_tokens <= model.limits().max_context,
             cached > 0 ? str_cat("the conversation so far (", cached, " tokens), ") : "",
             "the prompt (", t.prompt_tokens, " tokens) plus ", req.max_new_tokens,
             " new tokens exceed the context of ", model.limits().max_context,
             " (raise --ctx-size or lower -n)");
  auto t0 = std::chrono::steady_clock::now();
  if (req.runs.empty())
    model.encode_images(req.pixel_values, req.grids);
  else
    model.encode_vision(req.pixel_values, req.grids, req.runs);
  model.backend().synchronize();
  t.vision_ms = ms_since(t0);

  t0 = std::chrono::steady_clock::now();
  if (cached > 0)
    model.extend(req.prompt_ids);
  else
    model.prefill(req.prompt_ids);
  std::vector<float> logits = model.last_logits();
  t.prefill_ms = ms_since(t0);
  if (req.keep_prompt_logits) res.prompt_logits = logits;

  Sampler sampler(req.sampling, req.sampleable);
  std::vector<int32_t> history;
  history.reserve(req.cached_ids.size() + req.prompt_ids.size() +
                  static_cast<size_t>(req.max_new_tokens));
  history.insert(history.end(), req.cached_ids.begin(), req.cached_ids.end());
  history.insert(history.end(), req.prompt_ids.begin(), req.prompt_ids.end());
  const size_t reply_start = history.size();
  t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < req.max_new_tokens; ++i) {
    if (i > 0) {
      model.decode(res.tokens.back());
      logits = model.last_logits();
    }
    const int32_t tok = sampler.sample(logits, history, reply_start);
    res.tokens.push_back(tok);
    history.push_back(tok);
    if (req.stop_ids.count(tok)) {
      res.stopped = true;
      break;
    }
    if (on_token) on_token(tok);
    if (stop && i + 1 < req.max_new_tokens && stop()) {
      res.halted = true;
      break;
    }
  }
  t.decode_ms = ms_since(t0);
  t.generated_tokens = static_cast<int64_t>(res.tokens.size());
  return res;
}

std::vector<uint8_t> sampleable_ids(const Tokenizer& tokenizer, int32_t vocab_size) {
  std::vector<uint8_t> mask(static_cast<size_t>(std::max(vocab_size, 0)));
  for (int32_t id = 0; id < vocab_size; ++id) mask[id] = tokenizer.contains_id(id) ? 1 : 0;
  return mask;
}

std::set<int32_t> default_stop_ids(const std::string& dir,
                                   const std::function<int32_t(const std::string&)>& find_id) {
  namespace fs = std::filesystem;
  std::set<int32_t> ids;
  const fs::path gen = fs::path(dir) / "generation_config.json";
  if (fs::exists(gen)) {
    const nlohmann::json j = read_json_file(gen.string(), "generation config");
    if (j.is_object() && j.contains("eos_token_id") && !j["eos_token_id"].is_null()) {
      const auto& e = j["eos_token_id"];
      const std::string where = gen.string() + ": eos_token_id";
      if (e.is_array()) {
        for (size_t i = 0; i < e.size(); ++i)
          ids.insert(static_cast<int32_t>(
              json_integer(e[i], where, "[" + std::to_string(i) + "]", 0, INT32_MAX)));
      } else {
        ids.insert(
            static_cast<int32_t>(json_integer(e, gen.string(), "eos_token_id", 0, INT32_MAX)));
      }
    }
  }
  if (!ids.empty()) return ids;
  const fs::path tc = fs::path(dir) / "tokenizer_config.json";
  if (fs::exists(tc)) {
    const auto j = read_json_file(tc.string(), "tokenizer config");
    if (j.is_object() && j.contains("eos_token") && j["eos_token"].is_string())
      ids.insert(find_id(j["eos_token"].get<std::string>()));
  }
  if (ids.empty()) ids = {find_id("<|im_end|>"), find_id("<|endoftext|>")};
  return ids;
}

CheckpointSampling checkpoint_sampling(const std::string& dir) {
  namespace fs = std::filesystem;
  CheckpointSampling out;
  const fs::path gen = fs::path(dir) / "generation_config.json";
  if (!fs::exists(gen)) return out;
  const nlohmann::json j = read_json_file(gen.string(), "generation config");
  if (!j.is_object()) return out;
  const std::string where = gen.string();
  auto has = [&](const char* key) { return j.contains(key) && !j[key].is_null(); };
  constexpr double kHuge = 1e6;
  if (has("temperature"))
    out.temperature =
        static_cast<float>(json_real(j["temperature"], where, "temperature", 0, kHuge));
  if (has("top_k"))
    out.top_k = static_cast<int>(json_integer(j["top_k"], where, "top_k", 0, INT32_MAX));
  if (has("top_p"))
    out.top_p = static_cast<float>(json_real(j["top_p"], where, "top_p", 0, 1, true));
  if (has("min_p")) out.min_p = static_cast<float>(json_real(j["min_p"], where, "min_p", 0, 1));
  if (has("repetition_penalty"))
    out.repetition_penalty = static_cast<float>(
        json_real(j["repetition_penalty"], where, "repetition_penalty", 0, kHuge, true));
  if (has("do_sample") && !json_boolean(j["do_sample"], where, "do_sample")) out.temperature = 0;
  return out;
}

}  // namespace iris
