// The byte layout of expert-parallel dispatch across GPUs, the one definition the planner (region
// sizes), the NCCL transports' kernels and the tests read.
//
// A token goes once to each rank that holds any of its experts, as one record in that rank's receive
// buffer at [source rank][the token's index among the source's tokens for this rank]:
//   header  int32 token, slot_mask (bit k: slot k's expert lives here), ordinal (this rank's place
//           among the token's destination ranks, in rank order), epoch (the step that wrote it:
//           device-initiated records live at [source][token] and stale ones are told by it);
//           int32 local_expert[topk]
//           (-1: not here); float weight[topk]
//   row     K elements of the recipe's activation dtype (FP8 codes, or bf16 values: 2K bytes)
//   scales  the row's activation scales (numerics/scales.h), fp32
// The receiver fans each record out to its local experts' (M, K) rows. The combine returns one fp32
// partial per (token, destination): the owner sums its slots first (fp32, slot order), the source
// adds the partials in rank order and rounds once to bf16.
#pragma once

#include <cstdint>

#include "moekit/recipe.h"
#include "moekit/types.h"
#include "numerics/host_device.h"
#include "numerics/scales.h"

namespace moekit::plan {

inline constexpr int kMaxEpRanks = 64;  // destination masks are 64-bit
inline constexpr int kMaxEpTopk = 32;   // slot masks are 32-bit
// CTAs of the device-initiated transport kernels: the same grid on every rank, CTA b of each rank
// signals CTA b of every other (one flag each); all co-resident on an H100/H200 (132 SMs).
inline constexpr int kEpCtas = 256;
inline constexpr int kEpPhases = 3;  // dispatch, combine, teardown: one flag set each

struct EpRecord {
  std::int64_t header_bytes = 0;
  std::int64_t row_offset = 0;    // K elements of the recipe's activation dtype
  std::int64_t row_bytes = 0;     // K FP8 codes: K bytes; K bf16 values: 2K
  std::int64_t scale_offset = 0;  // scales_per_row fp32
  std::int64_t scales_per_row = 0;
  std::int64_t bytes = 0;  // the record, 16-byte aligned
};

MOEKIT_HD constexpr std::int64_t round_up16(std::int64_t x) {
  return (x + 15) / 16 * 16;
}

MOEKIT_HD constexpr EpRecord ep_record(QuantScheme quant, std::int64_t K, std::int64_t topk) {
  EpRecord r;
  r.header_bytes = round_up16(16 + 8 * topk);
  r.row_offset = r.header_bytes;
  r.row_bytes = K * dtype_size(recipe_info(quant).activation_dtype);
  r.scale_offset = r.row_offset + round_up16(r.row_bytes);
  r.scales_per_row = numerics::activation_scales_per_row(quant, K);
  r.bytes = round_up16(r.scale_offset + 4 * r.scales_per_row);
  return r;
}

// Header words of a record (int32 units).
inline constexpr int kEpHeaderToken = 0, kEpHeaderSlotMask = 1, kEpHeaderOrdinal = 2, kEpHeaderEpoch = 3,
                     kEpHeaderExperts = 4;
MOEKIT_HD constexpr int ep_header_weight(std::int64_t topk) {
  return kEpHeaderExperts + static_cast<int>(topk);
}

// Partials a token can receive back: one per destination rank, at most min(topk, ranks).
MOEKIT_HD constexpr std::int64_t ep_max_destinations(std::int64_t topk, std::int64_t ranks) {
  return topk < ranks ? topk : ranks;
}

}  // namespace moekit::plan
