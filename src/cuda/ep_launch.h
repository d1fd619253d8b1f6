// Expert parallelism across GPUs on NCCL, the plain-C++ face of src/cuda/nccl/ep.cu (or of
// no_nccl.cpp when moekit is built without NCCL >= 2.28): the NCCL group of a layer's ranks, the
// symmetric memory its workspace lives in, and the launchers of the two transports' kernels. Byte
// layouts: plan/ep_layout.h.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "moekit/communicator.h"
#include "moekit/memory.h"
#include "moekit/types.h"

namespace moekit::cuda {

// Built with NCCL's device API (2.28+), and the version string it was compiled against.
bool nccl_built();
std::string nccl_compiled_version();

// An NCCL communicator over the ranks of `comm` (rank i on its current CUDA device), bootstrapped
// over `comm` (the unique id is its only traffic). Collective. Raises moekit::Error when the NCCL
// loaded at run time is not the one moekit was compiled against (its device API is inlined into
// moekit's kernels), or when NCCL fails.
class NcclGroup;
std::shared_ptr<NcclGroup> make_nccl_group(Communicator& comm);

// Memory whose one allocation is symmetric: ncclMemAlloc + ncclCommWindowRegister on every rank
// (collective), so the device-initiated transport can store into the same offsets of its peers'
// workspaces. Raises moekit::Error when a peer is outside this GPU's NVLink (LSA) domain.
std::unique_ptr<Memory> make_symmetric_memory(std::shared_ptr<NcclGroup> group);

// One step's operands, every pointer in the workspace (regions of cuda/prepare_finalize.cpp's nccl
// tiers); the *_offset fields are the same regions' offsets from the workspace base, which are equal
// on every rank (one plan), so a peer's copy is its window base plus the offset.
struct EpStep {
  int rank = 0, ranks = 1;
  std::int64_t tokens = 0, max_tokens = 0, K = 0, topk = 0, E_local = 0, M = 0;
  QuantScheme quant = QuantScheme::kPerTokenPerChannel;
  const std::int32_t* topk_ids = nullptr;  // (tokens, topk) global ids, -1: none
  const float* topk_weights = nullptr;
  const std::uint16_t* hidden = nullptr;       // (tokens, K) bf16, this rank's tokens
  std::int64_t* token_destinations = nullptr;  // (max_tokens) bit r: the token went to rank r (prepare -> finalize)
  std::int32_t* send_index = nullptr;          // reference: (max_tokens, ranks) index among the tokens sent to a rank
  std::int32_t* send_count = nullptr;          // reference: (ranks)
  std::byte* send = nullptr;                   // reference: (ranks, max_tokens) records to send
  std::byte* recv = nullptr;                   // (ranks, max_tokens) records by source: at [source][token]
                                               // (device-initiated, stamped with the epoch) or [source][index]
  std::int32_t* recv_count = nullptr;          // reference: (ranks) records received from each source
  std::int32_t* recv_ids = nullptr;            // (ranks * max_tokens * topk) local expert of each received slot
  std::int32_t* pair_row = nullptr;            // the same shape: its row in (E_local * M), -1: none
  std::int32_t* row_map_tiles = nullptr;
  std::uint8_t* a1q = nullptr;
  float* a1q_scale = nullptr;
  std::int32_t* expert_num_tokens = nullptr;
  const std::uint16_t* expert_output = nullptr;  // finalize: the experts' rows
  float* combine_send = nullptr;                 // reference: (ranks, max_tokens, K) partials by source
  float* combine_recv =
      nullptr;  // device-initiated: (max_tokens, min(topk, ranks), K); reference: (ranks, max_tokens, K)
  std::uint64_t* flags = nullptr;   // device-initiated: (3 phases, ranks, kEpCtas) written by peers
  std::uint64_t* epochs = nullptr;  // device-initiated: (3 phases, kEpCtas)
  // Device-initiated: sticky, never cleared by a step: [0] why the group broke (kEpBrokenTimeout,
  // kEpBrokenByPeer; 0 while healthy), [1] phase, [2] peer, [3] CTA. Once set, every later signal of
  // this rank carries the poison bit, so a late peer fails instead of using this rank's data.
  std::int32_t* broken = nullptr;
  std::int32_t* status = nullptr;
  std::uint16_t* output = nullptr;  // finalize: (tokens, K) bf16
  std::int64_t recv_offset = 0, combine_recv_offset = 0, flags_offset = 0;
  std::int64_t timeout_ns = 0;  // a peer silent this long: flagged, the step ends
};

inline constexpr std::int32_t kEpBrokenTimeout = 1;  // a peer did not signal within the timeout
inline constexpr std::int32_t kEpBrokenByPeer = 2;   // a peer signalled that it broke
inline constexpr std::int64_t kEpBrokenWords = 8;    // as many as the status words: read_status_words reads it

// Prepare, both tiers: where each token goes (send_index, send_count), the records to every rank
// (stored straight into the peers' windows, or packed locally and exchanged with grouped
// ncclSend/ncclRecv after the counts), then the fan-out into (E_local, M, K) and expert_num_tokens.
// The reference tier reads the counts on the host (not capturable); the device-initiated tier never
// synchronizes with the host. `workspace_base` is the window's base (device-initiated tier).
void launch_ep_dispatch(const EpStep& step, NcclGroup& group, bool device_initiated, void* stream);
// Finalize, both tiers: the owner's partial per (token, rank) back to the source, the sum in rank
// order, one bf16 rounding.
void launch_ep_combine(const EpStep& step, NcclGroup& group, bool device_initiated, void* stream);
// NCCL's point-to-point bandwidth from this rank to the next (ncclSend/ncclRecv of 256 MiB in a
// ring, GB/s one way), the ceiling `moekit bench dispatch` reports against. Collective.
double measure_peer_gbs(NcclGroup& group, void* stream);
// NCCL sets up point-to-point connections at the first send/recv to a peer, on the host and with
// the peer's help: a step must not be the first (a silent peer would block the host in
// ncclGroupEnd, past any timeout). One exchange with every rank, at attach. Collective.
void connect_nccl_peers(NcclGroup& group, void* stream);
// The device-initiated transport's flags and status, for the teardown handshake before the window
// is unmapped (PrepareFinalize::attach sets it).
void set_ep_teardown(NcclGroup& group, const EpStep& step);
// After a device-initiated step flagged a silent peer: the communicator is aborted; later steps raise.
void abort_nccl_group(NcclGroup& group, const std::string& why);

}  // namespace moekit::cuda
