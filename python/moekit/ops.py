"""Low-level ops in the conventions an inference engine's fused-MoE path already uses.

batched_experts(a1q, a1q_scale, expert_num_tokens, w1, w1_scale, w2, w2_scale, out, activation="silu",
                quant=None, stream=None, fuse_w1=None, max_rows=0, swiglu_limit=7.0,
                swiglu_alpha=1.702, accumulation="precise", w1_layout="gate_up", workspace=None)
    The experts alone in the BatchedExperts convention (DeepEP low-latency / pplx dispatch output):
      a1q (E_local, M, K) FP8 e4m3 (uint8 codes, or torch.float8_e4m3fn); rows >= expert_num_tokens[e]
      of expert e are padding: never read into a result, never written
      a1q_scale float32: (E_local,) per-tensor, (E_local, M) per-token, (E_local, M, ceil(K/128)) 1x128
      expert_num_tokens (E_local,) int32
      w1 (E_local, N, K), w2 (E_local, K, I) FP8 with float32 scales in the matching scheme
      (w_scale (E_local, 1) per-tensor, (E_local, rows) per-channel, (E_local, ceil(rows/128) *
      ceil(cols/128)) 128x128 blocks)
      out (E_local, M, K) bfloat16 (or its uint16 bits), or float16 (the bf16 result converted:
      bf16's 8-bit mantissa; padding rows keep their values; quant="fp16": W2's fp16 result itself,
      and float16 is required), written for the valid rows only
      max_rows: the most rows any expert holds in this call, when the caller knows it (e.g. the
      step's tokens per rank x dispatchers; 0: not known, M). On a GPU the GEMM launches of larger
      experts are then not made (a decode step planned for M launches them empty, ~3 us each); an
      expert holding more is skipped and raised as an error, never computed wrong.
    W1 -> activation -> FP8 -> W2, fp32 accumulation.

standard_experts(a1q, a1q_scale, topk_ids, topk_weights, w1, w1_scale, w2, w2_scale, out, activation="silu",
                 quant=None, stream=None, fuse_w1=None, swiglu_limit=7.0,
                 swiglu_alpha=1.702, accumulation="precise", w1_layout="gate_up", expert_map=None,
                 workspace=None)
    The same experts in the standard (token-order) convention, with the top-k weighted sum:
      a1q (T, K) FP8, a1q_scale (1,) per-tensor, (T,) per-token or (T, ceil(K/128)) 1x128
      topk_ids (T, topk) int32 or int64 (torch.topk's, DeepEP's) expert ids: local ids in
      [0, E_local), -1: the slot is skipped; with expert_map, global ids
      expert_map (E,) int32 / int64, global id -> local id or -1 (held by another rank): vLLM's
      topk_weights (T, topk) float32 (other float dtypes are converted)
      out (T, K) bfloat16 or float16: out[t] = sum over slots of weight * expert(a1q[t]) (fp32, slot
      order, one rounding to out's dtype, as the layer's combine)
    An id outside its range (or mapped outside [-1, E_local)) is never read as another expert: the
    CPU raises at once, a GPU skips it and check_status() raises.

Scales may carry the shapes engines and checkpoints give them: trailing ones ((E_local, M, 1),
(T, 1), (E_local, 1, 1)) and, for weights, the experts first and the same values after them in any
shape (weight_scale_inv's (E, N/128, K/128), (E, N, 1) channels). `w1_layout`: "gate_up" (default;
the checkpoints' order: gate rows, then up rows) or "block_pairs" (moekit.arrange_w1_block_pairs's
order). Under block128 moekit reads W1 in block pairs and the ops never copy weights, so a
"gate_up" W1 is refused there, naming the one-time arrangement; "block_pairs" where the recipe reads
another order is refused too. `activation`: silu, gelu, gelu_tanh, swigluoai, relu2 (alias
relu2_no_mul), silu_no_mul, gelu_no_mul. `swiglu_limit` and `swiglu_alpha`: swigluoai's clamp and
alpha (gpt-oss's config.swiglu_limit and config.swiglu_alpha, defaults 7 and 1.702: the gate is
clamped above at the limit, the up projection to [-limit, limit], and out = (up + 1) * gate *
sigmoid(alpha * gate)); each finite and in (0, its bound] (moekit/limits.h); the other activations
ignore them. `accumulation`: "precise" (default) moves the GPU GEMMs' FP8 partial
sums into fp32 every 128 elements of K; "fast" (per-token and per-tensor only) keeps the whole K
loop in the tensor cores' FP8 accumulation: faster, and 12-21% low at K = 7168 on all-positive
products. The CPU sums in fp32 either way.

quant="bf16" (named, never inferred): the unquantized recipe, a bf16 checkpoint's own numbers: a1q,
w1 and w2 bfloat16 (or their uint16 bits), the scales None (or empty: (0,), (E_local, 0)), fp32 sums,
W1's output and the activation's kept in bf16 (no FP8 step between the GEMMs). quant="fp16": the
same in float16 (an fp16 checkpoint's, vLLM's fp16 path): a1q, w1, w2, W1's output, the activation's
and the experts' output rows fp16 (past 65504: inf, as in torch).

Both run where their arrays are: NumPy arrays or CPU tensors on the CPU, CUDA tensors on their GPU,
zero copy (but for the conversions named above). `quant` is inferred from the scales' shapes (pass
"per-token", "per-tensor" or "block128" where two schemes fit). `fuse_w1`: None (default) fuses
where it runs (block128 with any activation but swigluoai): the activation and its 1x128
quantization run in the W1 GEMM (its epilogue, or for experts of <= 64 rows a kernel over their fp32
rows), no bf16 W1 output in the workspace, as `moekit run`; False asks for the unfused recipe (W1
into bf16, then the activation), True for the fused one (an error where it cannot run). On a GPU the
work is enqueued on `stream` (a cudaStream_t as an int; default: torch's current stream of that
device) with no host synchronization, so the ops can be captured in CUDA graphs.

Workspaces: `workspace=` (a 1-D uint8 buffer on the arrays' device, at least
batched_experts_workspace_bytes(...) / standard_experts_workspace_bytes(...) bytes, 256-byte
aligned on a GPU) runs a call in the caller's memory: nothing cached but the plan, the status words
zeroed for that call; check_status(workspace=buf) reads that call's flags. Without it, each problem
shape builds its workspace on its first call (make that first call before
a graph capture) and keeps it. batched_experts_workspace_bytes(...) / standard_experts_workspace_bytes(...)
give a shape's figure before any call. The cached total (workspace_bytes()) stays within
workspace_cap() (default 4 GiB; set_workspace_cap(bytes)): a new workspace frees the least recently
used ones first, except those a CUDA graph captured (a graph may replay into them at any time) and
one larger than the cap alone, which stands by itself. release_workspaces() frees the cached ones
(captured=True: those too, once the caller's graphs are gone). Freeing waits for a workspace's last
call and raises the flags it kept. The CPU raises bad counts or ids at once; on a GPU they are
clamped on the device (nothing is written out of bounds), each workspace keeps the first flags its
calls raise, and check_status() raises for them (and clears them).

With torch installed they are also torch.ops.moekit.batched_experts / standard_experts
(torch.library.Library ops mutating `out`, with fake kernels): torch.compile(fullgraph=True) traces
them without a graph break and torch.cuda.graph captures them. Calls that share a workspace (same
shapes and device) never overlap: a call on another stream waits for the last one (eager calls).
"""
from __future__ import annotations

