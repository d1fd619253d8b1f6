// The CPU backend's implementations of the seams, as the registry (src/layer/registry.cpp) builds
// them. Each mirrors its CUDA twin in src/cuda/ file for file.
#pragma once

#include <memory>

#include "moekit/experts.h"
#include "moekit/memory.h"
#include "moekit/prepare_finalize.h"
#include "moekit/registry.h"
#include "moekit/router.h"

namespace moekit::cpu {

std::unique_ptr<Experts> make_batched_experts(const ExecContext& ctx);                     // cpu/batched_experts.cpp
std::unique_ptr<Experts> make_standard_experts(const ExecContext& ctx);                    // cpu/standard_experts.cpp
std::unique_ptr<Router> make_router(const RoutingConfig& config, const ExecContext& ctx);  // cpu/router.cpp
// Batched format over a communicator: (token, expert) pairs to the owning rank (cpu/prepare_finalize.cpp).
std::unique_ptr<PrepareFinalize> make_all_to_all(const ExecContext& ctx);
// Standard format, ep == 1: quantize in place, combine the experts' permuted rows.
std::unique_ptr<PrepareFinalize> make_local(const ExecContext& ctx);
std::unique_ptr<Memory> make_host_memory();      // cpu/memory.cpp
std::unique_ptr<StreamFork> make_stream_fork();  // cpu/memory.cpp: everything in order

}  // namespace moekit::cpu
