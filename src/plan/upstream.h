// Labelled references, not backends: the upstream batched CUTLASS FP8 experts' workspace formula
// before and after its fix (reference/000_*.txt), quoted so that `moekit plan` can show the 112 GiB
// / 3.5 GiB case beside moekit's own figure. Nothing here is ever allocated.
#pragma once

#include <string_view>
#include <vector>

#include "moekit/workspace.h"

namespace moekit::plan {

struct UpstreamReference {
  std::string_view name;
  bool before_fix;
  std::string_view summary;
};

const std::vector<UpstreamReference>& upstream_references();

// The quoted formula as a plan: an "experts" section with its two workspaces, then the batched
// experts' input/output buffers every implementation holds beside it. Batched format only.
WorkspacePlan plan_upstream_reference(const UpstreamReference& reference, const MoeProblem& problem);

}  // namespace moekit::plan