import os
from typing import Any, Optional

from . import _moekit
from ._torch import import_torch

__all__ = ["batched_experts", "standard_experts", "check_status", "workspace_bytes", "workspace_cap",
           "set_workspace_cap", "release_workspaces", "batched_experts_workspace_bytes",
           "standard_experts_workspace_bytes"]

_THREADS = max(1, (os.cpu_count() or 1))


_torch = import_torch()  # None: NumPy only
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


def _np():
    import numpy
    return numpy


def _is_fp16(x) -> bool:
    if _is_torch(x):
        return x.dtype == _torch.float16
    return getattr(getattr(x, "dtype", None), "name", "") == "float16"


def _bf16_scratch(out):
    """A bf16 array of `out`'s shape on its device for the kernels to write (out is float16)."""
    if _is_torch(out):
        return _torch.empty(out.shape, dtype=_torch.bfloat16, device=out.device)
    return _np().empty(out.shape, dtype=_np().uint16)


def _to_fp16(bf16, out, valid=None):
    """out[...] = bf16 (converted), where `valid` (a mask over out's rows) holds, else unchanged."""
    if _is_torch(out):
        val = bf16.to(_torch.float16)
        if valid is None:
            out.copy_(val)
        else:
            out.copy_(_torch.where(valid[..., None], val, out))
        return
    np = _np()
    with np.errstate(over="ignore", invalid="ignore"):  # padding rows of the scratch hold anything
        val = (bf16.astype(np.uint32) << 16).view(np.float32).astype(np.float16)
    if valid is None:
        out[...] = val
    else:
        out[valid] = val[valid]


