#include "training/run_checkpoints.h"

#include <omp.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>

#include "bridge/hf_weights.h"
#include "bridge/peft.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/safetensors.h"

namespace iris {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A pipeline stage's part of a checkpoint, named as Hugging Face names the shards of a model.
std::string stage_file(const char* stem, int stage, int stages) {
  char name[96];
  std::snprintf(name, sizeof(name), "%s-%05d-of-%05d.safetensors", stem, stage + 1, stages);
  return name;
}

json preprocessor_json(const PreprocessorConfig& pp) {
  return {{"image_processor_type", "Qwen2VLImageProcessorFast"},
          {"processor_class", "Qwen3VLProcessor"},
          {"do_convert_rgb", pp.do_convert_rgb},
          {"do_normalize", pp.do_normalize},
          {"do_rescale", pp.do_rescale},
          {"do_resize", pp.do_resize},
          {"image_mean", pp.image_mean},
          {"image_std", pp.image_std},
          {"merge_size", pp.merge_size},
          {"patch_size", pp.patch_size},
          {"temporal_patch_size", pp.temporal_patch_size},
          {"resample", 3},
          {"rescale_factor", pp.rescale_factor},
          {"size", {{"shortest_edge", pp.min_pixels}, {"longest_edge", pp.max_pixels}}}};
}

// Qwen3-VL Instruct's generation config: stop at <|im_end|> or <|endoftext|>.
json generation_json(const Tokenizer& tok) {
  const auto im_end = tok.find_token("<|im_end|>");
  const auto eot = tok.find_token("<|endoftext|>");
  IRIS_CHECK(im_end && eot,
             "the tokenizer lacks <|im_end|> or <|endoftext|>; Qwen3-VL training "
             "needs a Qwen tokenizer.json");
  return {{"bos_token_id", *eot},
          {"eos_token_id", {*im_end, *eot}},
          {"pad_token_id", *eot},
          {"do_sample", false}};
}

// The model's weights as a checkpoint stores them, tensor by tensor: the f32 master weights where
// there are some (the trainable tensors), else the weights the model reads, in their own dtype (a
// frozen part keeps nothing else; on the GPU its values are its bf16 weights, exact for bf16
// checkpoints such as the released ones, and what the model has trained against otherwise). Held
// as bf16 they are saved as bf16: the same values at half the bytes, which for a LoRA run, whose
// base is all frozen, halves the checkpoint and its write time.
// The master weights are the optimizer's to read: sharded, rank 0 holds them after gather_state.
void save_model_weights(Backend& be, const AdamW& opt, const ModelWeights& weights,
                        const std::string& path,
                        const std::function<bool(const std::string&)>& keep = {}) {
  std::vector<std::vector<uint8_t>> storage;
  std::vector<SafetensorsWriteItem> items;
  storage.reserve(weights.bindings.size());
  for (size_t i = 0; i < weights.bindings.size(); ++i) {
    const WeightBinding& b = weights.bindings[i];
    if (keep && !keep(b.hf_name)) continue;
    const bool trained = opt.trains(i);
    const DType dtype = trained || b.tensor().dtype != DType::bf16 ? DType::f32 : DType::bf16;
    storage.emplace_back(static_cast<size_t>(b.tensor().numel()) * dtype_size(dtype));
    if (trained)
      opt.read_master(i, reinterpret_cast<float*>(storage.back().data()));
    else
      be.read(storage.back().data(), dtype, b.tensor());
    items.push_back({b.hf_name, dtype, b.hf_shape, storage.back().data()});
  }
  write_safetensors(path, items, {{"format", "pt"}});
}

}  // namespace

std::vector<std::string> optimizer_files(const std::string& dir) {
  const fs::path whole = fs::path(dir) / kOptimizerFile;
  if (fs::exists(whole)) return {whole.string()};
  std::vector<std::string> parts;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("optimizer-", 0) == 0 && name.find("-of-") != std::string::npos &&
        name.size() > 12 && name.substr(name.size() - 12) == ".safetensors")
      parts.push_back(e.path().string());
  }
  IRIS_CHECK(!parts.empty(), dir, " holds neither ", kOptimizerFile,
             " nor the optimizer-NNNNN-of-NNNNN.safetensors parts of a pipelined run");
  std::sort(parts.begin(), parts.end());
  return parts;
}

std::string hf_config_text(const std::string& config_json) {
  json j = json::parse(config_json);
  if (!j.contains("model_type")) j["model_type"] = "qwen3_vl";
  if (!j.contains("architectures")) j["architectures"] = {"Qwen3VLForConditionalGeneration"};
  if (j.contains("text_config") && !j["text_config"].contains("model_type"))
    j["text_config"]["model_type"] = "qwen3_vl_text";
  if (j.contains("vision_config") && !j["vision_config"].contains("model_type"))
    j["vision_config"]["model_type"] = "qwen3_vl_vision";
  return j.dump(2) + "\n";
}

