// Gradient sharding's reduction (parallel.sharding=optimizer_grads, ZeRO-2): every rank's
// gradients of a range of the flat f32 layout go to the ranks whose shard holds them, and each
// owner sums the pieces in rank order, ((g0 + g1) + g2) + ..., into an accumulator of its shard
// only. No rank ever holds the whole summed gradients: a range can be summed as soon as the
// backward has written it and its memory reused.
//
// Shards are ShardExchange's (rank r holds elements [begin(n, world, r), end(n, world, r))), so
// a sharded optimizer updates the accumulator as it would its reduce-scattered shard. A range is
// moved in chunks of at most bucket_elements / world elements per rank, each a grouped exchange
// (Communicator::exchange) followed by one rank-order sum on the owner; every rank must call
// add() for the same ranges in the same order. With accumulate, a chunk's sum is added to what
// the accumulator holds (micro-batch after micro-batch); otherwise it replaces it. One
// micro-batch per rank thus gives the bits of the unsharded reduction; more add the ranks'
// sums of each micro-batch, where the unsharded run sums each rank's micro-batches first, which
// differs in f32 rounding.
#pragma once

#include <cstdint>
#include <vector>

#include "core/arena.h"
#include "core/backend.h"
#include "parallel/communicator.h"

namespace iris {

class ShardSum {
 public:
  // The shards tile elements [base, base + n) of the flat layout (all of it, or a pipeline
  // stage's span); begin(), end() and add()'s `at` are elements of the layout.
  ShardSum(Backend& be, Communicator& comm, int64_t base, int64_t n, int64_t bucket_elements);

  int64_t begin() const { return begin_; }
  int64_t end() const { return end_; }
  // This rank's sums, elements [begin(), end()) of the layout.
  Tensor sums() const { return acc_.slice(0, end_ - begin_); }
  // The accumulator, as long as the longest shard of any rank (for staging a shard between steps).
  const Tensor& accumulator() const { return acc_; }
  // Sums every rank's `local` (elements [at, at + local.numel()) of the layout, inside the
  // tiled range, f32) into the owners' accumulators.
  void add(const Tensor& local, int64_t at, bool accumulate);
  size_t bytes() const { return arena_.capacity(); }

 private:
  Backend& be_;
  Communicator& comm_;
  int64_t base_ = 0, n_ = 0, begin_ = 0, end_ = 0, chunk_ = 0;
  Arena arena_;
  Tensor acc_, scratch_;
  std::vector<Communicator::Transfer> sends_, recvs_;
};

}  // namespace iris
