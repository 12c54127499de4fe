#include "parallel/shard_sum.h"

#include <algorithm>

#include "core/error.h"
#include "parallel/shard_exchange.h"

namespace iris {

ShardSum::ShardSum(Backend& be, Communicator& comm, int64_t base, int64_t n,
                   int64_t bucket_elements)
    : be_(be), comm_(comm), base_(base), n_(n) {
  IRIS_CHECK(comm.device() == be.device(), "ShardSum: the communicator (", comm.name(),
             ") is not on the backend's device");
  IRIS_CHECK(bucket_elements > 0, "ShardSum: bucket_elements must be > 0");
  const int world = comm.size();
  begin_ = base + ShardExchange::begin(n, world, comm.rank());
  end_ = base + ShardExchange::end(n, world, comm.rank());
  // The last rank's shard is the longest.
  const int64_t longest =
      ShardExchange::end(n, world, world - 1) - ShardExchange::begin(n, world, world - 1);
  chunk_ = std::max<int64_t>(1, bucket_elements / world);
  auto plan = [&](Arena& a) {
    acc_ = a.alloc(DType::f32, {std::max<int64_t>(1, longest)});
    // A rank's piece of a chunk lies in its shard.
    scratch_ = a.alloc(DType::f32, {world * std::max<int64_t>(1, std::min(chunk_, longest))});
  };
  Arena planning;
  plan(planning);
  arena_ = Arena(be, planning.used());
  plan(arena_);
  be_.fill_zero(acc_);
}

void ShardSum::add(const Tensor& local, int64_t at, bool accumulate) {
  IRIS_CHECK(local.dtype == DType::f32 && local.device == comm_.device() && at >= base_ &&
                 at + local.numel() <= base_ + n_,
             "ShardSum::add: f32 elements [", at, ", ", at + local.numel(),
             ") on the communicator's device, inside the tiled range [", base_, ", ", base_ + n_,
             ")");
  const int world = comm_.size(), me = comm_.rank();
  const int64_t len = local.numel();
  const Tensor flat = local.view({len});
  for (int64_t c0 = 0; c0 < len; c0 += chunk_) {
    const int64_t c1 = std::min(len, c0 + chunk_);
    const int64_t g0 = at + c0, g1 = at + c1;  // in the layout
    sends_.clear();
    recvs_.clear();
    for (int r = 0; r < world; ++r) {
      const int64_t p0 = std::max(g0, base_ + ShardExchange::begin(n_, world, r));
      const int64_t p1 = std::min(g1, base_ + ShardExchange::end(n_, world, r));
      if (p0 < p1) sends_.push_back({flat.slice(p0 - at, p1 - at), r});
    }
    const int64_t m0 = std::max(g0, begin_), m1 = std::min(g1, end_);
    const int64_t m = std::max<int64_t>(0, m1 - m0);
    if (m > 0)
      for (int q = 0; q < world; ++q) recvs_.push_back({scratch_.slice(q * m, (q + 1) * m), q});
    comm_.exchange(sends_, recvs_, "the gradient shards' exchange (parallel.sharding)");
    if (m > 0)
      comm_.sum_pieces(acc_.slice(m0 - begin_, m1 - begin_), scratch_.slice(0, world * m),
                       accumulate);
  }
}

}  // namespace iris
