// The messages of the CUDA seams' status words (cuda/launch.h): what went wrong, the limit, the fix.
#include <fmt/format.h>

#include "cuda/launch.h"
#include "moekit/check.h"
#include "plan/gemm_config.h"

namespace moekit::cuda {

void check_status_words(std::int32_t* device_status, const char* who, std::int64_t M, std::int64_t E, void* stream) {
  std::int32_t w[kStatusWords] = {};
  read_status_words(device_status, w, stream);
  if (w[0] == kStatusOk) return;
  // Read, so cleared: the next error (of any later step) is the next one reported.
  clear_status_words(device_status, stream);
  std::int32_t cleared[kStatusWords];
  read_status_words(device_status, cleared, stream);  // waits for the clear
  switch (w[0]) {
    case kStatusOk: return;
    case kStatusBadCount: MOEKIT_FAIL("{}", plan::bad_count_message(who, w[1], w[2], M));
    case kStatusBadExpertId:
      MOEKIT_FAIL(
          "{}: topk_ids[{}][{}] = {} is outside [0, {}) (the expert ids; with redundant experts, the expert slots): "
          "that pair was dropped; the router or the caller produced an invalid expert",
          who, w[1], w[2], w[3], E);
    case kStatusNanLogit:
      MOEKIT_FAIL(
          "{}: routing: router logit of token {} (expert {}) is NaN; the hidden state or the router weights upstream "
          "are corrupt (the token was routed nowhere)",
          who, w[1], w[2]);
    case kStatusNoFiniteMax:
      MOEKIT_FAIL(
          "{}: routing: token {} has no finite maximum router logit; softmax needs one (the token was routed "
          "nowhere)",
          who, w[1]);
    case kStatusOverCapacity:
      MOEKIT_FAIL(
          "{}: expert {} received at least {} rows, more than M = {}: the rows past M were dropped; a token chose the "
          "expert twice",
          who, w[1], w[2], M);
    case kStatusPeerTimeout:
      MOEKIT_FAIL(
          "{}: rank {} did not signal the {} within the timeout (CTA {}): it died, raised, or runs another step. The "
          "NCCL communicator is aborted; rebuild the layer on every rank (MOEKIT_EP_TIMEOUT_MS sets the timeout)",
          who, w[2], w[1] == 0 ? "dispatch" : "combine", w[3]);
    case kStatusBadRecord:
      MOEKIT_FAIL(
          "{}: a record received from rank {} is corrupt (record {}, value {}): it was dropped. Every rank must run "
          "the same moekit build and problem",
          who, w[1], w[2], w[3]);
    case kStatusOverStepBound: MOEKIT_FAIL("{}", plan::over_step_bound_message(who, w[1], w[2], w[3]));
    default: MOEKIT_FAIL("{}: unknown device status code {} ({}, {}, {})", who, w[0], w[1], w[2], w[3]);
  }
}

}  // namespace moekit::cuda
