// The one table that maps Hugging Face tensor names to Iris's weights, with declared shapes.
// Import (checkpoint -> backend memory) and export (backend memory -> safetensors) both use it.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bridge/model_config.h"
#include "core/arena.h"
#include "core/safetensors.h"
#include "language/decoder.h"
#include "vision/vision_encoder.h"

namespace iris {

// One HF tensor and where it lives in Iris: rows [row_offset, row_offset + shape[0]) of `target`
// (fused q/k/v and gate/up projections stack several HF tensors along rows).
struct WeightBinding {
  std::string hf_name;
  std::vector<int64_t> hf_shape;
  Tensor* target = nullptr;
  int64_t row_offset = 0;
  // A norm's weight, which a fresh model starts at one.
  bool norm_weight = false;
  // The HF tensor's rows of its target.
  Tensor tensor() const { return target->slice(row_offset, row_offset + hf_shape[0]); }
  // Whether the tensor has storage: a partial allocation leaves the ones it drops undefined.
  bool allocated() const { return target->defined(); }
};

struct ModelWeights {
  Arena arena;
  VisionWeights vision;
  DecoderWeights text;
  bool tied_lm_head = false;
  std::vector<WeightBinding> bindings;  // filled by bind_weights, in checkpoint order
};

// The decoder's tensor table under `prefix` (model.language_model. or model.), with the lm_head:
// Qwen3 layers have q/k norms, Qwen2 layers q/k/v biases.
enum class DecoderTensors { qwen3, qwen2 };
class WeightTable;
void declare_decoder(const ModelConfig& cfg, ModelWeights& w, WeightTable& t,
                     const std::string& prefix, DecoderTensors kind);

// Allocates every weight tensor of the model on the backend and returns the binding table.
std::unique_ptr<ModelWeights> allocate_weights(Backend& backend, const ModelConfig& cfg);
// The same in another dtype: f32 gradients, master weights and optimizer moments. Weights of one
// config and dtype share one layout, so their arenas can be walked as flat buffers together.
std::unique_ptr<ModelWeights> allocate_weights(Backend& backend, const ModelConfig& cfg,
                                               DType dtype);
// The same for the tensors `keep` accepts (by HF name) only: the binding table is the whole
// model's, the others stay undefined Tensors. Training state (gradients, master weights, moments)
// exists for trainable tensors only. Two partial allocations with the same `keep` share one
// layout, so their arenas can still be walked as flat buffers together; a target that several
// bindings fill (fused q/k/v) is kept when any of them is.
std::unique_ptr<ModelWeights> allocate_weights(Backend& backend, const ModelConfig& cfg,
                                               DType dtype,
                                               const std::function<bool(const std::string&)>& keep);

// The layout allocate_weights(backend, cfg, dtype, keep) gives, in address space that holds no
// memory (Arena::addresses_only) with tensors on `device`: the offsets of a buffer that no rank
// holds whole, such as the f32 gradients a sharded optimizer keeps only its shard of.
std::unique_ptr<ModelWeights> reserve_weights(Device device, const ModelConfig& cfg, DType dtype,
                                              const std::function<bool(const std::string&)>& keep);
// The tensors allocate_weights(backend, cfg, dtype, keep) holds, each at place(offset) in one
// arena of `capacity` bytes instead, where offset is its byte offset in that layout: buffers
// whose tensors share memory (gradients of layers that take turns in a few slots).
std::unique_ptr<ModelWeights> allocate_weights_placed(
    Backend& backend, const ModelConfig& cfg, DType dtype,
    const std::function<bool(const std::string&)>& keep, size_t capacity,
    const std::function<size_t(size_t offset)>& place);

// Where a load's time went: reading the files through the page cache into the backend (with the
// finiteness check and any dtype conversion; on CUDA the staging copies and their uploads, on
// several threads), and the wait for whatever was still queued after that.
struct WeightLoadTimes {
  double read_ms = 0, upload_ms = 0;
};

// Fills the weights from a checkpoint directory; every tensor's presence, dtype and shape are
// checked, and errors name the file, the tensor and the expected and actual shapes. A tensor
// stored in the backend's dtype goes from the mapped file to the backend as it is, with no
// conversion.
std::unique_ptr<ModelWeights> load_weights(Backend& backend, const ModelConfig& cfg,
                                           const std::string& checkpoint_dir,
                                           WeightLoadTimes* times = nullptr);

// Writes the weights as HF safetensors (bf16 unless dtype says otherwise), atomically.
void save_weights(Backend& backend, const ModelWeights& weights, const std::string& path,
                  DType dtype = DType::bf16);
// The same for the tensors `keep` accepts (by HF name) only: one shard of a checkpoint.
void save_weights(Backend& backend, const ModelWeights& weights, const std::string& path,
                  DType dtype, const std::function<bool(const std::string&)>& keep);

}  // namespace iris
