#include "bridge/chat_prompt.h"

namespace iris {

std::string render_generation_prompt(const std::vector<GridTHW>& grids, const std::string& user,
                                     const std::string& system, int m) {
  std::string s;
  if (!system.empty()) s += "<|im_start|>system\n" + system + "<|im_end|>\n";
  s += "<|im_start|>user\n";
  for (const GridTHW& g : grids) {
    const int64_t n = g[0] * g[1] * g[2] / (int64_t(m) * m);
    s += "<|vision_start|>";
    s.reserve(s.size() + static_cast<size_t>(n) * 13 + 64);
    for (int64_t i = 0; i < n; ++i) s += "<|image_pad|>";
    s += "<|vision_end|>";
  }
  s += user + "<|im_end|>\n<|im_start|>assistant\n";
  return s;
}

std::vector<int32_t> build_generation_prompt(const Tokenizer& tok,
                                             const std::vector<GridTHW>& grids,
                                             const std::string& user, const std::string& system,
                                             int m) {
  return tok.encode(render_generation_prompt(grids, user, system, m));
}

}  // namespace iris
