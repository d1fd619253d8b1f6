// The in-process communicator: num_ranks threads share one group and exchange data by memcpy from
// each other's buffers, between two barriers. Used by tests and `--ranks N` to run the layer's
// multi-rank paths without MPI.
#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "moekit/check.h"
#include "moekit/communicator.h"

namespace moekit {
namespace {

// What one rank publishes for the collective in flight. The pointers stay valid until the rank
// leaves the collective's closing barrier, which no rank passes before every rank has read them.
struct Slot {
  const std::byte* send = nullptr;
  const std::int64_t* send_bytes = nullptr;
  const std::int64_t* send_offsets = nullptr;
  const std::int64_t* recv_bytes = nullptr;
  const std::int64_t* counts = nullptr;
  const void* payload = nullptr;
  std::int64_t value_i64 = 0;
  double value_f64 = 0.0;
};

class Group {
 public:
  explicit Group(int num_ranks) : num_ranks_(num_ranks), slots_(static_cast<std::size_t>(num_ranks)) {}

  int num_ranks() const { return num_ranks_; }
  Slot& slot(int rank) { return slots_[static_cast<std::size_t>(rank)]; }

  // The opening barrier of a collective: raises moekit::Error instead of waiting forever when a rank
  // has failed (its fn threw) or has returned from fn, since then the collective can never complete.
  void barrier(int rank) { wait_for_all(rank, /*abortable=*/true); }

  // The closing barrier of a collective that read other ranks' buffers. Every rank is already inside
  // the collective (the opening barrier completed) and nothing between the two barriers can throw,
  // so it always completes; not aborting here keeps each sender's buffer alive until all have read.
  void closing_barrier(int rank) { wait_for_all(rank, /*abortable=*/false); }

  // Records a rank's failure; the first one is the exception run_in_process rethrows.
  void fail(int rank, std::exception_ptr error) {
    std::string what = "unknown exception";
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    std::lock_guard lock(mu_);
    if (!first_error_) {
      first_error_ = error;
      failed_rank_ = rank;
      failed_what_ = std::move(what);
    }
    cv_.notify_all();
  }

  // A rank returned from fn: any rank still waiting in a collective would wait forever.
  void depart(int rank) {
    std::lock_guard lock(mu_);
    if (departed_rank_ < 0) departed_rank_ = rank;
    cv_.notify_all();
  }

  std::exception_ptr first_error() {
    std::lock_guard lock(mu_);
    return first_error_;
  }

 private:
  void wait_for_all(int rank, bool abortable) {
    std::unique_lock lock(mu_);
    if (abortable) throw_if_broken(rank);
    const std::uint64_t generation = generation_;
    if (++num_arrived_ == num_ranks_) {
      num_arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    if (abortable) {
      cv_.wait(lock, [&] { return generation_ != generation || first_error_ || departed_rank_ >= 0; });
      // NOTES: a barrier that completed counts as completed even if a failure came at the same time;
      // the next collective reports the failure.
      if (generation_ == generation) {
        --num_arrived_;
        throw_if_broken(rank);
      }
    } else {
      cv_.wait(lock, [&] { return generation_ != generation; });
    }
  }

  // Called with mu_ held.
  void throw_if_broken(int rank) const {
    if (first_error_)
      throw Error(fmt::format("in-process group aborted: rank {} failed: {}", failed_rank_, failed_what_));
    if (departed_rank_ >= 0)
      throw Error(fmt::format(
          "in-process group: rank {} entered a collective after rank {} returned from its function; every rank "
          "must call the same collectives in the same order",
          rank, departed_rank_));
  }

  const int num_ranks_;
  std::vector<Slot> slots_;
  std::mutex mu_;
  std::condition_variable cv_;
  int num_arrived_ = 0;
  std::uint64_t generation_ = 0;
  std::exception_ptr first_error_;
  int failed_rank_ = -1;
  std::string failed_what_;
  int departed_rank_ = -1;
};

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(Group& group, int rank) : group_(group), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return group_.num_ranks(); }
  std::string name() const override { return "in-process"; }