def _refuse_bad_ids(ids, expert_map, E_local: int):
    """Host ids (NumPy): an Error naming the first id outside its range as the caller gave it (the
    converted ids carry E_local in its place, which would be all a kernel could report)."""
    np = _np()
    ids64 = np.asarray(ids).astype(np.int64)
    if expert_map is None:
        bad = np.argwhere((ids64 < -1) | (ids64 >= E_local))
        if bad.size:
            r, c = (int(x) for x in bad[0]) if ids64.ndim == 2 else (int(bad[0][0]), 0)
            raise _moekit.Error(f"standard_experts: topk_ids[{r}][{c}] = {int(ids64[tuple(bad[0])])} is outside "
                                f"[-1, E_local = {E_local}): ids must be local expert indices (or pass expert_map "
                                "for global ids)")
        return
    m = np.asarray(expert_map).astype(np.int64)
    E = m.shape[0]
    outside = (ids64 < -1) | (ids64 >= E)
    inside = (ids64 >= 0) & (ids64 < E)
    mapped = np.where(inside, m[np.clip(ids64, 0, max(E - 1, 0))], -1)
    bad = np.argwhere(outside | (inside & ((mapped < -1) | (mapped >= E_local))))
    if bad.size:
        at = tuple(bad[0])
        r, c = (int(x) for x in at) if ids64.ndim == 2 else (int(at[0]), 0)
        v = int(ids64[at])
        why = (f"is outside [-1, E = {E}) (expert_map's global ids)" if outside[at] else
               f"maps to expert_map[{v}] = {int(mapped[at])}, outside [-1, E_local = {E_local})")
        raise _moekit.Error(f"standard_experts: topk_ids[{r}][{c}] = {v} {why}")


