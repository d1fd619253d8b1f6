// Programmatic dependent launch (PDL) for the kernels of a step: a kernel launched
// with launch_pdl may be scheduled while the kernel before it in the stream still runs, once that
// one has called pdl_launch_dependents() (or its blocks have exited), so the launch latency between
// the two (~1-2 us a kernel, most of a decode step's small kernels) overlaps the earlier kernel's
// work. Correctness rests on one rule: every kernel launched with launch_pdl calls pdl_wait()
// before it touches global memory (reads or writes): griddepcontrol.wait returns once the kernels it
// depends on have completed and their writes are visible. Kernels that do not follow the rule
// (NCCL's) are launched plainly: after them a PDL kernel starts only when their blocks exit, and
// before them nothing changes.
// Who lets the next kernel launch early: the small kernels (router, scatter, prepare, combine) call
// pdl_enter(). The GEMMs (CUTLASS's through grouped_gemm_impl.cuh's pdl_gemm_kernel, moekit's block
// GEMMs) and the activation kernels call pdl_wait() only, so that their dependents launch as their
// blocks exit: the GEMMs' CTAs then start while the kernel before them drains, and an empty launch
// of the rule exits right after its wait. An early trigger there measured slower (docs/PERF.md):
// from the activation, the W2 GEMM's CTAs (one an SM, most of its shared memory) took the SMs the
// activation's unplaced blocks needed; from the GEMMs, the per-token step ran longer.
// Stream capture keeps the relation as a programmatic edge of the graph. The rule is checked in the
// sources (ctest lint.pdl_rule, scripts/check_pdl.py): in a file that calls launch_pdl, every kernel's
// first statement is pdl_enter() or pdl_wait().
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "cuda/check.h"

namespace moekit::cuda {

// Waits for the kernels this one depends on (a no-op when it was not launched with launch_pdl).
__device__ __forceinline__ void pdl_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

// Lets the next kernel of the stream be scheduled now (it still waits in its own pdl_wait()).
__device__ __forceinline__ void pdl_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Both, at a kernel's top: wait for the earlier kernels, then let the next one launch.
__device__ __forceinline__ void pdl_enter() {
  pdl_wait();
  pdl_launch_dependents();
}

// kernel<<<grid, block, smem, stream>>>(args...) with programmatic stream serialization allowed, in
// clusters of `cluster` blocks along x (grid.x a multiple of it; 1: no cluster).
template <class... Params, class... Args>
void launch_pdl_clustered(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream,
                          unsigned cluster, Args&&... args) {
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  attr[1].id = cudaLaunchAttributeClusterDimension;
  attr[1].val.clusterDim.x = cluster;
  attr[1].val.clusterDim.y = 1;
  attr[1].val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = cluster > 1 ? 2 : 1;
  MOEKIT_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, static_cast<Params>(std::forward<Args>(args))...));
}

// kernel<<<grid, block, smem, stream>>>(args...) with programmatic stream serialization allowed.
template <class... Params, class... Args>
void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream,
                Args&&... args) {
  launch_pdl_clustered(kernel, grid, block, smem, stream, 1u, std::forward<Args>(args)...);
}

}  // namespace moekit::cuda
