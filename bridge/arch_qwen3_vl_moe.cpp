// Qwen3-VL-MoE (30B-A3B, 235B-A22B): Qwen3-VL with a mixture of experts in place of the MLP of
// its sparse decoder layers (../shared/docs/qwen3vl-moe-spec.md, transformers 5.x's
// Qwen3VLMoeTextSparseMoeBlock): a router mlp.gate.weight [E, H] and the experts fused per layer
// in the checkpoints' layout, mlp.experts.gate_up_proj [E, H, 2I] and mlp.experts.down_proj
// [E, I, H], which Iris keeps as they are stored (bridge/hf_weights.cpp declares them for the
// layers TextConfig::sparse_layer picks). Everything else is Qwen3-VL's.
#include <nlohmann/json.hpp>

#include "bridge/arch_qwen3_family.h"
#include "bridge/config_fields.h"
#include "bridge/model_config.h"
#include "core/error.h"
#include "core/json_read.h"

namespace iris {
namespace {

using nlohmann::json;
using namespace config_fields;

// The widest routing the CUDA router takes (core/backend_ops.inc, moe_route): far above the
// released checkpoints' 128 experts, 8 a token.
constexpr int kMaxExperts = 512;
constexpr int kMaxExpertsPerToken = 32;

class Qwen3VLMoe final : public Qwen3FamilyArchitecture {
 public:
  const char* model_type() const override { return "qwen3_vl_moe"; }
  const char* hf_class() const override { return "Qwen3VLMoeForConditionalGeneration"; }
  const char* display_name() const override { return "Qwen3-VL-MoE"; }

  void read_config(const json& j, ModelConfig& c, const std::string& src) const override {
    Qwen3FamilyArchitecture::read_config(j, c, src);
    const json& tc = j["text_config"];
    const std::string tw = src + ": text_config";
    TextConfig& t = c.text;
    // Absent fields take transformers 5.x's Qwen3VLMoeTextConfig defaults (recorded by
    // tools/make_moe_golden.py from 5.17), as HF would; the checkpoint's tensors then pin them (a
    // mismatch is a shape error naming the tensor). num_local_experts is num_experts' alias.
    t.num_experts = 60;
    t.num_experts_per_tok = 4;
    t.moe_intermediate_size = 1408;
    const bool has_experts = present(tc, "num_experts"),
               has_local = present(tc, "num_local_experts");
    if (has_experts) read_int(tc, "num_experts", t.num_experts, tw, 1, kMaxExperts);
    if (has_local) {
      int local = 0;
      read_int(tc, "num_local_experts", local, tw, 1, kMaxExperts);
      IRIS_CHECK(!has_experts || local == t.num_experts, tw, ".num_local_experts ", local,
                 " disagrees with num_experts ", t.num_experts, " (one is an alias of the other)");
      t.num_experts = local;
    }
    read_int(tc, "num_experts_per_tok", t.num_experts_per_tok, tw, 1, kMaxExpertsPerToken);
    IRIS_CHECK(t.num_experts_per_tok <= t.num_experts, tw, ".num_experts_per_tok ",
               t.num_experts_per_tok, " exceeds num_experts ", t.num_experts);
    read_int(tc, "moe_intermediate_size", t.moe_intermediate_size, tw, 1, kMaxWidth);
    read_int(tc, "decoder_sparse_step", t.decoder_sparse_step, tw, 1, kMaxLayers);
    if (present(tc, "mlp_only_layers") && !tc["mlp_only_layers"].is_null())
      read_increasing_ints(tc, "mlp_only_layers", t.mlp_only_layers, tw, 0,
                           t.num_hidden_layers - 1);
    if (present(tc, "router_aux_loss_coef"))
      t.router_aux_loss_coef = static_cast<float>(
          json_real(tc["router_aux_loss_coef"], tw, "router_aux_loss_coef", 0.0, 1e6, false));
    // norm_topk_prob is not read: transformers 5.x's router always renormalises the top-k
    // weights, and 4.57's said every released model does (spec 1.3).
  }
};

}  // namespace

const Architecture& qwen3_vl_moe_architecture() {
  static const Qwen3VLMoe arch;
  return arch;
}

}  // namespace iris