def _local_ids(topk_ids, expert_map, E_local: int):
    """topk_ids as the kernels read them: int32 local ids in [-1, E_local). int64 ids are converted;
    with expert_map (global -> local id, -1 elsewhere) global ids are mapped. Host ids outside their
    range raise here, naming the caller's value; on a GPU (no synchronization to look) such an id
    becomes E_local, which the kernels refuse (never another expert's id)."""
    if not _is_torch(topk_ids) or topk_ids.device.type == "cpu":
        np = _np()
        host = np.asarray(topk_ids.numpy() if _is_torch(topk_ids) else topk_ids)
        host_map = None if expert_map is None else np.asarray(
            expert_map.cpu().numpy() if _is_torch(expert_map) else expert_map)
        # (Ids or a map of another type are refused below, by name.)
        if host.dtype.kind in "iu" and (host_map is None or (host_map.ndim == 1 and host_map.dtype.kind in "iu")):
            _refuse_bad_ids(host, host_map, E_local)
    if _is_torch(topk_ids):
        t = _torch
        ids = topk_ids
        if expert_map is not None:
            if not _is_torch(expert_map) or expert_map.dim() != 1 or expert_map.dtype not in (t.int32, t.int64):
                raise _moekit.Error("standard_experts: expert_map must be a 1-D int32 or int64 tensor (global id -> "
                                    "local id or -1) on the ids' device")
            E = expert_map.shape[0]
            inside = (ids >= 0) & (ids < E)
            mapped = expert_map.to(ids.device)[ids.long().clamp(0, max(E - 1, 0))].to(t.int64)
            mapped = t.where((mapped >= -1) & (mapped < E_local), mapped, E_local)
            ids = t.where(inside, mapped, t.where(ids == -1, -1, E_local))
        elif ids.dtype == t.int32:
            return ids
        elif ids.dtype != t.int64:
            raise _moekit.Error(f"standard_experts: topk_ids dtype {ids.dtype}; int32 or int64 expert ids")
        ids = t.where((ids >= -1) & (ids < E_local), ids, E_local)
        return ids.to(t.int32)
    np = _np()
    ids = np.asarray(topk_ids)
    if ids.dtype.kind not in "iu":
        raise _moekit.Error(f"standard_experts: topk_ids dtype {ids.dtype}; int32 or int64 expert ids")
    if expert_map is not None:
        m = np.asarray(expert_map)
        if m.ndim != 1 or m.dtype.kind not in "iu":
            raise _moekit.Error("standard_experts: expert_map must be a 1-D integer array (global id -> local id "
                                "or -1)")
        E = m.shape[0]
        ids64 = ids.astype(np.int64)
        inside = (ids64 >= 0) & (ids64 < E)
        mapped = m.astype(np.int64)[np.clip(ids64, 0, max(E - 1, 0))]
        mapped = np.where((mapped >= -1) & (mapped < E_local), mapped, E_local)
        return np.ascontiguousarray(np.where(inside, mapped, np.where(ids64 == -1, -1, E_local)).astype(np.int32))
    if ids.dtype == np.int32:
        return topk_ids
    ids64 = ids.astype(np.int64)
    return np.ascontiguousarray(np.where((ids64 >= -1) & (ids64 < E_local), ids64, E_local).astype(np.int32))


def _f32(x):
    if _is_torch(x):
        return x if x.dtype == _torch.float32 else x.float()
    np = _np()
    x = np.asarray(x)
    return x if x.dtype == np.float32 else x.astype(np.float32)


def _scales(x, like, shape):
    """`x`, or for None (the bf16 recipe has no scales) an empty float32 array of `shape` where `like` is."""
    if x is not None:
        return x
    if _is_torch(like):
        return _torch.empty(shape, dtype=_torch.float32, device=like.device)
    return _np().empty(shape, _np().float32)


def batched_experts(a1q, a1q_scale, expert_num_tokens, w1, w1_scale, w2, w2_scale, out, activation: str = "silu",
                    quant: Optional[str] = None, stream: Any = None, fuse_w1: Optional[bool] = None,
                    max_rows: int = 0, swiglu_limit: float = 7.0, swiglu_alpha: float = 1.702,
                    accumulation: str = "precise", w1_layout: str = "gate_up", workspace=None):
    """The experts in the BatchedExperts convention (module docstring); returns `out`."""
    # W2 writes `out` in the recipe's output dtype: fp16 for quant="fp16", else bf16 (converted here).
    target = _bf16_scratch(out) if _is_fp16(out) and quant != "fp16" else out
    E_local = int(w1.shape[0])
    a1q_scale, w1_scale, w2_scale = (_scales(a1q_scale, a1q, (0,)), _scales(w1_scale, w1, (E_local, 0)),
                                     _scales(w2_scale, w2, (E_local, 0)))
    _moekit.batched_experts(_plain(a1q), _plain(a1q_scale), _plain(expert_num_tokens), _plain(w1), _plain(w1_scale),
                            _plain(w2), _plain(w2_scale), _plain(target), activation, quant or "", fuse_w1, _THREADS,
                            _stream(a1q, stream), int(max_rows), float(swiglu_limit), float(swiglu_alpha),
                            accumulation, w1_layout,
                            None if workspace is None else _plain(workspace))
    if target is not out:
        M = out.shape[1]
        if _is_torch(out):
            rows = _torch.arange(M, device=out.device)[None, :] < expert_num_tokens.to(out.device)[:, None]
        else:
            rows = _np().arange(M)[None, :] < _np().asarray(expert_num_tokens)[:, None]
        _to_fp16(target, out, rows)
    return out


