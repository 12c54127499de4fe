#include "training/lr_schedule.h"

#include <cmath>

#include "core/error.h"

namespace iris {

LrScheduleKind parse_lr_schedule_kind(const std::string& name) {
  if (name == "constant") return LrScheduleKind::constant;
  if (name == "cosine") return LrScheduleKind::cosine;
  IRIS_FAIL("unknown learning-rate schedule '", name, "': use constant or cosine");
}

LrSchedule::LrSchedule(LrScheduleKind kind, float lr, float min_lr, int64_t warmup_steps,
                       int64_t total_steps)
    : kind(kind), lr(lr), min_lr(min_lr), warmup_steps(warmup_steps), total_steps(total_steps) {
  IRIS_CHECK(lr >= 0.0f && min_lr >= 0.0f && min_lr <= lr,
             "learning rates must satisfy 0 <= ", "min_lr (", min_lr, ") <= lr (", lr, ")");
  IRIS_CHECK(warmup_steps >= 0, "warmup_steps must not be negative, got ", warmup_steps);
  IRIS_CHECK(kind == LrScheduleKind::constant || total_steps > warmup_steps,
             "a cosine schedule needs total_steps (", total_steps, ") > warmup_steps (",
             warmup_steps, ")");
}

float LrSchedule::at(int64_t step) const {
  IRIS_CHECK(step >= 0, "learning-rate schedule queried at negative step ", step);
  if (warmup_steps > 0 && step <= warmup_steps)
    return static_cast<float>(double(lr) * double(step) / double(warmup_steps));
  if (kind == LrScheduleKind::constant) return lr;
  if (step > total_steps) return min_lr;
  const double ratio = double(step - warmup_steps) / double(total_steps - warmup_steps);
  const double coeff = 0.5 * (std::cos(M_PI * ratio) + 1.0);
  return static_cast<float>(double(min_lr) + coeff * (double(lr) - double(min_lr)));
}

}  // namespace iris
