"""Low-level ops in the conventions an inference engine's fused-MoE path already uses.

batched_experts(a1q, a1q_scale, expert_num_tokens, w1, w1_scale, w2, w2_scale, out, activation="silu")
    The experts alone in the BatchedExperts convention (DeepEP low-latency / pplx dispatch output):
      a1q (E_local, M, K) FP8 e4m3 (uint8 codes, or torch.float8_e4m3fn), rows >= expert_num_tokens[e]
      of expert e are padding: never read into a result, never written
      a1q_scale float32: (E_local,) per-tensor, (E_local, M) per-token, (E_local, M, ceil(K/128)) 1x128
      expert_num_tokens (E_local,) int32
      w1 (E_local, N, K), w2 (E_local, K, I) FP8 with float32 scales in the matching scheme
      out (E_local, M, K) bfloat16 (or its uint16 bits), written for the valid rows only
    W1 -> activation -> FP8 -> W2, fp32 accumulation. On the CPU today (NumPy arrays or CPU torch
    tensors, zero copy); the workspace is built once per shape and reused.
    With torch installed it is also torch.ops.moekit.batched_experts (torch.library.custom_op,
    mutating `out`), so torch.compile traces it without a graph break.
"""
from __future__ import annotations

import os

from . import _moekit

__all__ = ["batched_experts"]

_THREADS = max(1, (os.cpu_count() or 1))


def _plain(x):
    """A torch tensor's FP8 / bfloat16 storage as the same bytes in uint8 / uint16 (DLPack has no
    FP8 code everywhere); anything else unchanged."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or not hasattr(x, "view") or type(x).__module__.split(".")[0] != "torch":
        return x
    import torch

    if dtype in (torch.float8_e4m3fn,):
        return x.view(torch.uint8)
    if dtype == torch.bfloat16:
        return x.view(torch.int16)
    return x


def batched_experts(a1q, a1q_scale, expert_num_tokens, w1, w1_scale, w2, w2_scale, out, activation: str = "silu"):
    _moekit.batched_experts(_plain(a1q), _plain(a1q_scale), _plain(expert_num_tokens), _plain(w1), _plain(w1_scale),
                            _plain(w2), _plain(w2_scale), _plain(out), activation, _THREADS)
    return out


torch_op_error = None  # why torch.ops.moekit.batched_experts is missing, when it is

try:  # the torch custom op, when torch is present
    import torch

    @torch.library.custom_op("moekit::batched_experts", mutates_args=("out",))
    def _batched_experts_op(a1q: torch.Tensor, a1q_scale: torch.Tensor, expert_num_tokens: torch.Tensor,
                            w1: torch.Tensor, w1_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                            out: torch.Tensor, activation: str = "silu") -> None:
        batched_experts(a1q, a1q_scale, expert_num_tokens, w1, w1_scale, w2, w2_scale, out, activation)

    @_batched_experts_op.register_fake
    def _(a1q, a1q_scale, expert_num_tokens, w1, w1_scale, w2, w2_scale, out, activation="silu"):
        return None
except ImportError:  # NumPy only
    torch_op_error = "torch is not installed"
except Exception as e:  # a torch without torch.library.custom_op: the NumPy path still works
    torch_op_error = f"{type(e).__name__}: {e}"
