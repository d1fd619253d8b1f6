// The MPI communicator: one rank per process over a duplicate of MPI_COMM_WORLD. Byte exchanges go
// through MPI_Alltoallv with MPI_BYTE, so every count and displacement must fit in an int (2 GiB).
// Built only when CMake finds MPI (MOEKIT_MPI); src/comm/no_mpi.cpp stands in otherwise.
#include <mpi.h>

#include <array>
#include <climits>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "moekit/check.h"
#include "moekit/communicator.h"

namespace moekit {
namespace {

// Every MPI call is checked; the communicator uses MPI_ERRORS_RETURN so that a failure comes back as
// a return code (and here a moekit::Error) rather than MPI's default abort without context.
void check_mpi(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  std::array<char, MPI_MAX_ERROR_STRING> text{};
  int length = 0;
  if (MPI_Error_string(rc, text.data(), &length) != MPI_SUCCESS) length = 0;
  MOEKIT_CHECK(rc == MPI_SUCCESS, "{} failed with error {}: {}", call, rc,
               std::string(text.data(), static_cast<std::size_t>(length)));
}

void finalize_mpi() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

// MPI_Init_thread once per process; MPI_Finalize at exit only if moekit was the one to initialize.
void ensure_mpi_initialized() {
  static std::mutex mu;
  std::lock_guard lock(mu);
  int finalized = 0;
  check_mpi(MPI_Finalized(&finalized), "MPI_Finalized");
  MOEKIT_CHECK(!finalized, "make_mpi_communicator: MPI is already finalized; create the communicator before exit");
  int initialized = 0;
  check_mpi(MPI_Initialized(&initialized), "MPI_Initialized");
  if (initialized) return;
  // NOTES: SERIALIZED, not FUNNELED: the caller may drive collectives from a worker thread, but
  // never from two threads at once (every call is collective and ordered).
  int provided = 0;
  check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
  MOEKIT_CHECK(std::atexit(finalize_mpi) == 0, "make_mpi_communicator: could not register MPI_Finalize at exit");
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator() {
    // A duplicate isolates moekit's traffic from the application's and lets us set the error
    // handler without changing MPI_COMM_WORLD's.
    check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &comm_), "MPI_Comm_dup");
    check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check_mpi(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check_mpi(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  }

  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }

  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "mpi"; }

  void all_to_all_v(const void* send, std::span<const std::int64_t> send_bytes,
                    std::span<const std::int64_t> send_offsets, void* recv, std::span<const std::int64_t> recv_bytes,
                    std::span<const std::int64_t> recv_offsets) override {
    const auto n = static_cast<std::size_t>(size_);
    // Bad arguments are agreed on by all ranks before the exchange, so every rank raises an Error
    // instead of the healthy ones waiting in MPI_Alltoallv for a rank that left.
    std::string error = validate(send, send_bytes, send_offsets, recv, recv_bytes, recv_offsets);

    // Each rank tells each peer (bytes it sends the peer, bytes it expects from the peer): 16 B per
    // pair, so each side of every pair can check the other's expectation.
    std::vector<std::int64_t> mine(2 * n, 0), theirs(2 * n, 0);
    if (error.empty()) {
      for (std::size_t r = 0; r < n; ++r) {
        mine[2 * r] = send_bytes[r];
        mine[2 * r + 1] = recv_bytes[r];
      }
    }
    check_mpi(MPI_Alltoall(mine.data(), 2, MPI_INT64_T, theirs.data(), 2, MPI_INT64_T, comm_), "MPI_Alltoall");
    for (std::size_t r = 0; r < n && error.empty(); ++r) {
      const std::int64_t peer_sends = theirs[2 * r], peer_expects = theirs[2 * r + 1];
      if (peer_sends != mine[2 * r + 1])
        error = fmt::format("rank {} expects {} B from rank {}, which sends it {} B", rank_, mine[2 * r + 1], r,
                            peer_sends);
      else if (peer_expects != mine[2 * r])
        error =
            fmt::format("rank {} expects {} B from rank {}, which sends it {} B", r, peer_expects, rank_, mine[2 * r]);
    }
    const int failed_rank = agree_on_failure(!error.empty());
    if (failed_rank >= 0) {
      if (error.empty()) error = fmt::format("rank {} rejected the exchange (see its error)", failed_rank);
      MOEKIT_CHECK(failed_rank < 0,
                   "all_to_all_v on rank {}: {}; exchange the sizes with all_to_all_counts first and keep every "
                   "count and offset in [0, INT_MAX]",
                   rank_, error);
    }

    std::vector<int> scounts(n), sdispls(n), rcounts(n), rdispls(n);
    for (std::size_t r = 0; r < n; ++r) {
      scounts[r] = static_cast<int>(send_bytes[r]);
      sdispls[r] = static_cast<int>(send_offsets[r]);
      rcounts[r] = static_cast<int>(recv_bytes[r]);
      rdispls[r] = static_cast<int>(recv_offsets[r]);
    }
    // NOTES: a rank with nothing to send or receive may pass null; MPI wants a real address.
    static std::byte dummy[1];
    check_mpi(MPI_Alltoallv(send ? send : dummy, scounts.data(), sdispls.data(), MPI_BYTE, recv ? recv : dummy,
                            rcounts.data(), rdispls.data(), MPI_BYTE, comm_),
              "MPI_Alltoallv");
  }