  void all_to_all_v(const void* send, std::span<const std::int64_t> send_bytes,
                    std::span<const std::int64_t> send_offsets, void* recv, std::span<const std::int64_t> recv_bytes,
                    std::span<const std::int64_t> recv_offsets) override {
    // Local checks first: a throw here leaves the others at the opening barrier, which then aborts.
    check_span("send_bytes", send_bytes.size());
    check_span("send_offsets", send_offsets.size());
    check_span("recv_bytes", recv_bytes.size());
    check_span("recv_offsets", recv_offsets.size());
    for (int r = 0; r < size(); ++r) {
      const auto i = static_cast<std::size_t>(r);
      MOEKIT_CHECK(send_bytes[i] >= 0 && send_offsets[i] >= 0 && recv_bytes[i] >= 0 && recv_offsets[i] >= 0,
                   "all_to_all_v on rank {}: negative size or offset for peer {} (send {} B at {}, recv {} B at {})",
                   rank_, r, send_bytes[i], send_offsets[i], recv_bytes[i], recv_offsets[i]);
      MOEKIT_CHECK((send_bytes[i] == 0 || send != nullptr) && (recv_bytes[i] == 0 || recv != nullptr),
                   "all_to_all_v on rank {}: null buffer with {} B to send / {} B to receive for peer {}", rank_,
                   send_bytes[i], recv_bytes[i], r);
    }

    Slot& mine = group_.slot(rank_);
    mine.send = static_cast<const std::byte*>(send);
    mine.send_bytes = send_bytes.data();
    mine.send_offsets = send_offsets.data();
    mine.recv_bytes = recv_bytes.data();
    group_.barrier(rank_);

    // Every rank checks the whole matrix, so a mismatch raises the same Error on all ranks before any
    // rank reads a buffer: nobody is left waiting and no buffer is read after its owner has unwound.
    for (int src = 0; src < size(); ++src) {
      for (int dst = 0; dst < size(); ++dst) {
        const std::int64_t sent = group_.slot(src).send_bytes[dst];
        const std::int64_t expected = group_.slot(dst).recv_bytes[src];
        if (sent != expected) {
          // The closing barrier is still owed: every rank reaches this same branch.
          group_.closing_barrier(rank_);
          MOEKIT_CHECK(sent == expected,
                       "all_to_all_v: rank {} expects {} B from rank {}, which sends it {} B; exchange the sizes "
                       "with all_to_all_counts first",
                       dst, expected, src, sent);
        }
      }
    }

    auto* out = static_cast<std::byte*>(recv);
    for (int src = 0; src < size(); ++src) {
      const Slot& from = group_.slot(src);
      const std::int64_t num_bytes = recv_bytes[static_cast<std::size_t>(src)];
      if (num_bytes == 0) continue;
      std::memcpy(out + recv_offsets[static_cast<std::size_t>(src)], from.send + from.send_offsets[rank_],
                  static_cast<std::size_t>(num_bytes));
    }
    group_.closing_barrier(rank_);
  }

  void all_to_all_counts(std::span<const std::int64_t> send, std::span<std::int64_t> recv) override {
    check_span("send", send.size());
    check_span("recv", recv.size());
    group_.slot(rank_).counts = send.data();
    group_.barrier(rank_);
    for (int src = 0; src < size(); ++src) recv[static_cast<std::size_t>(src)] = group_.slot(src).counts[rank_];
    group_.closing_barrier(rank_);
  }

  std::int64_t all_reduce_max(std::int64_t value) override {
    group_.slot(rank_).value_i64 = value;
    group_.barrier(rank_);
    std::int64_t result = group_.slot(0).value_i64;
    for (int r = 1; r < size(); ++r) result = std::max(result, group_.slot(r).value_i64);
    group_.closing_barrier(rank_);
    return result;
  }

  double all_reduce_max(double value) override {
    group_.slot(rank_).value_f64 = value;
    group_.barrier(rank_);
    // Same order on every rank and NaN wins, so all ranks return the same value even with a NaN.
    double result = group_.slot(0).value_f64;
    for (int r = 1; r < size(); ++r) {
      const double v = group_.slot(r).value_f64;
      if (std::isnan(v) || v > result) result = v;
    }
    group_.closing_barrier(rank_);
    return result;
  }

  void barrier() override { group_.barrier(rank_); }

  void broadcast(void* data, std::int64_t bytes, int root) override {
    MOEKIT_CHECK(root >= 0 && root < size() && bytes >= 0, "broadcast: root {} of {} ranks, {} bytes", root, size(),
                 bytes);
    group_.slot(rank_).payload = data;
    group_.barrier(rank_);
    if (rank_ != root && bytes > 0) std::memcpy(data, group_.slot(root).payload, static_cast<std::size_t>(bytes));
    group_.closing_barrier(rank_);
  }

 private:
  void check_span(const char* what, std::size_t n) const {
    MOEKIT_CHECK(n == static_cast<std::size_t>(size()), "{} on rank {} has {} entries; it needs one per rank ({})",
                 what, rank_, n, size());
  }

  Group& group_;
  const int rank_;
};

}  // namespace

void run_in_process(int num_ranks, const std::function<void(Communicator&)>& fn) {
  MOEKIT_CHECK(num_ranks >= 1, "run_in_process: num_ranks = {}; it needs at least 1 rank", num_ranks);
  Group group(num_ranks);
  auto run_rank = [&](int rank) {
    try {
      InProcessCommunicator comm(group, rank);
      fn(comm);
      group.depart(rank);
    } catch (...) {
      group.fail(rank, std::current_exception());
    }
  };

  // Rank 0 runs on the caller's thread; the others on their own.
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(num_ranks - 1));
  try {
    for (int rank = 1; rank < num_ranks; ++rank) threads.emplace_back(run_rank, rank);
  } catch (const std::system_error& e) {
    // Could not start a thread: release the ones started (they abort at their first collective).
    const auto started = static_cast<int>(threads.size()) + 1;
    group.fail(started, std::make_exception_ptr(Error(fmt::format(
                            "moekit: could start only {} of the {} in-process ranks' threads ({}): ask for {} or fewer "
                            "ranks (--dp), or run them as MPI processes",
                            started, num_ranks, e.what(), started))));
  }
  if (static_cast<int>(threads.size()) == num_ranks - 1) run_rank(0);
  for (std::thread& t : threads) t.join();
  if (std::exception_ptr error = group.first_error()) std::rethrow_exception(error);
}

}  // namespace moekit
