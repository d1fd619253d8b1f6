"""Low-level ops in the conventions an inference engine's fused-MoE path already uses.

batched_experts(a1q, a1q_scale, expert_num_tokens, w1, w1_scale, w2, w2_scale, out, activation="silu",
                quant=None, stream=None, fuse_w1=None, max_rows=0, swiglu_limit=7.0,
                accumulation="precise")
    The experts alone in the BatchedExperts convention (DeepEP low-latency / pplx dispatch output):
      a1q (E_local, M, K) FP8 e4m3 (uint8 codes, or torch.float8_e4m3fn); rows >= expert_num_tokens[e]
      of expert e are padding: never read into a result, never written
      a1q_scale float32: (E_local,) per-tensor, (E_local, M) per-token, (E_local, M, ceil(K/128)) 1x128
      expert_num_tokens (E_local,) int32
      w1 (E_local, N, K), w2 (E_local, K, I) FP8 with float32 scales in the matching scheme
      (w_scale (E_local, 1) per-tensor, (E_local, rows) per-channel, (E_local, ceil(rows/128) *
      ceil(cols/128)) 128x128 blocks)
      out (E_local, M, K) bfloat16 (or its uint16 bits), written for the valid rows only
      max_rows: the most rows any expert holds in this call, when the caller knows it (e.g. the
      step's tokens per rank x dispatchers; 0: not known, M). On a GPU the GEMM launches of larger
      experts are then not made (a decode step planned for M launches them empty, ~3 us each); an
      expert holding more is skipped and raised as an error, never computed wrong.
    W1 -> activation -> FP8 -> W2, fp32 accumulation.

standard_experts(a1q, a1q_scale, topk_ids, topk_weights, w1, w1_scale, w2, w2_scale, out, activation="silu",
                 quant=None, stream=None, fuse_w1=None, swiglu_limit=7.0,
                 accumulation="precise")
    The same experts in the standard (token-order) convention, with the top-k weighted sum:
      a1q (T, K) FP8, a1q_scale (1,) per-tensor, (T,) per-token or (T, ceil(K/128)) 1x128
      topk_ids (T, topk) int32 local expert ids in [0, E_local), -1: the slot is skipped
      topk_weights (T, topk) float32
      out (T, K) bfloat16: out[t] = sum over slots of weight * expert(a1q[t]) (fp32, slot order, one
      rounding, as the layer's combine)

`swiglu_limit`: swigluoai's clamp (gpt-oss's config.swiglu_limit; the gate is clamped above at it,
the up projection to [-limit, limit]); the other activations ignore it. `accumulation`: "precise"
(default) moves the GPU GEMMs' FP8 partial sums into fp32 every 128 elements of K; "fast" (per-token
and per-tensor only) keeps the whole K loop in the tensor cores' FP8 accumulation: faster, and up to
~20% low at K = 7168 on all-positive products. The CPU sums in fp32 either way.

Both run where their arrays are: NumPy arrays or CPU tensors on the CPU, CUDA tensors on their GPU,
zero copy. `quant` is inferred from the scales' shapes (pass "per-token", "per-tensor" or
"block128" where two schemes fit). `fuse_w1`: None (default) fuses where it runs
(block128 with any activation but swigluoai): the activation and its 1x128 quantization run in the
W1 GEMM (its epilogue, or for experts of <= 64 rows a kernel over their fp32 rows), no bf16 W1
output in the workspace, as `moekit run`; False asks for the unfused recipe (W1 into bf16, then the
activation), True for the fused one (an error where it cannot run). On a GPU the work is enqueued on `stream` (a cudaStream_t as an
int; default: torch's current stream of that device) with no host synchronization, so the ops can be
captured in CUDA graphs. Each problem shape builds its workspace once, on its first call, and keeps
it (workspace_bytes()); make that first call before a graph capture. The CPU raises bad counts or ids
at once; on a GPU they are clamped on the device (nothing is written out of bounds), each workspace
keeps the first flags its calls raise, and check_status() raises for them (and clears them).

With torch installed they are also torch.ops.moekit.batched_experts / standard_experts
(torch.library.Library ops mutating `out`, with fake kernels): torch.compile(fullgraph=True) traces
them without a graph break and torch.cuda.graph captures them. Calls that share a workspace (same
shapes and device) never overlap: a call on another stream waits for the last one (eager calls).
"""
from __future__ import annotations

import os
from typing import Any, Optional

from . import _moekit

__all__ = ["batched_experts", "standard_experts", "check_status", "workspace_bytes"]

_THREADS = max(1, (os.cpu_count() or 1))


try:
    import torch as _torch
except ImportError:  # NumPy only
    _torch = None
# torch's C entry point for DLPack capsules (private: without it, nanobind calls tensor.__dlpack__).
_to_dlpack = getattr(getattr(_torch, "_C", None), "_to_dlpack", None)


def _is_torch(x) -> bool:
    return _torch is not None and isinstance(x, _torch.Tensor)


def _plain(x):
    """What crosses into C++ for one array: a torch tensor as a DLPack capsule made by torch's C
    entry point (not the Python __dlpack__ wrapper: a few microseconds less per tensor), its FP8
    storage viewed as uint8 first (DLPack has no FP8 code everywhere); anything else unchanged
    (nanobind takes NumPy arrays and other DLPack producers as they are)."""
    if not _is_torch(x):
        return x
    if x.dtype == _torch.float8_e4m3fn:
        x = x.view(_torch.uint8)
    return _to_dlpack(x) if _to_dlpack is not None else x