def standard_experts(a1q, a1q_scale, topk_ids, topk_weights, w1, w1_scale, w2, w2_scale, out,
                     activation: str = "silu", quant: Optional[str] = None, stream: Any = None,
                     fuse_w1: Optional[bool] = None, swiglu_limit: float = 7.0, swiglu_alpha: float = 1.702,
                     accumulation: str = "precise", w1_layout: str = "gate_up", expert_map=None, workspace=None):
    """The experts in the standard convention with the top-k weighted sum (module docstring);
    returns `out`."""
    ids = _local_ids(topk_ids, expert_map, int(w1.shape[0]))
    E_local = int(w1.shape[0])
    a1q_scale, w1_scale, w2_scale = (_scales(a1q_scale, a1q, (0,)), _scales(w1_scale, w1, (E_local, 0)),
                                     _scales(w2_scale, w2, (E_local, 0)))
    _moekit.standard_experts(_plain(a1q), _plain(a1q_scale), _plain(ids), _plain(_f32(topk_weights)), _plain(w1),
                             _plain(w1_scale), _plain(w2), _plain(w2_scale), _plain(out), activation, quant or "",
                             fuse_w1, _THREADS, _stream(a1q, stream), float(swiglu_limit), float(swiglu_alpha),
                             accumulation, w1_layout,
                             None if workspace is None else _plain(workspace))
    return out


def check_status(stream: Any = None, workspace=None) -> None:
    """Raises moekit.Error for the first flags each GPU workspace kept since the last check (a count
    outside [0, M], an expert id outside [-1, E_local)), and clears them. Synchronizes `stream`
    (default: each workspace's last stream). With `workspace` (a caller's buffer): the flags of the
    last call made with it."""
    _moekit.ops_check_status(_stream(None, stream), None if workspace is None else _plain(workspace))


def workspace_bytes() -> int:
    """Bytes the ops' cached workspaces hold now, over every shape and device."""
    return _moekit.ops_workspace_bytes()


def workspace_cap() -> int:
    """The bound on workspace_bytes() (module docstring); default 4 GiB."""
    return _moekit.ops_workspace_cap()


def set_workspace_cap(nbytes: int) -> None:
    """Bounds the cached workspaces' total: later calls free least recently used ones (never those a
    CUDA graph captured) to stay within it."""
    _moekit.ops_set_workspace_cap(int(nbytes))


def release_workspaces(captured: bool = False) -> int:
    """Frees the cached workspaces, after their last calls finish (raising the flags they kept), and
    returns the bytes freed. Those a CUDA graph captured only with captured=True: the caller says the
    graphs that replay into them are gone."""
    return _moekit.ops_release_workspaces(bool(captured))


def batched_experts_workspace_bytes(E_local: int, M: int, K: int, N: int, activation: str = "silu",
                                    quant: str = "per-token", fuse_w1: Optional[bool] = None,
                                    swiglu_limit: float = 7.0, swiglu_alpha: float = 1.702,
                                    accumulation: str = "precise", device: str = "cuda") -> int:
    """The workspace batched_experts allocates for these shapes (its first call), in bytes: the
    plan's figure (`moekit plan`'s experts section)."""
    return _moekit.ops_batched_workspace_bytes(E_local, M, K, N, activation, quant, fuse_w1, float(swiglu_limit),
                                               float(swiglu_alpha), accumulation, device)


def standard_experts_workspace_bytes(T: int, K: int, N: int, topk: int, E_local: int, activation: str = "silu",
                                     quant: str = "per-token", fuse_w1: Optional[bool] = None,
                                     swiglu_limit: float = 7.0, swiglu_alpha: float = 1.702,
                                     accumulation: str = "precise", device: str = "cuda") -> int:
    """The workspace standard_experts allocates for T tokens (planned for the next power of two of
    T), in bytes."""
    return _moekit.ops_standard_workspace_bytes(T, K, N, topk, E_local, activation, quant, fuse_w1,
                                                float(swiglu_limit), float(swiglu_alpha), accumulation, device)