SideFiles side_files(const Recipe& r, const Tokenizer& tok, const PreprocessorConfig& pp,
                     const ChatFormat& chat) {
  SideFiles s;
  s.files.emplace_back("tokenizer.json", read_text_file(r.model.tokenizer));
  // tokenizer_config.json comes from where the model or the tokenizer does.
  std::vector<fs::path> dirs;
  if (!r.model.hf_dir.empty()) dirs.push_back(r.model.hf_dir);
  dirs.push_back(fs::path(r.model.tokenizer).parent_path());
  for (const fs::path& d : dirs)
    if (fs::is_regular_file(d / "tokenizer_config.json")) {
      s.files.emplace_back("tokenizer_config.json",
                           read_text_file((d / "tokenizer_config.json").string()));
      break;
    }
  // The template the run trained with, wherever it came from: chat_template.jinja is what
  // inference looks for first, so an export is prompted as it was trained.
  if (chat.has_template()) s.files.emplace_back("chat_template.jinja", chat.template_text());
  s.files.emplace_back("preprocessor_config.json", preprocessor_json(pp).dump(2) + "\n");
  // A LoRA run's checkpoints say what their adapter tensors are, as PEFT would (iris export
  // --peft writes this file beside the adapters).
  if (r.peft.lora() && r.has_model_config) {
    const std::unique_ptr<Backend> cpu = make_cpu_backend();
    const auto layout = allocate_weights(*cpu, r.model_config, DType::f32,
                                         [](const std::string&) { return false; });
    s.files.emplace_back(
        "adapter_config.json",
        peft_adapter_config(r.model_config, *layout,
                            {r.peft.dropout, r.peft.modules_to_save, r.model.hf_dir}));
  }
  const fs::path gen = fs::path(r.model.hf_dir) / "generation_config.json";
  s.files.emplace_back("generation_config.json", !r.model.hf_dir.empty() && fs::is_regular_file(gen)
                                                     ? read_text_file(gen.string())
                                                     : generation_json(tok).dump(2) + "\n");
  return s;
}

Checkpoints::Checkpoints(const Recipe& r, const RunStart& start, const RankTraining& rank,
                         DataParallel& dp, std::string config_text, SideFiles side,
                         std::vector<DataFileFingerprint> data_files)
    : r_(r),
      rank_(rank),
      dp_(dp),
      run_dir_(start.run_dir),
      owned_(start.owned),
      config_text_(std::move(config_text)),
      resolved_(recipe_to_yaml(r)),
      side_(std::move(side)),
      data_files_(std::move(data_files)) {}

void Checkpoints::write_resolved_config() const {
  if (dp_.writer())
    write_file_atomic((fs::path(run_dir_) / "resolved_config.yaml").string(), resolved_);
}

void Checkpoints::write(int64_t iteration, TrainerState& state, const DataPosition& position) {
  // A sharded optimizer's state comes to rank 0 from every rank.
  rank_.optimizer().gather_state();
  if (rank_.pipelined()) return write_pipelined(iteration, state, position);
  if (!dp_.writer()) return;
  fill_state(state, position);
  write_whole(iteration, state);
}

std::string Checkpoints::commit(int64_t iteration) {
  if (!dp_.writer()) return "";
  const std::string dir = finish_checkpoint(run_dir_, iteration);
  owned_.push_back(iteration);
  prune_checkpoints(run_dir_, owned_, r_.checkpoint.keep_last);
  return dir;
}

void Checkpoints::fill_state(TrainerState& state, const DataPosition& position) const {
  state.data_position = position;
  state.data_seed = r_.data.config.seed;
  state.threads = omp_get_max_threads();
  state.data_files = data_files_;
  // The schedule this run trains with, which a resume compares its recipe's with.
  state.has_schedule = true;
  state.schedule = recipe_schedule(r_);
}

void Checkpoints::write_common_files(const std::string& dir) const {
  const fs::path d(dir);
  write_file_atomic((d / "config.json").string(), config_text_);
  for (const auto& [name, text] : side_.files) write_file_atomic((d / name).string(), text);
  write_file_atomic((d / "resolved_config.yaml").string(), resolved_);
}

void Checkpoints::write_whole(int64_t iteration, TrainerState& state) {
  const std::string tmp = begin_checkpoint(run_dir_, iteration);
  const fs::path d(tmp);
  save_model_weights(rank_.backend(), rank_.optimizer(), rank_.weights(),
                     (d / "model.safetensors").string());
  rank_.optimizer().save((d / kOptimizerFile).string());
  write_common_files(tmp);
  // Last: it lists the files above with their sizes, and checkpoint_complete() checks them.
  state.files = list_checkpoint_files(tmp);
  save_trainer_state((d / kTrainerStateFile).string(), state);
}

void Checkpoints::write_pipelined(int64_t iteration, TrainerState& state,
                                  const DataPosition& position) {
  const fs::path d = fs::path(run_dir_) / (checkpoint_name(iteration) + ".tmp");
  if (dp_.writer()) begin_checkpoint(run_dir_, iteration);
  dp_.barrier("the checkpoint directory");
  const int P = dp_.stages();
  const ModelWeights& weights = rank_.weights();
  std::vector<int> owner;
  for (size_t i = 0; i < weights.bindings.size(); ++i)
    owner.push_back(rank_.stage_tensors().owner(i));
  if (dp_.replica() == 0) {
    const int me = dp_.stage();
    std::set<std::string> mine;
    for (size_t i = 0; i < owner.size(); ++i)
      if (owner[i] == me) mine.insert(weights.bindings[i].hf_name);
    save_model_weights(rank_.backend(), rank_.optimizer(), weights,
                       (d / stage_file("model", me, P)).string(),
                       [&](const std::string& name) { return mine.count(name) > 0; });
    rank_.optimizer().save((d / stage_file("optimizer", me, P)).string());
  }
  dp_.barrier("the checkpoint's stage files");
  if (!dp_.writer()) return;
  fill_state(state, position);
  json weight_map = json::object();
  int64_t total = 0;
  for (size_t i = 0; i < weights.bindings.size(); ++i) {
    const WeightBinding& b = weights.bindings[i];
    weight_map[b.hf_name] = stage_file("model", owner[i], P);
    total += b.tensor().numel() * int64_t(sizeof(float));
  }
  const json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  write_file_atomic((d / "model.safetensors.index.json").string(), index.dump(2) + "\n");
  write_common_files(d.string());
  state.files = list_checkpoint_files(d.string());
  save_trainer_state((d / kTrainerStateFile).string(), state);
}

}  // namespace iris
