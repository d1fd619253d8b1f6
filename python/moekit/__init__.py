"""moekit: the Mixture-of-Experts layer of expert-parallel LLM inference, from Python.

    import moekit, torch
    for p in moekit.plan("deepseek-v3", dp=32, ep=32, max_tokens_per_rank=256, local_experts=16):
        print(p.name, p.workspace_bytes, p.total_bytes)

    w = moekit.synthetic_inputs("deepseek-v3", tokens=128, num_experts=32, device="cuda")  # seeded
    layer = moekit.MoeLayer("deepseek-v3", weights=w, max_tokens_per_rank=128, num_experts=32)
    out = layer(w["hidden"], w["router_logits"])  # (128, 7168) torch.bfloat16 on the GPU

What runs: the plan (every device's declarations, the same figures as `moekit plan --format json`);
the layer on the CPU (NumPy arrays or CPU tensors) or a GPU (CUDA tensors, on torch's current
stream), zero copy by DLPack; expert parallelism over a torch.distributed group (one process per
GPU, NCCL between them; or CPU ranks); and moekit.ops.batched_experts / standard_experts, the
experts alone in the conventions engines use (torch.ops.moekit.* when torch is present, for
torch.compile and CUDA graphs). Arrays are validated where they enter (dtype, shape, device,
C-contiguity); anything wrong raises moekit.Error with the C++ message: the value, the limit, the
fix.

Weights (one rank's E_local experts, FP8 e4m3 codes as uint8 with float32 scales, docs/DESIGN.md),
as checkpoints store them:
  w1 (E_local, N, K): gate rows [0, I) then up rows [I, 2I) (gate_proj and up_proj stacked, or
      transformers' gate_up_proj; interleaved pairs for swigluoai, gpt-oss's order); under block128
      MoeLayer arranges them into the block pairs its recipe reads, once, into its own copy
      (w1_layout="block_pairs" takes an arranged W1 as it is: moekit.arrange_w1_block_pairs)
  w2 (E_local, K, I): down_proj
  w1_scale, w2_scale: per expert, per-channel (one per output row), per-tensor (1) or 128x128 blocks
      (row-major over blocks, the checkpoint's weight_scale_inv), by `quant`; any shape with E_local
      first and those values after it: (E_local, s), (E_local, N / 128, K / 128), (E_local, N, 1), ...
  e_score_correction_bias (E,) float32 for models that route with it (DeepSeek-V3, Kimi-K2, GLM)
  w1_bias (E_local, N), w2_bias (E_local, K) float32 for models whose experts have biases (gpt-oss:
      gate_up_proj_bias, down_proj_bias), W1's in the row order of w1
  shared_w1, shared_w1_scale, shared_w2, shared_w2_scale for models with shared experts (DeepSeek,
      GLM, Qwen2-MoE): one expert of N = 2 * shared_intermediate_size in the layouts above, (1, N, K)
      or (N, K) and so on; every rank holds all of it
  shared_expert_gate (K,) or (1, K) bfloat16 for Qwen2-MoE: its shared output times
      sigmoid(hidden . gate)
Any other key, or one the model does not have, raises moekit.Error.
Activations: hidden (T, K) bfloat16 (or its uint16 bits), router_logits (T, E) float32 (torch
bfloat16 / float16 logits are converted: a float32 copy per call).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, List, Mapping, Optional, Sequence

import numpy as np

from . import _build, _cpu, _torch

_cpu.check(_build.CPU_ARCH)  # before the native module: a clear error, never SIGILL
_torch.import_torch()  # before the native module too: torch's libnccl.so.2 is the process's (_torch.py)

from ._moekit import Error  # noqa: F401  (re-exported: every failure raises it)
from . import _moekit
from . import ops  # noqa: F401  (moekit.ops.batched_experts; torch.ops.moekit.* when torch is present)

__all__ = ["Error", "Region", "Section", "Plan", "plan", "MoeLayer", "Runtime", "Checkpoint", "LoadedLayer",
           "TorchGroup", "synthetic_inputs", "ops", "arrange_w1_block_pairs", "workspace_allocations", "recipes"]


def recipes() -> List[dict]:
    """The quantization recipes moekit runs, one dict a row of its recipe table (moekit/recipe.h): the
    name that `quant=` takes, the operand dtypes ("fp8_e4m3", ...), the activation scales
    ("per-tensor", "per-row", "1x128"), the weight scales ("per-tensor", "per-output-channel",
    "128x128"), the intermediate W1 output's dtype and whether the activation is quantized again,
    needs_block_multiple (K and I multiples of 128), fused_w1, fast_accumulation, and the relative
    tolerance of a GPU against the CPU on the same inputs (device_vs_cpu_tolerance)."""
    return [dict(r) for r in _moekit.recipes()]


def workspace_allocations() -> int:
    """Workspaces that made their own allocation in this process so far: one per Runtime (and per
    MoeLayer), whatever its number of layers."""
    return _moekit.workspace_allocations()


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


def rebalance_experts(load: Sequence[float], num_physical: int, num_groups: int = 1, num_nodes: int = 1,
                      num_ranks: int = 1) -> List[int]:
    """DeepSeek's EPLB: each logical expert's load (e.g. the sum over ranks and over its slots of
    Runtime.expert_load) -> a slot -> expert map of num_physical slots over num_ranks ranks (hot
    experts replicated, ranks balanced; hierarchical over nodes when the router's num_groups divide
    over num_nodes)."""
    return _moekit.rebalance_experts([float(x) for x in load], int(num_physical), int(num_groups), int(num_nodes),
                                     int(num_ranks))


def round_robin_placement(num_logical: int, num_physical: int) -> List[int]:
    """The default placement: slot p holds expert p mod num_logical."""
    return _moekit.round_robin_placement(int(num_logical), int(num_physical))


def plan(model: str = "deepseek-v3", dp: int = 32, ep: int = 32, max_tokens_per_rank: int = 256,
         local_experts: int = 0, device: str = "cuda", quant: str = "auto",
         activation: Optional[str] = None, experts: Sequence[str] = (),
         dispatch: Optional[str] = None, fuse_w1: Optional[bool] = None,
         accumulation: str = "precise") -> list[Plan]:
    """The plans of every experts implementation on `device` (and the upstream references), the
    same figures as `moekit plan --format json` with the same arguments (quant="auto": the model's
    checkpoint scheme; fuse_w1: None fuses W1 where it runs, False / True as --no-fuse-w1 /
    --fuse-w1; accumulation as --accumulation)."""
    text = _moekit.plan_json(model, dp, ep, max_tokens_per_rank, local_experts, device, quant, activation or "",
                             list(experts), dispatch or "", fuse_w1, accumulation)
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
                     quant: str = "auto", seed: int = 1, rank: int = 0, ranks: int = 1, num_experts: int = 0,
                     device: str = "cpu", num_threads: Optional[int] = None) -> dict[str, Any]:
    """Seeded weights and tokens, the values `moekit run --dp ranks --seed seed` draws for rank
    `rank`: its E / ranks experts (w1, w1_scale, w2, w2_scale, e_score_correction_bias when the model
    routes with it, w1_bias / w2_bias, the shared experts' shared_* when it has them) and its
    `tokens` tokens (hidden, router_logits). W1 as a checkpoint stores it (gate rows then up rows),
    what MoeLayer takes; moekit.ops read block128's W1 in block pairs (moekit.arrange_w1_block_pairs).
    NumPy arrays; device="cuda": torch tensors on the current GPU. num_experts > 0 overrides the
    model's routed experts (shorter runs of the same shapes, as the CLI's --num-experts)."""
    d = dict(_moekit.synthetic(model, num_experts, tokens, max_tokens_per_rank or max(tokens, 1), quant, seed, rank,
                               ranks, num_threads or ops._THREADS))
    if device == "cpu":
        return d
    if device != "cuda":
        raise Error(f"device = {device!r}: synthetic_inputs makes 'cpu' (NumPy) or 'cuda' (torch) arrays")
    if quant == "auto":  # the recipe "auto" resolves to for this model (its 16-bit weights' torch dtype)
        quant = plan(model, dp=1, ep=1, max_tokens_per_rank=1, device="cpu")[0].quant
    return _to_torch(d, "cuda", quant)


# The weight keys that hold FP8 e4m3 codes (uint8 on the host).
_FP8_KEYS = ("w1", "w2", "shared_w1", "shared_w2")


def _to_torch(arrays: dict, device: str, quant: str = "") -> dict:
    """Host arrays (NumPy, as the native module returns them) as torch tensors on `device`, in the dtypes
    the layer reads there: FP8 codes as float8_e4m3fn, 16-bit bits (uint16) as bfloat16 (float16: the
    fp16 recipe's weights), the rest as they are. Each host array is dropped from `arrays` once its copy
    is made, so a layer's host memory goes as its device copies come (peak: one layer and one array)."""
    import torch

    sixteen = torch.float16 if quant == "fp16" else torch.bfloat16
    out = {}
    for k in list(arrays):
        v = arrays.pop(k)
        t = torch.from_numpy(v.view(np.int16) if v.dtype == np.uint16 else v)
        t = t.view(sixteen if k in _FP8_KEYS else torch.bfloat16) if v.dtype == np.uint16 else t
        # FP8 codes (uint8) only: the 16-bit recipes' w1 / w2 are uint16 bits, viewed above.
        t = t.view(torch.float8_e4m3fn) if k in _FP8_KEYS and v.dtype == np.uint8 else t
        out[k] = t.to(device)
        del v, t
    return out


def arrange_w1_block_pairs(w1, w1_scale):
    """W1 from a checkpoint's halves layout to the block-pairs layout block128 reads.

    A checkpoint stores W1 as gate rows then up rows (HF's gate_proj and up_proj stacked: (E, 2I, K)
    FP8 codes, (E, 2I/128 * ceil(K/128)) or (E, 2I/128, ceil(K/128)) float32 block scales, as the ops
    take them; the scales come back in the shape given). Under block128 moekit reads, per 256
    rows, gate block b then up block b, so that one W1 tile holds a whole 1x128 output group and
    the activation and its quantization run in the W1 GEMM's epilogue (silu, gelu, gelu_tanh; the
    other activations keep their layout). Codes and scales are moved, never re-rounded. Returns new
    host arrays (NumPy for NumPy input, CPU tensors for torch input); call it once at load.
    """
    is_torch = not isinstance(w1, np.ndarray) and hasattr(w1, "numpy")
    if is_torch:
        import torch
        codes = w1.detach().cpu().contiguous().view(torch.uint8).numpy()
        scales = w1_scale.detach().cpu().contiguous().numpy()
    else:
        codes, scales = np.ascontiguousarray(w1), np.ascontiguousarray(w1_scale)
    given_shape = scales.shape
    if scales.ndim == 3:  # (E, 2I/128, ceil(K/128)): a checkpoint's weight_scale_inv per expert, stacked
        want = (codes.shape[1] // 128, -(-codes.shape[2] // 128)) if codes.ndim == 3 else None
        if want is None or scales.shape[0] != codes.shape[0] or scales.shape[1:] != want:
            raise Error(f"w1_scale: shape {tuple(scales.shape)} where (E, 2I/128, ceil(K/128)) = "
                        f"({codes.shape[0] if codes.ndim else '?'}, {want[0] if want else '?'}, "
                        f"{want[1] if want else '?'}) or its 2-D (E, 2I/128 * ceil(K/128)) is needed")
        scales = scales.reshape(scales.shape[0], -1)
    out, out_scale = np.empty_like(codes), np.empty_like(scales)
    _moekit.arrange_w1_block_pairs(codes, scales, out, out_scale)
    out_scale = out_scale.reshape(given_shape)
    if is_torch:
        return torch.from_numpy(out).view(w1.dtype), torch.from_numpy(out_scale)
    return out, out_scale


class TorchGroup:
    """The ranks of a torch.distributed process group, as moekit's layer talks to them: rank(),
    size() and all_gather(bytes). Its collectives carry only set-up and one small exchange per
    forward (NCCL moves the tokens between GPUs); they run over a gloo group of the same ranks,
    created here (collective: every rank builds its TorchGroup, as it builds its layer), whose
    collectives give up after `timeout_s` (a dead or stuck peer raises moekit.Error, never hangs)."""

    def __init__(self, group=None, timeout_s: float = 120.0):
        import datetime

        import torch.distributed as dist

        if not dist.is_initialized():
            raise Error("torch.distributed is not initialized: call torch.distributed.init_process_group() first "
                        "(torchrun sets the environment it needs)")
        group = group if group is not None else dist.group.WORLD
        self._dist = dist
        self._group = dist.new_group(ranks=dist.get_process_group_ranks(group), backend="gloo",
                                     timeout=datetime.timedelta(seconds=timeout_s), use_local_synchronization=True)

    _of: dict = {}

    @classmethod
    def of(cls, group) -> "TorchGroup":
        """One TorchGroup per process group (the layers of a model share its gloo group)."""
        key = id(group)
        if key not in cls._of:
            cls._of[key] = (group, cls(group))  # the group is kept: its id is not reused
        return cls._of[key][1]

    def rank(self) -> int:
        return self._dist.get_rank(self._group)

    def size(self) -> int:
        return self._dist.get_world_size(self._group)

    def all_gather(self, data: bytes) -> list:
        out = [None] * self.size()
        self._dist.all_gather_object(out, data, group=self._group)
        return out


_WEIGHT_KEYS = ("w1", "w1_scale", "w2", "w2_scale", "e_score_correction_bias", "w1_bias", "w2_bias", "shared_w1",
                "shared_w1_scale", "shared_w2", "shared_w2_scale", "shared_expert_gate")
# synthetic_inputs returns the tokens beside the weights; MoeLayer(weights=that dict) skips them.
_INPUT_KEYS = ("hidden", "router_logits")


def _logits(x):
    """Router logits as the layer reads them: float32; a torch gate's bfloat16 / float16 output
    converted (a copy)."""
    if ops._is_torch(x) and x.dtype in (ops._torch.bfloat16, ops._torch.float16):
        return x.float()
    return x


def _device_of(x) -> str:
    return "cuda" if ops._is_torch(x) and x.is_cuda else "cpu"


def _layer_arrays(weights: Mapping[str, Any]) -> dict:
    """The weight arrays of one layer, in the shapes the C++ side reads (views, never copies)."""
    unknown = sorted(set(weights) - set(_WEIGHT_KEYS) - set(_INPUT_KEYS))
    if unknown:
        raise Error(f"unknown weight keys {unknown}: MoeLayer takes {list(_WEIGHT_KEYS)} (the module docstring "
                    "gives each one's layout); a weight it would not read changes nothing, so it is refused")
    held = {k: weights[k] for k in _WEIGHT_KEYS if k in weights}
    for k in ("shared_w1", "shared_w2"):
        v = held.get(k)
        if v is not None and len(v.shape) == 2:
            held[k] = v[None]  # one expert: its (N, K) checkpoint shape as (1, N, K), a view
    for k in ("w1_scale", "w2_scale", "shared_w1_scale", "shared_w2_scale"):
        v = held.get(k)
        count = 1 if k.startswith("shared_") else (v.shape[0] if v is not None and len(v.shape) else 0)
        if v is not None and count and (len(v.shape) != 2 or v.shape[0] != count):
            # the checkpoint's (E, N / 128, K / 128) blocks, (E, N, 1) channels, ...: the same
            # values per expert, read as (E, s) (a view of a contiguous array)
            held[k] = v.reshape(count, -1)
    gate = held.get("shared_expert_gate")
    if gate is not None and len(gate.shape) == 2:
        held["shared_expert_gate"] = gate.reshape(-1)  # nn.Linear's (1, K), a view
    return held


class Runtime:
    """One runtime per rank for all of a model's MoE layers: one workspace (the plan's figure, once,
    whatever the number of layers), one dispatch (and NCCL communicator), one set of status words.
    A layer is a weight set added with add_layer(); every layer has the runtime's problem.

    Runtime(model, max_tokens_per_rank, quant="auto", experts="batched-fp8", activation=None,
            num_threads=1, device="cpu", group=None, dispatch=None, num_experts=0, fuse_w1=None,
            shared_experts=True, accumulation="precise", local_experts=0)
      the arguments of MoeLayer (but the weights); device: "cpu" or "cuda" (the current GPU);
      local_experts: expert slots per rank (0: E / ranks; more: redundant experts, EPLB)
    add_layer(weights, w1_layout="gate_up", placement=None) -> int: one layer's weights (MoeLayer's
      mapping, or a LoadedLayer from Checkpoint.load_layer), kept referenced, never copied (but W1
      arranged under block128); returns the layer's index, 0, 1, ... With redundant experts the
      weights hold this rank's slots and `placement` maps every slot of all ranks to its expert
      (default: slot p holds expert p mod E); see rebalance_experts.
    placement(layer), expert_load(layer): the slot -> expert map, and this rank's pairs per slot
      since the last read (summed over ranks, the load rebalance_experts takes).
    forward(layer, hidden, router_logits, out=None, stream=None), enqueue(layer, ...), check_status():
      MoeLayer's, for one registered layer. A CUDA graph may capture steps of several layers.
    """

    def __init__(self, model: str, max_tokens_per_rank: int, quant: str = "auto", experts: str = "batched-fp8",
                 activation: Optional[str] = None, num_threads: int = 1, device: str = "cpu", group: Any = None,
                 dispatch: Optional[str] = None, num_experts: int = 0, fuse_w1: Optional[bool] = None,
                 shared_experts: bool = True, accumulation: str = "precise", local_experts: int = 0):
        if group is not None and not hasattr(group, "all_gather"):
            group = TorchGroup.of(group)  # a torch.distributed process group
        self._group = group
        self._held = []  # per layer: the arrays the runtime reads
        self._rt = _moekit.Runtime(model, num_experts, max_tokens_per_rank, quant, experts, activation, device,
                                   dispatch or "", shared_experts, num_threads, fuse_w1, accumulation, group,
                                   int(local_experts))

    def add_layer(self, weights: Any, w1_layout: str = "gate_up", placement: Optional[Sequence[int]] = None) -> int:
        if isinstance(weights, LoadedLayer):
            on_host = isinstance(weights.weights.get("w1"), np.ndarray)
            if on_host and self.device.startswith("cuda"):
                raise Error(f"layer {weights.layer}: its weights are host arrays and this runtime runs on "
                            f"{self.device}: load it there, Checkpoint.load_layer({weights.layer}, "
                            f"device={self.device!r})")
            weights = weights.weights
        held = _layer_arrays(weights)
        w = {k: ops._plain(v) for k, v in held.items()}
        index = self._rt.add_layer(w["w1"], w["w1_scale"], w["w2"], w["w2_scale"], w.get("e_score_correction_bias"),
                                   w.get("w1_bias"), w.get("w2_bias"), w.get("shared_w1"), w.get("shared_w1_scale"),
                                   w.get("shared_w2"), w.get("shared_w2_scale"), w.get("shared_expert_gate"),
                                   w1_layout, None if placement is None else [int(e) for e in placement])
        if self._rt.owns_w1(index):  # arranged into the runtime's own copy: the caller's arrays may go
            for k in ("w1", "w1_scale", "shared_w1", "shared_w1_scale"):
                held.pop(k, None)
        self._held.append(held)
        return index

    def placement(self, layer: int) -> Optional[List[int]]:
        """Layer `layer`'s slot -> expert map (all ranks' slots), None when it has no placement."""
        return self._rt.placement(int(layer))

    def expert_load(self, layer: int, stream=None) -> np.ndarray:
        """This rank's (token, expert) pairs sent to each slot of layer `layer` since it was added or
        last read (reading clears them), int64 (slots,). Summed over the ranks and fed to
        rebalance_experts (with each expert's load the sum of its slots') they give a new placement."""
        if stream is None and self.device.startswith("cuda"):
            import torch

            stream = torch.cuda.current_stream(torch.device(self.device)).cuda_stream
        return np.asarray(self._rt.expert_load(int(layer), ops._stream(None, stream)), dtype=np.int64)

    @property
    def num_layers(self) -> int:
        return self._rt.num_layers

    @property
    def workspace_bytes(self) -> int:
        """The runtime's one allocation, equal to the plan's total, whatever the number of layers."""
        return self._rt.workspace_bytes

    @property
    def problem(self) -> str:
        return self._rt.problem

    @property
    def device(self) -> str:
        """Where the runtime runs: "cpu" or "cuda:N"."""
        return self._rt.device

    @property
    def rank(self) -> int:
        return self._rt.rank

    @property
    def ranks(self) -> int:
        return self._rt.ranks

    @property
    def dispatch(self) -> str:
        """The prepare/finalize the runtime runs (e.g. "nccl (cuda)")."""
        return self._rt.dispatch

    def _out(self, hidden, out):
        if out is not None:
            return out
        if ops._is_torch(hidden):
            import torch

            return torch.empty((hidden.shape[0], self._rt.K), dtype=hidden.dtype, device=hidden.device)
        return np.empty((len(hidden), self._rt.K), dtype=np.uint16)

    def forward(self, layer: int, hidden, router_logits, out=None, stream=None):
        """Layer `layer` of hidden (T, K) bfloat16 (or its uint16 bits) with router_logits (T, E)
        float32 -> (T, K), as MoeLayer.forward."""
        out = self._out(hidden, out)
        self._rt.forward(int(layer), ops._plain(hidden), ops._plain(_logits(router_logits)), ops._plain(out),
                         ops._stream(hidden, stream))
        return out

    def enqueue(self, layer: int, hidden, router_logits, out, stream=None, max_tokens_any_rank=0):
        """One step of layer `layer`, as MoeLayer.enqueue (capturable in a CUDA graph)."""
        self._rt.enqueue(int(layer), ops._plain(hidden), ops._plain(_logits(router_logits)), ops._plain(out),
                         ops._stream(hidden, stream), int(max_tokens_any_rank))
        return out

    def check_status(self, stream=None):
        """Synchronizes the stream and raises moekit.Error for the first thing any layer's step flagged
        since the last check (a NaN logit, a count over capacity, a peer that timed out), and clears it."""
        if stream is None and self.device.startswith("cuda"):
            import torch

            stream = torch.cuda.current_stream(torch.device(self.device)).cuda_stream
        self._rt.check_status(ops._stream(None, stream))


@dataclasses.dataclass
class LoadedLayer:
    """One MoE layer of a checkpoint for one rank (Checkpoint.load_layer): `weights` in MoeLayer's
    keys and layouts (W1 in gate-then-up order), the router's linear layer, and what loading did."""
    layer: int
    weights: dict
    router_weight: Any  # (E, K) float32: NumPy, or a torch tensor on the device it was loaded onto
    router_bias: Any  # (E,) float32 (gpt-oss) or None
    quant: str
    note: str

    def router_logits(self, hidden):
        """(T, E) float32 logits of bf16 hidden rows (T, K): hidden . router_weight^T (+ router_bias),
        in float32; a torch tensor on hidden's device for a torch tensor, else NumPy (uint16 bits in)."""
        if ops._is_torch(hidden):
            import torch

            def on(x):  # the router's arrays where hidden is (a layer loaded there already has them there)
                return (x if ops._is_torch(x) else torch.from_numpy(x)).to(hidden.device)

            out = hidden.float() @ on(self.router_weight).T
            if self.router_bias is not None:
                out = out + on(self.router_bias)
            return out.contiguous()
        if ops._is_torch(self.router_weight):
            raise Error(f"layer {self.layer}: loaded onto {self.router_weight.device}; its router takes torch "
                        "tensors there, not NumPy arrays")
        h = (np.asarray(hidden, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        out = h @ self.router_weight.T
        if self.router_bias is not None:
            out = out + self.router_bias
        return np.ascontiguousarray(out, dtype=np.float32)


class Checkpoint:
    """A Hugging Face checkpoint directory (config.json and model.safetensors or shards with
    model.safetensors.index.json), read as untrusted input and memory-mapped: only the tensors a rank
    asks for are touched.

    ck = moekit.Checkpoint(path, num_threads=0)   (0: a load on every hardware thread)
    ck.config_path, ck.model_type, ck.moe_layers (the layers holding an MoE block)
    ck.load_layer(layer, quant="auto", rank=0, ranks=1, shared_experts=True, device="cpu") ->
      LoadedLayer: this rank's experts (E / ranks of them) in `quant` ("auto": the checkpoint's own FP8
      scheme; without a quantization_config, fp16 for a float16 checkpoint, else bf16); FP8 weights of
      that granularity load as stored, bf16 / fp16 values under "bf16" / "fp16" bit for bit, others are
      quantized (or rounded) at load by moekit's
      quantizer (LoadedLayer.note says which). device="cuda" (or
      "cuda:N") puts them on that GPU as torch tensors in the dtypes a CUDA Runtime reads, the host copy
      freed as each array lands (host memory: about one layer at a time); "cpu": NumPy arrays.
    """

    def __init__(self, path: str, num_threads: int = 0):
        """num_threads: the threads a load reads, checks and quantizes on (0: the machine's)."""
        self._ck = _moekit.Checkpoint(str(path), int(num_threads))

    @property
    def config_path(self) -> str:
        """The checkpoint's config.json: the `model` argument of MoeLayer and Runtime."""
        return self._ck.config_path

    @property
    def model_type(self) -> str:
        return self._ck.model_type

    @property
    def moe_layers(self) -> list:
        return list(self._ck.moe_layers)

    @property
    def opened_shards(self) -> list:
        return list(self._ck.opened_shards)

    def load_layer(self, layer: int, quant: str = "auto", rank: int = 0, ranks: int = 1,
                   shared_experts: bool = True, placement: Optional[Sequence[int]] = None,
                   device: str = "cpu") -> LoadedLayer:
        """placement: with redundant experts, the slot -> expert map of all ranks' slots; this rank's
        len(placement) / ranks slots are read. device: "cpu" (NumPy) or "cuda" / "cuda:N" (torch)."""
        if device != "cpu" and not (isinstance(device, str) and (device == "cuda" or device.startswith("cuda:"))):
            raise Error(f"device = {device!r}: load_layer loads onto 'cpu' (NumPy) or 'cuda' / 'cuda:N' (torch)")
        if device != "cpu" and ops._torch is None:
            raise Error(f"device = {device!r}: loading onto a GPU makes torch tensors, and torch is not installed")
        d = dict(self._ck.load_layer(int(layer), quant, int(rank), int(ranks), bool(shared_experts),
                                     None if placement is None else [int(e) for e in placement]))
        router = {"router_weight": d.pop("router_weight")}
        if "router_bias" in d:
            router["router_bias"] = d.pop("router_bias")
        q = d.pop("quant")
        note = d.pop("note")
        if device != "cpu":
            d, router = _to_torch(d, device, q), _to_torch(router, device)
        return LoadedLayer(int(layer), d, router["router_weight"], router.get("router_bias"), q, note)


class MoeLayer:
    """The MoE layer of one rank: Router -> dispatch -> experts -> combine, on the CPU or a GPU.

    MoeLayer(model, weights, max_tokens_per_rank, quant="auto", experts="batched-fp8",
             activation=None, num_threads=1, device=None, group=None, dispatch=None, num_experts=0,
             fuse_w1=None, accumulation="precise")
      model: a preset name (deepseek-v3, qwen3-30b-a3b, ...) or a config.json path
      weights: a mapping with w1, w1_scale, w2, w2_scale (and e_score_correction_bias when the
               model routes with it): this rank's experts, arrays in the layouts of the module
               docstring on the layer's device; kept referenced, never copied
      quant: "auto" (the model's quantization_config: block128 for DeepSeek-V3 / Kimi-K2; bf16 for
             unquantized checkpoints, fp16 for float16 ones), "per-token", "per-tensor", "block128",
             "bf16" or "fp16"
      device: "cpu" or "cuda" (the current GPU); default: where the weights are
      group: None for one rank holding every expert; a torch.distributed process group (or
             moekit.TorchGroup, or any object with rank(), size(), all_gather(bytes)) for expert
             parallelism over its ranks (dp = ep = its size, one process per GPU, e.g. torchrun):
             weights hold this rank's E / size experts, tokens move over NCCL between GPUs
      dispatch: the prepare/finalize (moekit plan lists them; default: nccl between GPUs)
      num_experts: > 0 overrides the model's routed experts (as the CLI's --num-experts)
      fuse_w1: None (default): the fused W1 where it runs (block128 with any activation but
               swigluoai): the activation and its 1x128 quantization in the W1 GEMM, no w1_out
               (DeepSeek-V3 DP 32: 1.26 -> 0.27 GiB of workspace, 1-7% slower than unfused on
               an H200: docs/PERF.md), W1 read in fp32 by the activation on every device; False: the
               unfused recipe (W1 into bf16 w1_out); True: fused, an error where it cannot run
      accumulation: "precise" (default): the GPU GEMMs move their FP8 partial sums into fp32 every
               128 elements of K; "fast" (per-token and per-tensor): the whole K loop in the tensor
               cores' FP8 accumulation, faster and 12-21% low at K = 7168 on all-positive
               products; the CPU sums in fp32 either way
      w1_layout: "gate_up" (default): W1 as checkpoints store it (gate rows then up rows), arranged
               once where the recipe reads block pairs (block128); "block_pairs": already arranged
               (moekit.arrange_w1_block_pairs), an error where the recipe reads another layout
      shared_experts: True (default): the model's shared experts in the step (weights shared_*),
               on a GPU on a second stream beside the routed experts; False: the routed experts
               only, for an engine that runs the shared experts itself
    The workspace is allocated once, at construction (workspace_bytes, equal to moekit.plan's
    total for the layout); forward() chunks steps over max_tokens_per_rank. On a GPU, forward()
    runs on torch's current stream (or `stream`) and synchronizes it to check each chunk;
    enqueue() + check_status() run one step without synchronizing (CUDA-graph capturable).
    """

    def __init__(self, model: str, weights: Mapping[str, Any], max_tokens_per_rank: int,
                 quant: str = "auto", experts: str = "batched-fp8", activation: Optional[str] = None,
                 num_threads: int = 1, device: Optional[str] = None, group: Any = None,
                 dispatch: Optional[str] = None, num_experts: int = 0, fuse_w1: Optional[bool] = None,
                 shared_experts: bool = True, w1_layout: str = "gate_up", accumulation: str = "precise"):
        _layer_arrays(weights)  # unknown keys refused before anything is built
        device = device or _device_of(weights["w1"])
        self._runtime = Runtime(model, max_tokens_per_rank, quant, experts, activation, num_threads, device, group,
                                dispatch, num_experts, fuse_w1, shared_experts, accumulation)
        self._runtime.add_layer(weights, w1_layout)
        self._layer = self._runtime._rt

    @property
    def workspace_bytes(self) -> int:
        """The layer's one allocation, equal to the plan's total."""
        return self._layer.workspace_bytes

    @property
    def problem(self) -> str:
        return self._layer.problem

    @property
    def device(self) -> str:
        """Where the layer runs: "cpu" or "cuda:N"."""
        return self._layer.device

    @property
    def rank(self) -> int:
        return self._layer.rank

    @property
    def ranks(self) -> int:
        return self._layer.ranks

    @property
    def dispatch(self) -> str:
        """The prepare/finalize the layer runs (e.g. "nccl (cuda)")."""
        return self._layer.dispatch

    def forward(self, hidden, router_logits, out=None, stream=None):
        """hidden (T, K) bfloat16 (or its uint16 bits), router_logits (T, E) float32 -> (T, K), on the
        layer's device. `out` (optional) receives the result in place. Every rank of a group calls it
        (T may differ between ranks, and be 0)."""
        return self._runtime.forward(0, hidden, router_logits, out, stream)

    __call__ = forward

    def enqueue(self, hidden, router_logits, out, stream=None, max_tokens_any_rank=0):
        """One step of at most max_tokens_per_rank tokens, enqueued with no host synchronization
        (capturable in a CUDA graph: the inputs and `out` must stay at the captured addresses).
        Follow it, or each replay, or every few, with check_status(): the device flags persist until
        read, so a check after several replays reports the first error any of them raised.
        `max_tokens_any_rank` (expert parallelism; 0: not known): the most tokens any rank of the group
        feeds this step, the same on every rank, e.g. the batch size data-parallel ranks are padded to.
        It bounds the rows an expert can receive, so a decode step skips the GEMM launches of large
        experts; an expert that receives more than the bound allows is raised by check_status()."""
        return self._runtime.enqueue(0, hidden, router_logits, out, stream, max_tokens_any_rank)

    def check_status(self, stream=None):
        """Synchronizes the stream and raises moekit.Error for the first thing flagged since the last
        check (a NaN logit, a count over capacity, a peer that timed out), and clears it."""
        self._runtime.check_status(stream)
