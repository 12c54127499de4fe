// Learning-rate schedules with Megatron-LM's formulas (OptimizerParamScheduler.get_lr): linear
// warmup from 0, then constant or cosine decay to min_lr at total_steps, min_lr afterwards.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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

// The recipe settings a run's learning rates and weight decay follow from step to step, under
// their recipe keys' names. Each checkpoint records them, so that a resume can tell when the
// recipe would move the rates under the run (Megatron's override_opt_param_scheduler check).
struct ScheduleSettings {
  std::string kind = "cosine";  // schedule.kind
  double lr = 0;                // optimizer.lr
  double min_lr = 0;            // optimizer.min_lr
  double vision_lr = 0;         // optimizer.vision_lr (0: optimizer.lr)
  double merger_lr = 0;         // optimizer.merger_lr (0: optimizer.lr)
  double weight_decay = 0;      // optimizer.weight_decay (constant: the whole WD schedule)
  int64_t warmup_iters = 0;     // schedule.warmup_iters
  int64_t decay_iters = 0;      // schedule.decay_iters (0: train.train_iters)
  int64_t train_iters = 0;      // train.train_iters

  // Where the cosine reaches min_lr: decay_iters, else train_iters.
  int64_t decay_end() const { return decay_iters > 0 ? decay_iters : train_iters; }
  LrSchedule lr_schedule() const;
};

// One recipe key whose value changed, as the user would write it.
struct ScheduleChange {
  std::string key, before, now;
};
// The keys whose change alters the rates of some step, with both values; empty when `now` gives
// every step the rates `before` did. min_lr and the decay's end count only for a cosine (either
// side's), and train.train_iters only where it is the decay's end (schedule.decay_iters 0).
std::vector<ScheduleChange> schedule_changes(const ScheduleSettings& before,
                                             const ScheduleSettings& now);

}  // namespace iris
