// Prompts through the fixture's chat template and the real Qwen tokenizer: the input is a user text
// (and, after a line "----", a system text); its first byte picks how many small images the prompt
// holds. Checks that streaming decoding equals whole decoding, as StreamingDecoder promises.
#include <cstdlib>
#include <filesystem>

#include "bridge/chat_prompt.h"
#include "core/error.h"
#include "fuzz_common.h"
#include "language/tokenizer.h"

namespace {
const iris::Tokenizer* tokenizer = nullptr;
const iris::ChatFormat* chat = nullptr;  // the fixture's chat template
}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tokenizer = new iris::Tokenizer(iris::Tokenizer::from_file(IRIS_FUZZ_TOKENIZER));
  chat = new iris::ChatFormat(iris::ChatFormat::from_dir(
      std::filesystem::path(IRIS_FUZZ_TOKENIZER).parent_path().string()));
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int images = data[0] % 4;
  const auto [user, system] =
      iris::fuzz::split_input(iris::fuzz::as_text(data + 1, size - 1), "\n----\n");
  try {
    std::vector<iris::GridTHW> grids;
    for (int i = 0; i < images; ++i) grids.push_back({1, 2 * (i + 1), 4});
    const std::vector<int32_t> ids =
        iris::build_generation_prompt(*tokenizer, *chat, grids, user, system, 2);
    const std::string whole = tokenizer->decode(ids);
    iris::StreamingDecoder stream(*tokenizer);
    std::string streamed;
    for (int32_t id : ids) streamed += stream.push(id);
    streamed += stream.flush();
    if (streamed != whole) std::abort();
  } catch (const iris::Error&) {
  }
  return 0;
}
