#include "parallel/shard_exchange.h"

#include <algorithm>

#include "core/error.h"

namespace iris {

int64_t ShardExchange::begin(int64_t n, int world, int rank) {
  return n / world * rank;
}

int64_t ShardExchange::end(int64_t n, int world, int rank) {
  return rank == world - 1 ? n : n / world * (rank + 1);
}

ShardExchange::ShardExchange(Backend& be, Communicator& comm, const Tensor& grads,
                             const Tensor& weights, int64_t bucket_elements)
    : be_(be), comm_(comm) {
  IRIS_CHECK(grads.dtype == DType::f32 && grads.device == comm.device() &&
                 (!weights.defined() ||
                  (weights.device == comm.device() && grads.numel() == weights.numel())),
             "ShardExchange: f32 gradients and weights of as many elements on the communicator's "
             "device, got ",
             grads.shape_str(), " and ", weights.shape_str());
  IRIS_CHECK(bucket_elements > 0, "ShardExchange: bucket_elements must be > 0");
  // Gathered weights are staged in the f32 scratch.
  IRIS_CHECK(dtype_size(weights.dtype) <= sizeof(float),
             "ShardExchange: weights of at most 4 bytes per element, got ",
             dtype_name(weights.dtype));
  n_ = grads.numel();
  grads_ = grads.view({n_});
  if (weights.defined()) weights_ = weights.view({n_});
  const int64_t w = comm.size();
  shard_ = n_ / w;
  chunk_ = std::min(shard_, std::max<int64_t>(1, bucket_elements / w));
  n_buckets_ = chunk_ > 0 ? (shard_ + chunk_ - 1) / chunk_ : 0;
  // The tail past w * S goes through all_reduce, whose scratch is w elements.
  const int64_t recv = std::max(w * chunk_, n_ % w > 0 ? w : int64_t(0));
  const int64_t send = n_buckets_ > 1 ? w * chunk_ : 0;
  if (recv + send == 0) return;
  auto plan = [&](Arena& a) {
    recv_ = a.alloc(DType::f32, {std::max<int64_t>(recv, 1)});
    if (send > 0) send_ = a.alloc(DType::f32, {send});
  };
  Arena planning;
  plan(planning);
  arena_ = Arena(be, planning.used());
  plan(arena_);
}

void ShardExchange::reduce_scatter() {
  const int64_t w = comm_.size(), r = comm_.rank();
  if (n_buckets_ == 1) {
    // One bucket: the rank-ordered shards are already the pieces of one reduce-scatter.
    comm_.reduce_scatter(grads_.slice(r * shard_, (r + 1) * shard_), grads_.slice(0, w * shard_),
                         recv_);
  } else {
    for (int64_t k = 0; k < n_buckets_; ++k) {
      const int64_t at = k * chunk_, c = std::min(chunk_, shard_ - at);
      const Tensor send = send_.slice(0, w * c);
      for (int64_t q = 0; q < w; ++q)
        be_.copy(send.slice(q * c, (q + 1) * c),
                 grads_.slice(q * shard_ + at, q * shard_ + at + c));
      comm_.reduce_scatter(grads_.slice(r * shard_ + at, r * shard_ + at + c), send, recv_);
    }
  }
  // The last n % w elements belong to the last rank; every rank sums them (fewer than w).
  if (w * shard_ < n_) comm_.all_reduce(grads_.slice(w * shard_, n_), recv_);
}

void ShardExchange::all_gather() {
  IRIS_CHECK(weights_.defined(), "ShardExchange::all_gather: made without weights to gather");
  const int64_t w = comm_.size(), r = comm_.rank();
  if (n_buckets_ == 1) {
    comm_.all_gather(weights_.slice(0, w * shard_), weights_.slice(r * shard_, (r + 1) * shard_));
  } else {
    for (int64_t k = 0; k < n_buckets_; ++k) {
      const int64_t at = k * chunk_, c = std::min(chunk_, shard_ - at);
      // The staging buffer in the weights' dtype: no wider than the f32 it is carved from.
      const Tensor gathered(recv_.data, weights_.dtype, weights_.device, {w * c});
      comm_.all_gather(gathered, weights_.slice(r * shard_ + at, r * shard_ + at + c));
      for (int64_t q = 0; q < w; ++q)
        if (q != r)
          be_.copy(weights_.slice(q * shard_ + at, q * shard_ + at + c),
                   gathered.slice(q * c, (q + 1) * c));
    }
  }
  if (w * shard_ < n_) comm_.broadcast(weights_.slice(w * shard_, n_), static_cast<int>(w - 1));
}

}  // namespace iris