  void all_to_all_counts(std::span<const std::int64_t> send, std::span<std::int64_t> recv) override {
    MOEKIT_CHECK(send.size() == static_cast<std::size_t>(size_) && recv.size() == send.size(),
                 "all_to_all_counts on rank {}: send has {} entries, recv {}; both need one per rank ({})", rank_,
                 send.size(), recv.size(), size_);
    check_mpi(MPI_Alltoall(send.data(), 1, MPI_INT64_T, recv.data(), 1, MPI_INT64_T, comm_), "MPI_Alltoall");
  }

  std::int64_t all_reduce_max(std::int64_t value) override {
    std::int64_t result = 0;
    check_mpi(MPI_Allreduce(&value, &result, 1, MPI_INT64_T, MPI_MAX, comm_), "MPI_Allreduce");
    return result;
  }

  double all_reduce_max(double value) override {
    double result = 0.0;
    check_mpi(MPI_Allreduce(&value, &result, 1, MPI_DOUBLE, MPI_MAX, comm_), "MPI_Allreduce");
    return result;
  }

  void barrier() override { check_mpi(MPI_Barrier(comm_), "MPI_Barrier"); }

  void broadcast(void* data, std::int64_t bytes, int root) override {
    MOEKIT_CHECK(root >= 0 && root < size_ && bytes >= 0 && bytes <= std::numeric_limits<int>::max(),
                 "broadcast: root {} of {} ranks, {} bytes", root, size_, bytes);
    check_mpi(MPI_Bcast(data, static_cast<int>(bytes), MPI_BYTE, root, comm_), "MPI_Bcast");
  }

 private:
  // The local checks of all_to_all_v; returns the problem, or "" when there is none.
  std::string validate(const void* send, std::span<const std::int64_t> send_bytes,
                       std::span<const std::int64_t> send_offsets, const void* recv,
                       std::span<const std::int64_t> recv_bytes, std::span<const std::int64_t> recv_offsets) const {
    const auto n = static_cast<std::size_t>(size_);
    if (send_bytes.size() != n || send_offsets.size() != n || recv_bytes.size() != n || recv_offsets.size() != n)
      return fmt::format("the size/offset spans have {}, {}, {}, {} entries; each needs one per rank ({})",
                         send_bytes.size(), send_offsets.size(), recv_bytes.size(), recv_offsets.size(), n);
    for (std::size_t r = 0; r < n; ++r) {
      for (const std::int64_t v : {send_bytes[r], send_offsets[r], recv_bytes[r], recv_offsets[r]}) {
        if (v < 0 || v > INT_MAX)
          return fmt::format(
              "peer {}: send {} B at {}, recv {} B at {}; MPI counts and offsets are int, so each must be in "
              "[0, {}] (reduce max_tokens_per_rank or exchange in chunks)",
              r, send_bytes[r], send_offsets[r], recv_bytes[r], recv_offsets[r], INT_MAX);
      }
      if ((send_bytes[r] > 0 && send == nullptr) || (recv_bytes[r] > 0 && recv == nullptr))
        return fmt::format("null buffer with {} B to send / {} B to receive for peer {}", send_bytes[r], recv_bytes[r],
                           r);
    }
    return {};
  }

  // Returns the highest rank that failed, or -1 when none did; every rank gets the same answer.
  int agree_on_failure(bool failed) {
    const int local = failed ? rank_ : -1;
    int global = -1;
    check_mpi(MPI_Allreduce(&local, &global, 1, MPI_INT, MPI_MAX, comm_), "MPI_Allreduce");
    return global;
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 0;
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator() {
  ensure_mpi_initialized();
  return std::make_unique<MpiCommunicator>();
}

bool mpi_available() {
  return true;
}

}  // namespace moekit
