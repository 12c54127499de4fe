// The CPU communicator: MpiSession's bounded host exchanges on CPU tensors.
#include <string>

#include "core/error.h"
#include "parallel/communicator.h"
#include "parallel/mpi_session.h"

namespace iris {
namespace {

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MpiSession& s) : s_(s) {}
  int rank() const override { return s_.rank(); }
  int size() const override { return s_.size(); }
  std::string name() const override { return "MPI"; }
  Device device() const override { return Device::cpu; }

  void all_gather(const Tensor& out, const Tensor& in) override {
    check(out, "all_gather");
    check(in, "all_gather");
    IRIS_CHECK(out.nbytes() == in.nbytes() * static_cast<size_t>(size()),
               "all_gather: out must hold size() copies of in, got ", out.shape_str(), " and ",
               in.shape_str());
    s_.all_gather(in.data, out.data, in.nbytes(), "all_gather");
  }
  void all_to_all(const Tensor& out, const Tensor& in) override {
    check(out, "all_to_all");
    check(in, "all_to_all");
    IRIS_CHECK(out.nbytes() == in.nbytes() && in.nbytes() % static_cast<size_t>(size()) == 0,
               "all_to_all: in and out of the same size, a multiple of size(), got ",
               in.shape_str(), " and ", out.shape_str());
    s_.all_to_all(in.data, out.data, in.nbytes() / static_cast<size_t>(size()), "all_to_all");
  }
  void broadcast(const Tensor& buf, int root) override {
    check(buf, "broadcast");
    s_.broadcast(buf.data, buf.nbytes(), root, "broadcast");
  }
  void send(const Tensor& t, int peer) override {
    check(t, "send");
    s_.send(t.data, t.nbytes(), peer, "send");
  }
  void recv(const Tensor& t, int peer) override {
    check(t, "recv");
    s_.recv(t.data, t.nbytes(), peer, "recv");
  }
  void exchange(std::span<const Transfer> sends, std::span<const Transfer> recvs,
                const char* what) override {
    IRIS_CHECK(sends.size() <= size_t(MpiSession::kMaxTransfers) &&
                   recvs.size() <= size_t(MpiSession::kMaxTransfers),
               what, ": more than ", MpiSession::kMaxTransfers,
               " sends or receives in one exchange");
    MpiSession::Transfer s[MpiSession::kMaxTransfers], r[MpiSession::kMaxTransfers];
    auto fill = [&](MpiSession::Transfer* out, std::span<const Transfer> in) {
      for (size_t i = 0; i < in.size(); ++i) {
        check(in[i].t, what);
        IRIS_CHECK(in[i].peer >= 0 && in[i].peer < size(), what, ": peer ", in[i].peer,
                   " is not a rank of this communicator of ", size());
        out[i] = MpiSession::Transfer{in[i].t.data, in[i].t.nbytes(), in[i].peer};
      }
    };
    fill(s, sends);
    fill(r, recvs);
    if (!sends.empty() || !recvs.empty())
      s_.exchange(s, static_cast<int>(sends.size()), r, static_cast<int>(recvs.size()), what);
  }
  using Communicator::sum_pieces;
  void sum_pieces(const Tensor& out, const Tensor& pieces, bool accumulate) override {
    check(out, "sum_pieces");
    check(pieces, "sum_pieces");
    const int64_t n = out.numel(), w = size();
    IRIS_CHECK(out.dtype == DType::f32 && pieces.dtype == DType::f32 && pieces.numel() == n * w,
               "sum_pieces: f32 out [n] and pieces [", w, " * n], got ", out.shape_str(), " and ",
               pieces.shape_str());
    const float* p = pieces.as<float>();
    float* o = out.as<float>();
#pragma omp parallel for schedule(static) if (n > (int64_t(1) << 16))
    for (int64_t i = 0; i < n; ++i) {
      float s = p[i];
      for (int64_t r = 1; r < w; ++r) s += p[r * n + i];
      o[i] = accumulate ? o[i] + s : s;
    }
  }

 private:
  static void check(const Tensor& t, const char* op) {
    IRIS_CHECK(t.device == Device::cpu, op, ": the MPI communicator moves CPU tensors, got a ",
               t.device == Device::cuda ? "CUDA" : "non-CPU", " tensor (use NCCL for those)");
  }
  MpiSession& s_;
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(MpiSession& session) {
  return std::make_unique<MpiCommunicator>(session);
}

}  // namespace iris
