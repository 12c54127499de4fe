// Learning-rate schedules with Megatron-LM's formulas (OptimizerParamScheduler.get_lr): linear
// warmup from 0, then constant or cosine decay to min_lr at total_steps, min_lr afterwards.
#pragma once

#include <cstdint>
#include <string>

namespace iris {

enum class LrScheduleKind { constant, cosine };

// "constant" or "cosine"; anything else is an error naming the accepted values.
LrScheduleKind parse_lr_schedule_kind(const std::string& name);

struct LrSchedule {
  LrScheduleKind kind = LrScheduleKind::constant;
  float lr = 0.0f;           // peak learning rate
  float min_lr = 0.0f;       // cosine floor
  int64_t warmup_steps = 0;  // linear warmup 0 -> lr over these steps
  int64_t total_steps = 0;   // cosine reaches min_lr here (Megatron's lr_decay_steps)

  LrSchedule() = default;
  // Validates: lr >= min_lr >= 0, 0 <= warmup_steps, and warmup_steps < total_steps for cosine.
  LrSchedule(LrScheduleKind kind, float lr, float min_lr, int64_t warmup_steps,
             int64_t total_steps);

  // The rate for the update taken after `step` completed updates (Megatron's num_steps): with a
  // warmup the first update (step 0) uses 0, the update at step == warmup_steps the peak.
  float at(int64_t step) const;
};

}  // namespace iris
