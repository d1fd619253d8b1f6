"""moekit: the Mixture-of-Experts layer of expert-parallel LLM inference, from Python.

    import moekit
    for p in moekit.plan("deepseek-v3", dp=32, ep=32, max_tokens_per_rank=256, local_experts=16):
        print(p.name, p.workspace_bytes, p.total_bytes)

    w = moekit.synthetic_inputs("qwen3-30b-a3b", tokens=8)          # seeded, as `moekit run` draws
    layer = moekit.MoeLayer("qwen3-30b-a3b", weights=w, max_tokens_per_rank=8)
    out = layer.forward(w["hidden"], w["router_logits"])           # (8, K) bfloat16 bits (uint16)

What runs today: the plan (every device's declarations, the same figures as `moekit plan --format
json`), the layer on the CPU over NumPy arrays (or anything DLPack hands over on the CPU), zero
copy, one rank holding every expert, and moekit.ops.batched_experts (the experts alone in the
BatchedExperts convention; torch.ops.moekit.batched_experts when torch is present). Arrays are validated where they enter (dtype, shape,
C-contiguity); anything wrong raises moekit.Error with the C++ message: the value, the limit, the
fix. Not yet: CUDA tensors, expert parallelism from Python.

Weights (one rank's E_local experts, FP8 e4m3 codes as uint8 with float32 scales, docs/DESIGN.md):
  w1 (E_local, N, K): gate rows [0, I) then up rows [I, 2I) (interleaved pairs for swigluoai)
  w2 (E_local, K, I)
  w1_scale (E_local, s1), w2_scale (E_local, s2): per-channel (s = output rows), per-tensor (1) or
  128x128 blocks (row-major over blocks), by `quant`
  e_score_correction_bias (E,) float32 for models that route with it (DeepSeek-V3, Kimi-K2)
Activations: hidden (T, K) bfloat16 (or its uint16 bits), router_logits (T, E) float32.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ._moekit import Error  # noqa: F401  (re-exported: every failure raises it)
from . import _moekit
from . import ops  # noqa: F401  (moekit.ops.batched_experts; torch.ops.moekit.* when torch is present)

__all__ = ["Error", "Region", "Section", "Plan", "plan", "MoeLayer", "synthetic_inputs", "ops"]


@dataclasses.dataclass(frozen=True)
class Region:
    """One named buffer of a plan: where it lives in the one allocation, and why it has its shape."""

    name: str
    section: str
    dtype: str
    shape: tuple
    bytes: int
    offset: int
    live: tuple
    alias_group: str
    persistent: bool
    what: str


@dataclasses.dataclass(frozen=True)
class Section:
    """The regions one seam declared: experts, prepare-finalize, routing."""

    name: str
    owner: str
    offset: int
    bytes: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one GPU (or CPU rank) allocates with one experts implementation, or an upstream
    reference formula (reference=True, never allocated). workspace_bytes is the experts' section,
    total_bytes the one allocation with the buffers; runs=False when it cannot run the problem."""

    name: str
    format: str
    reference: bool
    runs: bool
    note: str
    config: str
    M: int
    N: int
    K: int
    I: int
    topk: int
    E: int
    E_local: int
    num_dispatchers: int
    activation: str
    quant: str
    total_bytes: int
    workspace_bytes: int
    buffer_bytes: int
    expert_weight_bytes: int
    sections: tuple
    regions: tuple

    def region(self, name: str) -> Region:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(f"{self.name} has no region {name!r}")


def plan(model: str = "deepseek-v3", dp: int = 32, ep: int = 32, max_tokens_per_rank: int = 256,
         local_experts: int = 0, device: str = "cuda", quant: str = "auto",
         activation: Optional[str] = None, experts: Sequence[str] = (),
         dispatch: Optional[str] = None) -> list[Plan]:
    """The plans of every experts implementation on `device` (and the upstream references), the
    same figures as `moekit plan --format json` with the same arguments (quant="auto": the model's
    checkpoint scheme)."""
    text = _moekit.plan_json(model, dp, ep, max_tokens_per_rank, local_experts, device, quant, activation or "",
                             list(experts), dispatch or "")
    out = []
    for p in json.loads(text)["plans"]:
        regions = tuple(Region(r["name"], r["section"], r["dtype"], tuple(r["shape"]), r["bytes"], r["offset"],
                               tuple(r["live"]), r["alias_group"], r["persistent"], r["what"])
                        for r in p["regions"])
        sections = tuple(Section(s["name"], s["owner"], s["offset"], s["bytes"]) for s in p["sections"])
        fields = {f.name for f in dataclasses.fields(Plan)} - {"sections", "regions"}
        out.append(Plan(sections=sections, regions=regions, **{k: p[k] for k in fields}))
    return out


def synthetic_inputs(model: str, tokens: int, max_tokens_per_rank: Optional[int] = None,
                     quant: str = "auto", seed: int = 1) -> dict[str, np.ndarray]:
    """Seeded weights (every expert) and tokens, the values `moekit run --dp 1 --seed` draws."""
    return dict(_moekit.synthetic(model, tokens, max_tokens_per_rank or max(tokens, 1), quant, seed))


class MoeLayer:
    """The MoE layer of one rank holding every expert (dp = ep = 1), on the CPU.

    MoeLayer(model, weights, max_tokens_per_rank, quant="auto", experts="batched-fp8",
             activation=None, num_threads=1)
      model: a preset name (deepseek-v3, qwen3-30b-a3b, ...) or a config.json path
      weights: a mapping with w1, w1_scale, w2, w2_scale (and e_score_correction_bias when the
               model routes with it), arrays in the layouts of the module docstring; kept
               referenced, never copied
      quant: "auto" (the model's quantization_config: block128 for DeepSeek-V3 / Kimi-K2, per-token
             for unquantized checkpoints), "per-token", "per-tensor" or "block128"
    The workspace is allocated once, at construction (workspace_bytes); forward() chunks steps
    over max_tokens_per_rank.
    """

    def __init__(self, model: str, weights: Mapping[str, Any], max_tokens_per_rank: int,
                 quant: str = "auto", experts: str = "batched-fp8", activation: Optional[str] = None,
                 num_threads: int = 1):
        self._weights = {k: weights[k] for k in ("w1", "w1_scale", "w2", "w2_scale", "e_score_correction_bias")
                         if k in weights}
        w = self._weights
        self._layer = _moekit.Layer(model, max_tokens_per_rank, quant, experts, activation, w["w1"], w["w1_scale"],
                                    w["w2"], w["w2_scale"], w.get("e_score_correction_bias"), num_threads)

    @property
    def workspace_bytes(self) -> int:
        """The layer's one allocation, equal to the plan's total."""
        return self._layer.workspace_bytes

    @property
    def problem(self) -> str:
        return self._layer.problem

    def forward(self, hidden, router_logits, out=None):
        """hidden (T, K) bfloat16 bits, router_logits (T, E) float32 -> (T, K) bfloat16 bits.
        `out` (optional) receives the result in place."""
        if out is None:
            out = np.empty((len(hidden), self._layer.K), dtype=np.uint16)
        self._layer.forward(hidden, router_logits, out)
        return out
