// A chat template, as a downloaded checkpoint may carry: parsed, then rendered over a fixed
// conversation (a system message, user messages with images and text, a reply with reasoning) with
// and without the generation prompt.
#include <nlohmann/json.hpp>

#include "chat_template/jinja.h"
#include "core/error.h"
#include "fuzz_common.h"

namespace {

nlohmann::ordered_json context(bool add_generation_prompt) {
  using nlohmann::ordered_json;
  const ordered_json image = {{"type", "image"}};
  ordered_json messages = ordered_json::array();
  messages.push_back({{"role", "system"}, {"content", "Be brief."}});
  messages.push_back(
      {{"role", "user"}, {"content", {image, {{"type", "text"}, {"text", "What is this?"}}}}});
  messages.push_back({{"role", "assistant"}, {"content", "<think>\nRound.\n</think>\n\nA ball."}});
  messages.push_back({{"role", "user"}, {"content", "And its colour?"}});
  return {{"messages", messages},      {"tools", nullptr},
          {"documents", nullptr},      {"add_generation_prompt", add_generation_prompt},
          {"eos_token", "<|im_end|>"}, {"enable_thinking", false}};
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const iris::jinja::Template t(iris::fuzz::as_text(data, size), "fuzz.jinja");
    for (bool gen : {false, true}) t.render(context(gen));
  } catch (const iris::Error&) {
  }
  return 0;
}
