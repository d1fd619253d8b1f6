// The CUDA backend's implementations of the seams, as the registry (src/layer/registry.cpp) builds
// them; each mirrors its CPU twin in src/cpu/. Plain C++: these host classes compile everywhere, so
// `moekit plan` shows the CUDA declarations on machines without a GPU; their kernels come from the
// .cu files, or from no_cuda.cpp (which raises moekit::Error) when moekit is built without CUDA.
#pragma once

#include <memory>

#include "moekit/experts.h"
#include "moekit/memory.h"
#include "moekit/prepare_finalize.h"
#include "moekit/registry.h"
#include "moekit/router.h"
#include "moekit/workspace.h"
#include "plan/gemm_config.h"

namespace moekit::cuda {

std::unique_ptr<Experts> make_batched_experts(const ExecContext& ctx);  // cuda/batched_experts.cpp
// The same with every expert of both GEMMs on one config (tests and benchmarks sweep the table).
std::unique_ptr<Experts> make_batched_experts(const ExecContext& ctx, plan::GemmConfig config);
std::unique_ptr<Experts> make_standard_experts(const ExecContext& ctx);                    // cuda/standard_experts.cpp
std::unique_ptr<Router> make_router(const RoutingConfig& config, const ExecContext& ctx);  // cuda/router.cpp
// Batched format on one GPU (dp == ep == 1): quantize fused with the scatter into (E_local, M, K).
std::unique_ptr<PrepareFinalize> make_scatter(const ExecContext& ctx);  // cuda/prepare_finalize.cpp
// Standard format, ep == 1: quantize in place, combine the experts' permuted rows.
std::unique_ptr<PrepareFinalize> make_local(const ExecContext& ctx);
// Batched format over ranks on NCCL (cuda/ep_launch.h): the device-initiated transport, and the
// reference one (grouped send/recv, counts on the host).
std::unique_ptr<PrepareFinalize> make_nccl_device(const ExecContext& ctx);
std::unique_ptr<PrepareFinalize> make_nccl_reference(const ExecContext& ctx);
std::unique_ptr<Memory> make_device_memory();    // cuda/memory.cu
std::unique_ptr<StreamFork> make_stream_fork();  // cuda/memory.cu: a non-blocking stream and two events
bool available();                                // built with CUDA and a device present (never raises)

struct BatchedExpertsLaunch;
// The regions both CUDA experts add to the recipe (GEMM arguments, CUTLASS scratch, status words),
// and the launch fields they bind.
void declare_gemm_regions(const MoeProblem& problem, const plan::ExpertsGemmPlan& gemms, WorkspaceBuilder& builder);
void fill_gemm_regions(BatchedExpertsLaunch& launch, Workspace& workspace);
// The launch of one step over a workspace declared by the batched experts (tests and benchmarks
// time its stages apart).
BatchedExpertsLaunch make_launch(const MoeProblem& problem, const ExpertsInput& input, const ExpertWeightsView& weights,
                                 Workspace& workspace, int num_sms, plan::ExpertsGemmPlan gemms);

}  // namespace moekit::cuda
