// The communicators' collectives under a real launcher: ctest runs this binary with mpirun -np 1,
// 2 and 4 (CMakeLists.txt), every rank executing every case. The fixed-order sums are checked bit
// for bit against the rank-order sum each rank computes itself from every rank's (seeded) data,
// with magnitudes spread so that another order rounds differently (checked too, from 3 ranks on).
// Without a launcher the collective cases skip; the launcher-variable cases always run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/error.h"
#include "parallel/communicator.h"
#include "parallel/grad_reducer.h"
#include "parallel/launch.h"
#include "parallel/mpi_session.h"
#include "parallel/shard_exchange.h"

namespace iris {
namespace {

LaunchEnv env_of(const std::map<std::string, std::string>& vars) {
  return read_launch_env([&](const char* name) -> const char* {
    const auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

TEST(LaunchEnv, ReadsMpirunAndSrunAndDefaultsToOneProcess) {
  const LaunchEnv none = env_of({});
  EXPECT_FALSE(none.launched());
  EXPECT_EQ(none.rank, 0);
  EXPECT_EQ(none.world, 1);
  EXPECT_EQ(none.local_size, 1);

  const LaunchEnv ompi = env_of({{"OMPI_COMM_WORLD_SIZE", "4"},
                                 {"OMPI_COMM_WORLD_RANK", "3"},
                                 {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                 {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                 {"SLURM_PROCID", "0"},
                                 {"SLURM_STEP_ID", "0"},
                                 {"SLURM_NTASKS", "2"}});
  EXPECT_EQ(ompi.launcher, "mpirun");
  EXPECT_EQ(ompi.world, 4);
  EXPECT_EQ(ompi.rank, 3);
  EXPECT_EQ(ompi.local_rank, 1);
  EXPECT_EQ(ompi.local_size, 2);

  const LaunchEnv srun = env_of({{"SLURM_PROCID", "5"},
                                 {"SLURM_STEP_ID", "0"},
                                 {"SLURM_NTASKS", "8"},
                                 {"SLURM_STEP_NUM_TASKS", "6"},
                                 {"SLURM_LOCALID", "2"},
                                 {"SLURM_STEP_TASKS_PER_NODE", "3(x2)"}});
  EXPECT_EQ(srun.launcher, "srun");
  EXPECT_EQ(srun.world, 6);
  EXPECT_EQ(srun.rank, 5);
  EXPECT_EQ(srun.local_rank, 2);
  EXPECT_EQ(srun.local_size, 3);

  // An sbatch script is one process even though its allocation has several tasks.
  const LaunchEnv batch = env_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}});
  EXPECT_FALSE(batch.launched());
  EXPECT_EQ(batch.world, 1);

  for (const auto& bad : std::vector<std::map<std::string, std::string>>{
           {{"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "2"}},
           {{"OMPI_COMM_WORLD_SIZE", "two"}, {"OMPI_COMM_WORLD_RANK", "0"}},
           {{"OMPI_COMM_WORLD_SIZE", "2"}}}) {
    try {
      env_of(bad);
      ADD_FAILURE() << "accepted a bad launcher environment";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("OMPI_COMM_WORLD"), std::string::npos) << e.what();
    }
  }
}

class Collectives : public ::testing::Test {
 protected:
  void SetUp() override {
    const LaunchEnv env = read_launch_env();
    if (!env.launched() || !MpiSession::available())
      GTEST_SKIP() << "run under mpirun (ctest does: parallel_communicator_test_np*)";
    session_ = &MpiSession::start(env);
    session_->set_timeout(120);
    comm_ = make_mpi_communicator(*session_);
    rank_ = comm_->rank();
    world_ = comm_->size();
  }

  // Rank r's seeded data, which every rank can rebuild: values whose magnitudes span 2^-20 to
  // 2^20, so that the order of a sum shows in its rounding.
  static std::vector<float> data_of(int r, int64_t n) {
    std::mt19937 rng(1000u + static_cast<unsigned>(r));
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::uniform_int_distribution<int> e(-20, 20);
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = std::ldexp(u(rng), e(rng));
    return v;
  }
  std::vector<float> rank_order_sum(int64_t n, bool reversed = false) const {
    std::vector<float> s = data_of(reversed ? world_ - 1 : 0, n);
    for (int k = 1; k < world_; ++k) {
      const std::vector<float> d = data_of(reversed ? world_ - 1 - k : k, n);
      for (int64_t i = 0; i < n; ++i) s[static_cast<size_t>(i)] += d[static_cast<size_t>(i)];
    }
    return s;
  }
  static Tensor view(std::vector<float>& v) {
    return Tensor(v.data(), DType::f32, Device::cpu, {static_cast<int64_t>(v.size())});
  }
  static bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  }

  MpiSession* session_ = nullptr;
  std::unique_ptr<Communicator> comm_;
  int rank_ = 0, world_ = 1;
};

TEST_F(Collectives, AllGatherAllToAllAndBroadcastMoveExactly) {
  const int64_t n = 37;
  std::vector<float> mine = data_of(rank_, n), all(static_cast<size_t>(n * world_));
  comm_->all_gather(view(all), view(mine));
  for (int r = 0; r < world_; ++r)
    EXPECT_TRUE(same_bits(std::vector<float>(all.begin() + r * n, all.begin() + (r + 1) * n),
                          data_of(r, n)))
        << "piece of rank " << r;
  // In place: each rank's piece already sits in the output.
  std::vector<float> in_place(static_cast<size_t>(n * world_), 0.0f);
  std::copy(mine.begin(), mine.end(), in_place.begin() + rank_ * n);
  comm_->all_gather(view(in_place), view(in_place).slice(rank_ * n, (rank_ + 1) * n));
  EXPECT_TRUE(same_bits(in_place, all));

  // all_to_all: piece r of rank k's output is piece k of rank r's input.
  std::vector<float> send = data_of(rank_, n * world_), got(send.size());
  comm_->all_to_all(view(got), view(send));
  for (int r = 0; r < world_; ++r) {
    const std::vector<float> theirs = data_of(r, n * world_);
    EXPECT_TRUE(
        same_bits(std::vector<float>(got.begin() + r * n, got.begin() + (r + 1) * n),
                  std::vector<float>(theirs.begin() + rank_ * n, theirs.begin() + (rank_ + 1) * n)))
        << "piece from rank " << r;
  }

  const int root = world_ - 1;
  std::vector<float> b = data_of(rank_, n);
  comm_->broadcast(view(b), root);
  EXPECT_TRUE(same_bits(b, data_of(root, n)));
}

TEST_F(Collectives, SendAndReceiveGoRoundARing) {
  if (world_ < 2) GTEST_SKIP() << "needs two ranks";
  const int64_t n = 1 << 16;  // past the eager limit: a real rendezvous
  const int next = (rank_ + 1) % world_, prev = (rank_ + world_ - 1) % world_;
  std::vector<float> out = data_of(rank_, n), in(static_cast<size_t>(n));
  // Even ranks send first, odd ranks receive first: no rank waits on a rank that waits on it.
  if (rank_ % 2 == 0) {
    comm_->send(view(out), next);
    comm_->recv(view(in), prev);
  } else {
    comm_->recv(view(in), prev);
    comm_->send(view(out), next);
  }
  EXPECT_TRUE(same_bits(in, data_of(prev, n)));
}

TEST_F(Collectives, AllReduceAndReduceScatterSumInRankOrderBitForBit) {
  // A length with a tail (n % world != 0) and one of whole pieces.
  for (const int64_t n : {int64_t(1000) * world_ + 3, int64_t(64) * world_, int64_t(1)}) {
    SCOPED_TRACE(n);
    std::vector<float> buf = data_of(rank_, n);
    std::vector<float> scratch(static_cast<size_t>(all_reduce_scratch_elements(n, world_)));
    comm_->all_reduce(view(buf), view(scratch));
    const std::vector<float> want = rank_order_sum(n);
    EXPECT_TRUE(same_bits(buf, want));
    // The check can fail: from three ranks on, the reverse order rounds differently somewhere.
    if (world_ >= 3 && n > 100) EXPECT_FALSE(same_bits(rank_order_sum(n, true), want));
  }
  const int64_t piece = 333;
  std::vector<float> in = data_of(rank_, piece * world_), out(static_cast<size_t>(piece)),
                     scratch(in.size());
  comm_->reduce_scatter(view(out), view(in), view(scratch));
  const std::vector<float> full = rank_order_sum(piece * world_);
  EXPECT_TRUE(same_bits(
      out, std::vector<float>(full.begin() + rank_ * piece, full.begin() + (rank_ + 1) * piece)));
}

TEST_F(Collectives, GradReducerBucketsGiveTheRankOrderSum) {
  auto cpu = make_cpu_backend();
  const int64_t n = 10007;
  std::vector<float> grads = data_of(rank_, n);
  // Small buckets: many of them, the last with a tail.
  GradReducer reducer(*cpu, *comm_, view(grads), 1000);
  EXPECT_EQ(reducer.buckets(), (n + 1000 / world_ * world_ - 1) / (1000 / world_ * world_));
  reducer.reduce();
  EXPECT_TRUE(same_bits(grads, rank_order_sum(n)));
  // The reducer's buffers stay put: a second step sums again from fresh values.
  const std::vector<float> fresh = data_of(rank_, n);
  std::copy(fresh.begin(), fresh.end(), grads.begin());
  reducer.reduce();
  EXPECT_TRUE(same_bits(grads, rank_order_sum(n)));
}

// A pipeline stage's data-parallel group sums only its own tensors' ranges: the rank-order sum
// there, this rank's values untouched elsewhere.
TEST_F(Collectives, GradReducerSumsOnlyTheGivenRanges) {
  auto cpu = make_cpu_backend();
  const int64_t n = 5003;
  const std::vector<std::pair<int64_t, int64_t>> ranges{{0, 17}, {100, 2100}, {4000, 5003}};
  std::vector<float> grads = data_of(rank_, n);
  GradReducer reducer(*cpu, *comm_, view(grads), 1000, ranges);
  reducer.reduce();
  const std::vector<float> sum = rank_order_sum(n), mine = data_of(rank_, n);
  for (int64_t i = 0; i < n; ++i) {
    bool inside = false;
    for (const auto& [b, e] : ranges) inside = inside || (i >= b && i < e);
    const float want = inside ? sum[size_t(i)] : mine[size_t(i)];
    ASSERT_EQ(std::memcmp(&grads[size_t(i)], &want, sizeof(float)), 0) << "element " << i;
  }
  EXPECT_THROW(GradReducer(*cpu, *comm_, view(grads), 1000, {{10, 20}, {15, 30}}), Error);
  EXPECT_THROW(GradReducer(*cpu, *comm_, view(grads), 1000, {{10, n + 1}}), Error);
}

// Passes every call to the MPI communicator and notes which buckets all_reduce reduced: each
// all_reduce of a bucket of at least size() elements gathers into the bucket's start once.
class RecordingCommunicator final : public Communicator {
 public:
  RecordingCommunicator(Communicator& inner, const std::vector<float>& grads)
      : inner_(inner), begin_(grads.data()), end_(grads.data() + grads.size()) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string name() const override { return inner_.name(); }
  Device device() const override { return inner_.device(); }
  void all_gather(const Tensor& out, const Tensor& in) override {
    const auto* p = static_cast<const float*>(out.data);
    if (p >= begin_ && p < end_) gathered.push_back(p - begin_);
    inner_.all_gather(out, in);
  }
  void all_to_all(const Tensor& out, const Tensor& in) override { inner_.all_to_all(out, in); }
  void broadcast(const Tensor& buf, int root) override { inner_.broadcast(buf, root); }
  void send(const Tensor& t, int peer) override { inner_.send(t, peer); }
  void recv(const Tensor& t, int peer) override { inner_.recv(t, peer); }
  void exchange(std::span<const Transfer> sends, std::span<const Transfer> recvs,
                const char* what) override {
    inner_.exchange(sends, recvs, what);
  }
  using Communicator::sum_pieces;
  void sum_pieces(const Tensor& out, const Tensor& pieces, bool accumulate) override {
    inner_.sum_pieces(out, pieces, accumulate);
  }
  void begin_detached() override { ++detached; }
  void end_detached() override { ++attached; }

  std::vector<int64_t> gathered;  // bucket starts, in launch order
  int detached = 0, attached = 0;

 private:
  Communicator& inner_;
  const float *begin_, *end_;
};

// The reduction overlapped with the backward: the model names gradient tensors as the backward
// finishes them, and each bucket starts once every tensor it overlaps is final. Every bucket is
// launched exactly once per step, from the highest address down on every rank, whatever order
// and subset of tensors a rank names (odd ranks name theirs in the opposite order and skip some,
// as a rank whose last micro-batch has no image would), and the sums are reduce()'s bit for bit.
TEST_F(Collectives, GradReducerStartsEachBucketOnceItsTensorsAreFinal) {
  auto cpu = make_cpu_backend();
  const int64_t n = 10007;
  // Tensors of 1 to 900 elements with alignment gaps of 0 to 6 between them (zero on every rank).
  std::mt19937 rng(5);
  std::vector<std::pair<int64_t, int64_t>> tensors;
  for (int64_t at = std::uniform_int_distribution<int64_t>(0, 6)(rng); at < n;) {
    const int64_t end = std::min(n, at + std::uniform_int_distribution<int64_t>(1, 900)(rng));
    tensors.push_back({at, end});
    at = end + std::uniform_int_distribution<int64_t>(0, 6)(rng);
  }
  auto fill = [&](std::vector<float>& g) {
    g.assign(size_t(n), 0.0f);
    const std::vector<float> d = data_of(rank_, n);
    for (const auto& [b, e] : tensors) std::copy(d.begin() + b, d.begin() + e, g.begin() + b);
  };
  std::vector<float> want;
  fill(want);
  {
    GradReducer plain(*cpu, *comm_, view(want), 1000);
    plain.reduce();
  }
  std::vector<float> grads;
  fill(grads);  // its storage stays put from here on
  RecordingCommunicator rec(*comm_, grads);
  GradReducer reducer(*cpu, rec, view(grads), 1000, {}, tensors);
  ASSERT_GT(reducer.buckets(), 5);
  const int64_t step = 1000 / world_ * world_;
  // Whether every tensor overlapping bucket k is marked.
  auto complete = [&](int64_t k, const std::vector<char>& marked) {
    const int64_t b = k * step, e = std::min(n, b + step);
    for (size_t i = 0; i < tensors.size(); ++i)
      if (tensors[i].first < e && tensors[i].second > b && !marked[i]) return false;
    return true;
  };
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(round == 0 ? "first step" : "second step");
    fill(grads);
    rec.gathered.clear();
    std::vector<char> marked(tensors.size(), 0);
    const bool odd = rank_ % 2 == 1;
    for (size_t j = 0; j < tensors.size(); ++j) {
      const size_t i = odd ? j : tensors.size() - 1 - j;
      if (odd && i % 3 == 0) continue;  // never named: launched by reduce()
      const Tensor t = view(grads).slice(tensors[i].first, tensors[i].second);
      reducer.gradient_final(t);
      reducer.gradient_final(t);  // twice: no effect
      marked[i] = 1;
      // The buckets launched: the longest run of complete ones from the top.
      int64_t expect = 0;
      while (expect < reducer.buckets() && complete(reducer.buckets() - 1 - expect, marked))
        ++expect;
      ASSERT_EQ(reducer.launched(), expect) << "after tensor " << i;
      ASSERT_EQ(static_cast<int64_t>(rec.gathered.size()), expect);
    }
    const int64_t early = reducer.launched();
    if (!odd) EXPECT_EQ(early, reducer.buckets());
    reducer.reduce();
    EXPECT_EQ(reducer.launched(), 0);
    EXPECT_EQ(reducer.launched_early(), early);
    ASSERT_EQ(static_cast<int64_t>(rec.gathered.size()), reducer.buckets());
    for (int64_t k = 0; k < reducer.buckets(); ++k)
      EXPECT_EQ(rec.gathered[size_t(k)], (reducer.buckets() - 1 - k) * step) << "launch " << k;
    EXPECT_TRUE(same_bits(grads, want));
    EXPECT_EQ(rec.detached, round + 1);
    EXPECT_EQ(rec.attached, round + 1);
  }
  // Only the given tensors, whole, may be named.
  EXPECT_THROW(reducer.gradient_final(view(grads).slice(tensors[1].first, tensors[1].second - 1)),
               Error);
  EXPECT_THROW(reducer.gradient_final(view(want).slice(0, 10)), Error);
  reducer.reduce();
}

// Pipeline groups: split() makes sub-groups that run collectives of their own, and exchange()
// posts a send and a receive together, so every rank can send to the next while receiving from
// the previous (past the eager limit, where two blocking sends would wait on each other).
TEST_F(Collectives, SplitGroupsAndPairedExchangesDoNotDeadlock) {
  auto group = session_->split(rank_ % 2, rank_, "the test split");
  const int members = (world_ + 1 - rank_ % 2) / 2;
  ASSERT_EQ(group->size(), members);
  EXPECT_EQ(group->rank(), rank_ / 2);
  std::vector<int> ranks(static_cast<size_t>(members));
  group->all_gather(&rank_, ranks.data(), sizeof(int), "the test gather");
  for (int k = 0; k < members; ++k) EXPECT_EQ(ranks[size_t(k)], rank_ % 2 + 2 * k);

  if (world_ < 2) return;
  const int64_t n = 1 << 16;
  const int next = (rank_ + 1) % world_, prev = (rank_ + world_ - 1) % world_;
  std::vector<float> out = data_of(rank_, n), in(static_cast<size_t>(n)), out2 = data_of(-rank_, 7),
                     in2(7);
  // Two messages each way in one call, received in the order they were posted.
  const MpiSession::Transfer sends[] = {{out.data(), out.size() * sizeof(float), next},
                                        {out2.data(), out2.size() * sizeof(float), next}};
  const MpiSession::Transfer recvs[] = {{in.data(), in.size() * sizeof(float), prev},
                                        {in2.data(), in2.size() * sizeof(float), prev}};
  session_->exchange(sends, 2, recvs, 2, "the test ring");
  EXPECT_TRUE(same_bits(in, data_of(prev, n)));
  EXPECT_TRUE(same_bits(in2, data_of(-prev, 7)));
}

TEST_F(Collectives, GroupedExchangeMatchesInPostingOrderAndReachesItself) {
  // Two messages each way round the ring in one call (received in the order posted, neither
  // waiting for the other), plus one to this rank itself; with one rank the ring is this rank.
  const int64_t n = 1 << 16;  // past the eager limit: a real rendezvous
  const int next = (rank_ + 1) % world_, prev = (rank_ + world_ - 1) % world_;
  std::vector<float> out = data_of(rank_, n), in(static_cast<size_t>(n)), out2 = data_of(-rank_, 7),
                     in2(7), self_out = data_of(100 + rank_, 5), self_in(5);
  using T = Communicator::Transfer;
  const T sends[] = {{view(out), next}, {view(out2), next}, {view(self_out), rank_}};
  const T recvs[] = {{view(in), prev}, {view(in2), prev}, {view(self_in), rank_}};
  comm_->exchange(sends, recvs, "the test exchange");
  EXPECT_TRUE(same_bits(in, data_of(prev, n)));
  EXPECT_TRUE(same_bits(in2, data_of(-prev, 7)));
  EXPECT_TRUE(same_bits(self_in, data_of(100 + rank_, 5)));
  // Nothing to move is no call at all; a peer outside the communicator is refused.
  comm_->exchange({}, {}, "the empty exchange");
  const T bad[] = {{view(out2), world_}};
  EXPECT_THROW(comm_->exchange(bad, {}, "the bad exchange"), Error);
}

TEST_F(Collectives, ShardExchangeSumsEachShardAndGathersEveryShard) {
  auto cpu = make_cpu_backend();
  // A length with a tail for the last rank, in one bucket and in many (packed) ones.
  const int64_t n = 10007;
  for (const int64_t bucket : {int64_t(1) << 20, int64_t(1000)}) {
    SCOPED_TRACE(bucket);
    std::vector<float> grads = data_of(rank_, n), weights(static_cast<size_t>(n), -1.0f);
    ShardExchange ex(*cpu, *comm_, view(grads), view(weights), bucket);
    const int64_t b = ex.begin(), e = ex.end();
    EXPECT_EQ(b, n / world_ * rank_);
    EXPECT_EQ(e, rank_ == world_ - 1 ? n : n / world_ * (rank_ + 1));
    EXPECT_EQ(ex.buckets(),
              bucket >= n ? 1 : (n / world_ + bucket / world_ - 1) / (bucket / world_));
    const std::vector<float> want = rank_order_sum(n);
    for (int pass = 0; pass < 2; ++pass) {  // the scratch is reused: a second step sums afresh
      const std::vector<float> fresh = data_of(rank_, n);
      std::copy(fresh.begin(), fresh.end(), grads.begin());
      ex.reduce_scatter();
      EXPECT_TRUE(same_bits(std::vector<float>(grads.begin() + b, grads.begin() + e),
                            std::vector<float>(want.begin() + b, want.begin() + e)));
      // Each rank writes its shard of the weights; the gather hands every rank all of them.
      std::fill(weights.begin(), weights.end(), -1.0f);
      std::copy(want.begin() + b, want.begin() + e, weights.begin() + b);
      ex.all_gather();
      EXPECT_TRUE(same_bits(weights, want));
    }
  }
}

TEST_F(Collectives, RefusesTensorsOfAnotherDevice) {
  std::vector<float> v(4);
  Tensor t = view(v);
  t.device = Device::cuda;
  EXPECT_THROW(comm_->broadcast(t, 0), Error);
}

}  // namespace
}  // namespace iris
