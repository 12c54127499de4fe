// What a training forward keeps for its backward, and what the backward recomputes instead
// (recipe key train.recompute). Every op is deterministic, so a recomputed activation equals the
// one the forward produced bit for bit: the setting trades memory for time, never accuracy.
#pragma once

#include <string>

#include "core/error.h"

namespace iris {

enum class Recompute {
  // Every activation of every layer is kept.
  none,
  // The norms' outputs, q/k after their norm and RoPE, and the MLP activation's output are
  // recomputed from kept tensors before each layer's backward: elementwise work only, about 40%
  // of a decoder layer's activations.
  selective,
  // Only each layer's input is kept; the backward reruns the layer's forward first (about a
  // third more compute).
  full,
};

inline Recompute parse_recompute(const std::string& s) {
  if (s == "none") return Recompute::none;
  if (s == "selective") return Recompute::selective;
  if (s == "full") return Recompute::full;
  IRIS_FAIL("train.recompute must be none, selective or full, not '", s, "'");
}

inline const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::none:
      return "none";
    case Recompute::selective:
      return "selective";
    case Recompute::full:
      return "full";
  }
  return "none";
}

}  // namespace iris
