// The exchanges of a sharded (ZeRO-1) optimizer over the flat f32 gradients and the flat weights
// the model reads (both laid out alike, addresses fixed for the run).
//
// Rank r's shard is elements [r * S, (r + 1) * S) of the flat buffers, S = n / world, and the last
// rank's shard also holds the n % world elements past world * S (fewer than one per rank), so a
// shard is one contiguous range: the optimizer updates it in place with one span table. Tensors
// may straddle shard boundaries.
//
// reduce_scatter() leaves in each rank's shard of the gradients the rank-order sum of every rank's
// shard, ((g0 + g1) + g2) + ..., the bits Communicator::all_reduce gives the unsharded optimizer.
// all_gather() hands every rank every rank's shard of the weights. Both go in buckets of at most
// bucket_elements per exchange so that the scratch stays a fraction of the gradients; with more
// than one bucket each bucket's per-rank chunks are packed into (and gathered out of) a staging
// buffer, since a rank's chunk of bucket k lies at k * chunk inside every rank's shard. The scratch
// is allocated here once; nothing is allocated per step.
#pragma once

#include <cstdint>

#include "core/arena.h"
#include "core/backend.h"
#include "parallel/communicator.h"

namespace iris {

class ShardExchange {
 public:
  // grads: flat f32 gradients; weights: the flat weights the model reads (any dtype, the same
  // element layout as grads), or an undefined Tensor where nothing is gathered (all_gather is
  // then an error). bucket_elements: the most elements one exchange moves.
  ShardExchange(Backend& be, Communicator& comm, const Tensor& grads, const Tensor& weights,
                int64_t bucket_elements);

  // Elements [begin(r), end(r)) of the flat buffers are rank r's shard.
  static int64_t begin(int64_t n, int world, int rank);
  static int64_t end(int64_t n, int world, int rank);
  int64_t begin() const { return begin(n_, comm_.size(), comm_.rank()); }
  int64_t end() const { return end(n_, comm_.size(), comm_.rank()); }

  // Sums every rank's gradients into this rank's shard of them (fixed rank order). The gradients
  // outside the shard are left partly overwritten: only the shard is meaningful afterwards.
  void reduce_scatter();
  // Every rank's shard of the weights into every rank's weights.
  void all_gather();

  int64_t buckets() const { return n_buckets_; }
  size_t scratch_bytes() const { return arena_.capacity(); }

 private:
  Backend& be_;
  Communicator& comm_;
  Tensor grads_, weights_;
  int64_t n_ = 0, shard_ = 0, chunk_ = 0, n_buckets_ = 0;
  Arena arena_;
  Tensor recv_, send_;
};

}  // namespace iris
