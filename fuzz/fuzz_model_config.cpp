// config.json and preprocessor_config.json (separated by a line "----"): both parsed and
// validated, then checked against each other; a valid pair yields the weight table's shapes.
#include "bridge/model_config.h"
#include "core/error.h"
#include "core/json_read.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto [config_text, preprocessor_text] =
      iris::fuzz::split_input(iris::fuzz::as_text(data, size), "\n----\n");
  try {
    const iris::ModelConfig cfg = iris::ModelConfig::from_json_text(config_text, "config.json");
    iris::PreprocessorConfig pp;
    if (!preprocessor_text.empty())
      pp = iris::PreprocessorConfig::from_json(
          iris::parse_json(preprocessor_text, "preprocessor_config.json"));
    iris::check_preprocessor_matches(cfg, pp, "config.json", "preprocessor_config.json");
    // The products the loaders form from a validated config must not overflow.
    volatile int64_t embed = int64_t{cfg.text.vocab_size} * cfg.text.hidden_size;
    volatile int64_t qkv = int64_t{cfg.text.qkv_width()} * cfg.text.hidden_size;
    volatile int64_t patch = int64_t{cfg.vision.patch_dim()} * cfg.vision.hidden_size;
    (void)embed, (void)qkv, (void)patch;
  } catch (const iris::Error&) {
  }
  return 0;
}
