// How ranks talk: one interface, three engines (in-process threads for tests and --ranks, MPI
// between processes; NCCL between GPUs is a transport of the prepare/finalize, bootstrapped over one of these). Every
// call is collective: all ranks of the group call it in the same order. A failure on one rank raises moekit::Error on
// every rank, never a hang (in-process) or names the rank that failed (MPI aborts the job with the message).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

namespace moekit {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;  // "in-process" or "mpi"

  // Rank i sends send_bytes[r] bytes from send + send_offsets[r] to every rank r and receives
  // recv_bytes[r] bytes from rank r into recv + recv_offsets[r]. recv_bytes[r] must equal what
  // rank r sends here (exchange counts first with all_to_all_counts); a mismatch is an Error.
  virtual void all_to_all_v(const void* send, std::span<const std::int64_t> send_bytes,
                            std::span<const std::int64_t> send_offsets, void* recv,
                            std::span<const std::int64_t> recv_bytes, std::span<const std::int64_t> recv_offsets) = 0;
  // recv[r] = the value rank r put in its send[this rank]; both spans have size() entries.
  virtual void all_to_all_counts(std::span<const std::int64_t> send, std::span<std::int64_t> recv) = 0;
  virtual std::int64_t all_reduce_max(std::int64_t value) = 0;
  virtual double all_reduce_max(double value) = 0;
  virtual void barrier() = 0;
  // Every rank's `data` (bytes each) becomes root's. Small payloads (e.g. NCCL's unique id).
  virtual void broadcast(void* data, std::int64_t bytes, int root) = 0;
};

// Runs fn on `num_ranks` threads, each with its own rank of one in-process group, and joins them.
// If any rank throws, the others are released from their collectives with moekit::Error, and the
// first exception is rethrown here after every thread has ended.
void run_in_process(int num_ranks, const std::function<void(Communicator&)>& fn);

// The MPI world (MPI_Init on first use, MPI_Finalize at exit). Raises moekit::Error when moekit was
// built without MPI.
std::unique_ptr<Communicator> make_mpi_communicator();
bool mpi_available();

}  // namespace moekit
