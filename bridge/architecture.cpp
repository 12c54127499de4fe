#include "bridge/architecture.h"

#include "core/error.h"
#include "core/json_read.h"
#include "vision/preprocess.h"

namespace iris {

PreprocessorConfig clip_preprocessor() {
  PreprocessorConfig pp;
  pp.patch_size = 14;
  pp.min_pixels = 56 * 56;
  pp.max_pixels = int64_t{28} * 28 * 16384;
  pp.image_mean = {0.48145466f, 0.4578275f, 0.40821073f};
  pp.image_std = {0.26862954f, 0.26130258f, 0.27577711f};
  return pp;
}

const std::vector<const Architecture*>& architectures() {
  static const std::vector<const Architecture*> all{
      &qwen3_vl_architecture(), &qwen2_5_vl_architecture(), &qwen2_vl_architecture()};
  return all;
}

const Architecture& architecture_for(const std::string& model_type, const std::string& src) {
  std::string known;
  for (const Architecture* a : architectures()) {
    if (model_type == a->model_type()) return *a;
    known +=
        str_cat(known.empty() ? "" : ", ", "\"", a->model_type(), "\" (", a->display_name(), ")");
  }
  IRIS_FAIL(src, ": model_type '", clip_text(model_type, 40),
            "' is not supported; Iris loads model_type ", known);
}

}  // namespace iris