torch_op_error = None  # why torch.ops.moekit.* is missing, when it is

# The torch ops: defined with torch.library.Library and one CompositeExplicitAutograd kernel each
# (CPU and CUDA tensors alike), fake kernels for torch.compile. Lighter per call than
# torch.library.custom_op's Python wrapper.
_BATCHED = ("batched_experts(Tensor a1q, Tensor a1q_scale, Tensor expert_num_tokens, Tensor w1, Tensor w1_scale, "
            "Tensor w2, Tensor w2_scale, Tensor(a!) out, str activation='silu', str? quant=None, bool? fuse_w1=None, "
            "int max_rows=0, float swiglu_limit=7.0, float swiglu_alpha=1.702, str accumulation='precise', "
            "str w1_layout='gate_up', "
            "Tensor(b!)? workspace=None) -> ()")
_STANDARD = ("standard_experts(Tensor a1q, Tensor a1q_scale, Tensor topk_ids, Tensor topk_weights, Tensor w1, "
             "Tensor w1_scale, Tensor w2, Tensor w2_scale, Tensor(a!) out, str activation='silu', "
             "str? quant=None, bool? fuse_w1=None, float swiglu_limit=7.0, float swiglu_alpha=1.702, "
             "str accumulation='precise', "
             "str w1_layout='gate_up', Tensor? expert_map=None, Tensor(b!)? workspace=None) -> ()")
if _torch is None:
    torch_op_error = "torch is not installed"
else:
    try:
        _lib = _torch.library.Library("moekit", "DEF")
        _lib.define(_BATCHED)
        _lib.define(_STANDARD)

        def _batched_kernel(a1q, a1q_scale, expert_num_tokens, w1, w1_scale, w2, w2_scale, out, activation="silu",
                            quant=None, fuse_w1=None, max_rows=0, swiglu_limit=7.0, swiglu_alpha=1.702,
                            accumulation="precise", w1_layout="gate_up", workspace=None):
            batched_experts(a1q, a1q_scale, expert_num_tokens, w1, w1_scale, w2, w2_scale, out, activation, quant,
                            fuse_w1=fuse_w1, max_rows=max_rows, swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha,
                            accumulation=accumulation, w1_layout=w1_layout, workspace=workspace)

        def _standard_kernel(a1q, a1q_scale, topk_ids, topk_weights, w1, w1_scale, w2, w2_scale, out,
                             activation="silu", quant=None, fuse_w1=None, swiglu_limit=7.0, swiglu_alpha=1.702,
                             accumulation="precise", w1_layout="gate_up", expert_map=None, workspace=None):
            standard_experts(a1q, a1q_scale, topk_ids, topk_weights, w1, w1_scale, w2, w2_scale, out, activation,
                             quant, fuse_w1=fuse_w1, swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha,
                             accumulation=accumulation, w1_layout=w1_layout, expert_map=expert_map,
                             workspace=workspace)

        _lib.impl("batched_experts", _batched_kernel, "CompositeExplicitAutograd")
        _lib.impl("standard_experts", _standard_kernel, "CompositeExplicitAutograd")

        @_torch.library.register_fake("moekit::batched_experts")
        def _(a1q, a1q_scale, expert_num_tokens, w1, w1_scale, w2, w2_scale, out, activation="silu", quant=None,
              fuse_w1=None, max_rows=0, swiglu_limit=7.0, swiglu_alpha=1.702, accumulation="precise",
              w1_layout="gate_up", workspace=None):
            return None

        @_torch.library.register_fake("moekit::standard_experts")
        def _(a1q, a1q_scale, topk_ids, topk_weights, w1, w1_scale, w2, w2_scale, out, activation="silu",
              quant=None, fuse_w1=None, swiglu_limit=7.0, swiglu_alpha=1.702, accumulation="precise",
              w1_layout="gate_up", expert_map=None, workspace=None):
            return None
    except Exception as e:  # an older torch: the NumPy / tensor path still works
        torch_op_error = f"{type(e).__name__}: {e}"
