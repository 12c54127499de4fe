// A recipe with overrides: the YAML text, then after a line "----" one key=value override per
// line. Loaded, validated and, when valid, written back out and reloaded.
#include <sstream>

#include "core/error.h"
#include "fuzz_common.h"
#include "training/recipe.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto [yaml, override_text] =
      iris::fuzz::split_input(iris::fuzz::as_text(data, size), "\n----\n");
  std::vector<std::string> overrides;
  std::istringstream lines(override_text);
  for (std::string line; std::getline(lines, line);)
    if (!line.empty()) overrides.push_back(line);
  try {
    const iris::Recipe r = iris::load_recipe_text(yaml, "fuzz.yaml", overrides);
    iris::load_recipe_text(iris::recipe_to_yaml(r), "resolved.yaml");
  } catch (const iris::Error&) {
  }
  return 0;
}
