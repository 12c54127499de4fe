// A tokenizer.json: loaded, and when it loads, used to encode and decode a short text.
#include "core/error.h"
#include "fuzz_common.h"
#include "language/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const iris::Tokenizer tok =
        iris::Tokenizer::from_json_text(iris::fuzz::as_text(data, size), "tokenizer.json");
    const std::vector<int32_t> ids = tok.encode("Hello world, <|im_start|> caf\xc3\xa9 123!");
    tok.decode(ids);
    for (int32_t id = 0; id < std::min<int32_t>(tok.vocab_size(), 64); ++id)
      if (tok.contains_id(id)) tok.token_text(id);
  } catch (const iris::Error&) {
  }
  return 0;
}
