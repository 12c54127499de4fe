// A training JSONL file (any shape of docs/training-data.md): indexed, then its samples built
// (tokens, labels, images) as a data worker would, with the real Qwen tokenizer.
#include <filesystem>

#include "core/error.h"
#include "fuzz_common.h"
#include "training/dataset.h"

namespace {
const iris::Tokenizer* tokenizer = nullptr;
const iris::ChatFormat* chat = nullptr;  // the fixture's chat template, as training renders with
}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tokenizer = new iris::Tokenizer(iris::Tokenizer::from_file(IRIS_FUZZ_TOKENIZER));
  chat = new iris::ChatFormat(iris::ChatFormat::from_dir(
      std::filesystem::path(IRIS_FUZZ_TOKENIZER).parent_path().string()));
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path =
      iris::fuzz::write_scratch_file("train.jsonl", iris::fuzz::as_text(data, size));
  iris::DataConfig cfg;
  cfg.train_files = {path};
  cfg.num_workers = 0;
  cfg.shuffle = false;
  cfg.seq_length = 4096;
  cfg.max_image_pixels = int64_t{1} << 22;
  iris::PreprocessorConfig pp;
  pp.min_pixels = 32 * 32;
  pp.max_pixels = 64 * 64;
  try {
    iris::Dataset ds(cfg, *tokenizer, pp, *chat);
    for (int64_t i = 0; i < std::min<int64_t>(ds.size(), 4); ++i) ds.next();
  } catch (const iris::Error&) {
  }
  return 0;
}