def _stream(x, stream) -> int:
    """The stream a call on `x`'s device runs on: `stream` when given (an int, or an object with
    .cuda_stream / .ptr), else torch's current stream of x's device, else 0 (the default stream)."""
    if stream is not None:
        for attr in ("cuda_stream", "ptr"):
            if hasattr(stream, attr):
                return int(getattr(stream, attr))
        return int(stream)
    if _is_torch(x) and x.is_cuda:
        return _torch._C._cuda_getCurrentRawStream(x.device.index)
    return 0


def batched_experts(a1q, a1q_scale, expert_num_tokens, w1, w1_scale, w2, w2_scale, out, activation: str = "silu",
                    quant: Optional[str] = None, stream: Any = None, fuse_w1: Optional[bool] = None,
                    max_rows: int = 0, swiglu_limit: float = 7.0, accumulation: str = "precise"):
    """The experts in the BatchedExperts convention (module docstring); returns `out`."""
    _moekit.batched_experts(_plain(a1q), _plain(a1q_scale), _plain(expert_num_tokens), _plain(w1), _plain(w1_scale),
                            _plain(w2), _plain(w2_scale), _plain(out), activation, quant or "", fuse_w1, _THREADS,
                            _stream(a1q, stream), int(max_rows), float(swiglu_limit), accumulation)
    return out


def standard_experts(a1q, a1q_scale, topk_ids, topk_weights, w1, w1_scale, w2, w2_scale, out,
                     activation: str = "silu", quant: Optional[str] = None, stream: Any = None,
                     fuse_w1: Optional[bool] = None, swiglu_limit: float = 7.0, accumulation: str = "precise"):
    """The experts in the standard convention with the top-k weighted sum (module docstring);
    returns `out`."""
    _moekit.standard_experts(_plain(a1q), _plain(a1q_scale), _plain(topk_ids), _plain(topk_weights), _plain(w1),
                             _plain(w1_scale), _plain(w2), _plain(w2_scale), _plain(out), activation, quant or "",
                             fuse_w1, _THREADS, _stream(a1q, stream), float(swiglu_limit), accumulation)
    return out


def check_status(stream: Any = None) -> None:
    """Raises moekit.Error for the first flags each GPU workspace kept since the last check (a count
    outside [0, M], an expert id outside [-1, E_local)), and clears them. Synchronizes `stream`
    (default: each workspace's last stream)."""
    _moekit.ops_check_status(_stream(None, stream))


def workspace_bytes() -> int:
    """Bytes the ops' workspaces hold, over every shape and device called so far."""
    return _moekit.ops_workspace_bytes()


torch_op_error = None  # why torch.ops.moekit.* is missing, when it is

# The torch ops: defined with torch.library.Library and one CompositeExplicitAutograd kernel each
# (CPU and CUDA tensors alike), fake kernels for torch.compile. Lighter per call than
# torch.library.custom_op's Python wrapper.
_BATCHED = ("batched_experts(Tensor a1q, Tensor a1q_scale, Tensor expert_num_tokens, Tensor w1, Tensor w1_scale, "
            "Tensor w2, Tensor w2_scale, Tensor(a!) out, str activation='silu', str? quant=None, bool? fuse_w1=None, "
            "int max_rows=0, float swiglu_limit=7.0, str accumulation='precise') -> ()")
_STANDARD = ("standard_experts(Tensor a1q, Tensor a1q_scale, Tensor topk_ids, Tensor topk_weights, Tensor w1, "
             "Tensor w1_scale, Tensor w2, Tensor w2_scale, Tensor(a!) out, str activation='silu', "
             "str? quant=None, bool? fuse_w1=None, float swiglu_limit=7.0, str accumulation='precise') -> ()")
if _torch is None:
    torch_op_error = "torch is not installed"
else:
    try:
        _lib = _torch.library.Library("moekit", "DEF")
        _lib.define(_BATCHED)
        _lib.define(_STANDARD)

        def _batched_kernel(a1q, a1q_scale, expert_num_tokens, w1, w1_scale, w2, w2_scale, out, activation="silu",
                            quant=None, fuse_w1=None, max_rows=0, swiglu_limit=7.0, accumulation="precise"):
            batched_experts(a1q, a1q_scale, expert_num_tokens, w1, w1_scale, w2, w2_scale, out, activation, quant,
                            fuse_w1=fuse_w1, max_rows=max_rows, swiglu_limit=swiglu_limit, accumulation=accumulation)

        def _standard_kernel(a1q, a1q_scale, topk_ids, topk_weights, w1, w1_scale, w2, w2_scale, out,
                             activation="silu", quant=None, fuse_w1=None, swiglu_limit=7.0, accumulation="precise"):
            standard_experts(a1q, a1q_scale, topk_ids, topk_weights, w1, w1_scale, w2, w2_scale, out, activation,
                             quant, fuse_w1=fuse_w1, swiglu_limit=swiglu_limit, accumulation=accumulation)

        _lib.impl("batched_experts", _batched_kernel, "CompositeExplicitAutograd")
        _lib.impl("standard_experts", _standard_kernel, "CompositeExplicitAutograd")

        @_torch.library.register_fake("moekit::batched_experts")
        def _(a1q, a1q_scale, expert_num_tokens, w1, w1_scale, w2, w2_scale, out, activation="silu", quant=None,
              fuse_w1=None, max_rows=0, swiglu_limit=7.0, accumulation="precise"):
            return None

        @_torch.library.register_fake("moekit::standard_experts")
        def _(a1q, a1q_scale, topk_ids, topk_weights, w1, w1_scale, w2, w2_scale, out, activation="silu",
              quant=None, fuse_w1=None, swiglu_limit=7.0, accumulation="precise"):
            return None
    except Exception as e:  # an older torch: the NumPy / tensor path still works
        torch_op_error = f"{type(e).__name__}: {e}"
