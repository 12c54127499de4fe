#include "training/pipeline_costs.h"

#include <cmath>

#include "core/error.h"
#include "core/fs.h"

namespace iris {

TrainableQwen3VL::LayerHook pipeline_part_hook(ProfilingBackend& profile, int layers,
                                               int64_t* backward_layers,
                                               TrainableQwen3VL::LayerHook next) {
  using Pass = TrainableQwen3VL::LayerPass;
  return [&profile, layers, backward_layers, next = std::move(next)](int layer, Pass pass,
                                                                     bool begin) {
    if (layer >= 0) {
      // What runs between two layers (DeepStack's additions) goes with the layers.
      if (begin) {
        profile.set_part(kPartLayer);
        if (pass == Pass::backward) ++*backward_layers;
      } else if (pass == Pass::forward) {
        profile.set_part(layer == layers - 1 ? kPartLast : kPartLayer);
      } else {
        profile.set_part(layer == 0 ? kPartFirst : kPartLayer);
      }
    } else if (layer == -1) {
      // A micro-batch has ended: the next one starts with the vision encoder and the embedding.
      profile.set_part(kPartFirst);
    }
    if (next) next(layer, pass, begin);
  };
}

PipelineCosts measured_pipeline_costs(const std::vector<OpRecord>& records, int layers) {
  IRIS_CHECK(layers > 0, "pipeline costs need at least one decoder layer");
  PipelineCosts c{0, 0, 0};
  for (const OpRecord& r : records) {
    if (r.part == kPartLayer) c.layer += r.ms;
    if (r.part == kPartFirst) c.first += r.ms;
    if (r.part == kPartLast) c.last += r.ms;
  }
  c.layer /= layers;
  return c;
}

nlohmann::json pipeline_costs_json(const PipelineCosts& costs, int layers) {
  return {{"layer_ms", costs.layer},
          {"first_ms", costs.first},
          {"last_ms", costs.last},
          {"layers", layers}};
}

PipelineCosts read_pipeline_costs(const std::string& path) {
  const std::string where = "parallel.pipeline_costs (" + path + ")";
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_text_file(path, "parallel.pipeline_costs file"));
  } catch (const nlohmann::json::exception& e) {
    IRIS_FAIL(where, " is not JSON: ", e.what(),
              "; give the pipeline_costs.json that a run with logging.op_profile_step wrote");
  }
  auto number = [&](const char* key, bool positive) {
    IRIS_CHECK(j.is_object() && j.contains(key) && j[key].is_number(), where, " has no number '",
               key,
               "'; give the pipeline_costs.json that a run with logging.op_profile_step wrote");
    const double v = j[key].get<double>();
    IRIS_CHECK(std::isfinite(v) && (positive ? v > 0 : v >= 0), where, ": ", key, " is ", v,
               "; it must be ", positive ? "positive" : "at least 0");
    return v;
  };
  PipelineCosts c;
  c.layer = number("layer_ms", true);
  c.first = number("first_ms", false);
  c.last = number("last_ms", false);
  return c;
}

}  // namespace iris
