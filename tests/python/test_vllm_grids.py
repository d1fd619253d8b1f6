"""vLLM's fused-MoE kernel test grids against moekit.ops: the shapes, inputs, reference and
tolerances of vLLM's tests/kernels/moe/test_block_fp8.py (block-scaled FP8, the standard format:
moekit.ops.standard_experts) and test_batched_moe.py (the batched format: moekit.ops.batched_experts),
written here from their description.

Inputs as vLLM draws them: a = randn(M, K) / 10 (bf16), weights randn / 15 (bf16) quantized in
128x128 blocks (amax / 448), activations in 1x128 groups, top-k of softmax(randn(M, E)) scores,
not renormalized. vLLM's reference keeps W1's output, the activation and W2's output in bf16 and sums
the top-k in bf16; moekit's block128 recipe keeps W1's output in fp32 (the fused W1) and sums in
fp32. So every case is also measured against a float64 reference on the same FP8 operands (no bf16
intermediate). vLLM's tolerances (atol = rtol = 0.035, 0.039 at M >= 8192 for test_block_fp8; atol
2e-2, rtol 0 for test_batched_moe) hold against float64; against vLLM's reference they hold wherever
that reference is not itself the farther from float64; and moekit's whole-output error from float64
is at most vLLM's reference's (the printed table has both, and the elements where the two differ
beyond the tolerance).

On the GPU moekit's W1 and W2 sums are not the CPU's exact fp32 ones: Hopper's FP8 tensor cores keep
~14 bits within each 128-element k-tile before the fp32 promotion (~1e-4 relative), and FP8
requantization turns that into a few flipped activation codes (tools/recipe_sensitivity.py). So there
vLLM's tolerance against float64 holds for every element as on the CPU, and the two comparisons with
vLLM's reference hold for the grid rather than each case: at most one element in a million beyond
vLLM's tolerance of its reference and not nearer float64 (2 of 14.7 M measured), and moekit nearer
float64 than vLLM's reference in at least 95% of the cases and at the median (a one-row case is a
few codes: 2 of 446 cases measured the other way, 9.9e-3 against 5.5e-3).

The CPU runs the grid's cases of at most 0.3 GFLOP and 4e8 weight elements (drawing and quantizing
E x 3N x K weights dominates a small case: 16 x 4608 x 7168 took 48 s) (CI: about a third of the grid);
MOEKIT_VLLM_GRID=full runs every case, and MOEKIT_VLLM_DEVICE=cuda runs moekit and both references
on the GPU, the whole grid (the GPU round).

The unquantized grids (moekit's quant="bf16" and quant="fp16"): test_moe.py's test_fused_moe (the
standard format, bf16 and fp16, vLLM's expert_map at ep_size 4, weights with a padded row stride;
a = randn / 10, weights randn / 10, atol 2e-2, rtol 0) and test_batched_moe.py's bf16
test_fused_moe_batched_experts (MNK_FACTORS; weights randn / 15; atol = rtol = 2e-2). vLLM's reference
(torch_experts) runs each GEMM in the operands' dtype with fp32 sums and a 16-bit result, SiLU-and-mul
in that dtype, and the top-k sum in fp32: moekit's 16-bit recipes round where it does (the
activation once, from fp32), so its tolerance holds against that reference for every element; the
float64 distance is reported beside it. Where moekit refuses a case by contract, the case asserts
the refusal and its words: a row stride other than the row (vLLM's padding=True: moekit reads packed
weights; the case then runs on a packed copy) and K = 511 (rows of 16-element multiples). vLLM's
absolute tolerance alone would pass an all-zero output where the outputs are small, so each case
also bounds the whole output's distance from float64 (UNQUANTIZED_REL, per dtype).
"""
import itertools
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import moekit  # noqa: E402
from moekit import ops  # noqa: E402

DEVICE = os.environ.get("MOEKIT_VLLM_DEVICE", "cpu")
FULL = os.environ.get("MOEKIT_VLLM_GRID", "") == "full"
FP8_MAX = 448.0
CPU_FLOPS = 3e8
CPU_WEIGHTS = 4e8

# test_block_fp8.py: (M, N, K) with N the intermediate size (W1 is (E, 2N, K)), E, top-k.
BLOCK_MNK = [(1, 128, 128), (1, 128, 7168), (1, 1024, 7168), (1, 4608, 128), (1, 4608, 7168), (83, 128, 128),
             (83, 512, 512), (83, 4608, 512), (83, 4608, 7168), (128, 512, 512), (128, 1024, 7168),
             (128, 4608, 7168), (2048, 128, 128), (2048, 1024, 7168), (2048, 4608, 512), (2048, 4608, 7168),
             (8192, 128, 128), (8192, 128, 7168), (8192, 1024, 7168), (8192, 4608, 7168)]
BLOCK_E = [2, 8, 16]
TOP_KS = [1, 2, 6]
# test_batched_moe.py (test_fused_moe_batched_experts, block-scaled FP8): m tokens, n, k, e, top-k.
BATCHED_M = [32, 45, 64]
BATCHED_N = [128, 512, 1024, 2048]
BATCHED_K = [128, 512, 1024, 2048]
BATCHED_E = [8, 64]


def flops(M, N, K, topk):
    return 6.0 * M * topk * N * K  # W1 (2N x K) and W2 (K x N), 2 FLOPs a multiply-add


def runs_here(M, N, K, topk, E=1):
    return FULL or DEVICE == "cuda" or (flops(M, N, K, topk) <= CPU_FLOPS and 3.0 * E * N * K <= CPU_WEIGHTS)


def block_quant(w):
    """(E, n, k) -> FP8 codes and (E, n/128, k/128) float32 scales, 128x128 blocks, amax / 448."""
    e, n, k = w.shape
    b = w.float().reshape(e, n // 128, 128, k // 128, 128)
    scale = (b.abs().amax(dim=(2, 4), keepdim=True) / FP8_MAX).clamp(min=1e-10)
    codes = (b / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.reshape(e, n, k), scale.reshape(e, n // 128, k // 128)


def group_quant(x):
    """(..., k) -> FP8 codes and (..., k/128) float32 scales: 1x128 groups, amax / 448."""
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // 128, 128)
    scale = (g.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-10)
    return (g / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(x.shape), scale.squeeze(-1)


def dequant_blocks(codes, scale, dtype):
    n, k = codes.shape
    return (codes.to(dtype).reshape(n // 128, 128, k // 128, 128) * scale.to(dtype)[:, None, :, None]).reshape(n, k)


def dequant_groups(codes, scale, dtype):
    t, k = codes.shape
    return (codes.to(dtype).reshape(t, k // 128, 128) * scale.to(dtype)[:, :, None]).reshape(t, k)


def expert_reference(aq, as_, w1, w1s, w2, w2s, vllm):
    """One expert's rows. vllm=True: vLLM's reference (W1's and W2's outputs in bf16, SiLU-and-mul in
    bf16, then 1x128 quantization); False: float64 throughout on the same operands (the activation
    quantized from its float64 values)."""
    dt = torch.float32 if vllm else torch.float64
    h = dequant_groups(aq, as_, dt) @ dequant_blocks(w1, w1s, dt).T
    if vllm:
        h = h.to(torch.bfloat16)
    n = h.shape[-1] // 2
    act = torch.nn.functional.silu(h[:, :n]) * h[:, n:]
    q, s = group_quant(act)
    y = dequant_groups(q, s, dt) @ dequant_blocks(w2, w2s, dt).T
    return y.to(torch.bfloat16) if vllm else y


def draw(M, N, K, E, topk, seed):
    # Drawn where the case runs: the largest cases' weights (1e9 values) take seconds on the CPU.
    dev = "cuda" if DEVICE == "cuda" else "cpu"
    g = torch.Generator(device=dev).manual_seed(seed)
    a = (torch.randn(M, K, generator=g, device=dev) / 10).to(torch.bfloat16)
    w1 = (torch.randn(E, 2 * N, K, generator=g, device=dev) / 15).to(torch.bfloat16)
    w2 = (torch.randn(E, K, N, generator=g, device=dev) / 15).to(torch.bfloat16)
    score = torch.randn(M, E, generator=g, device=dev).to(torch.bfloat16)
    weights, ids = torch.topk(torch.softmax(score.float(), dim=-1), topk, dim=-1)  # not renormalized
    w1q, w1s = block_quant(w1)
    del w1
    w2q, w2s = block_quant(w2)
    del w2
    aq, as_ = group_quant(a)
    return aq, as_, w1q, w1s, w2q, w2s, weights, ids


def references(aq, as_, w1q, w1s, w2q, w2s, weights, ids):
    """vLLM's reference (bf16 rows, bf16 top-k sum) and the float64 one, (M, K) each."""
    M, K = aq.shape
    topk = ids.shape[1]
    rows_v = torch.zeros(M, topk, K, dtype=torch.bfloat16, device=aq.device)
    rows_d = torch.zeros(M, topk, K, dtype=torch.float64, device=aq.device)
    for e in ids.unique().tolist():
        t, slot = (ids == e).nonzero(as_tuple=True)
        args = (aq[t], as_[t], w1q[e], w1s[e], w2q[e], w2s[e])
        rows_v[t, slot] = expert_reference(*args, vllm=True)
        rows_d[t, slot] = expert_reference(*args, vllm=False)
    vllm_ref = (rows_v * weights.to(torch.bfloat16)[:, :, None]).sum(dim=1)
    exact = (rows_d * weights.double()[:, :, None]).sum(dim=1)
    return vllm_ref.cpu(), exact.cpu()


def moekit_w1(w1q, w1s):
    """W1 in the block pairs moekit's block128 recipe reads (moved once, as a loader does)."""
    codes = w1q.view(torch.uint8).cpu().numpy()
    pairs, pairs_scale = moekit.arrange_w1_block_pairs(codes, w1s.reshape(w1s.shape[0], -1).cpu().numpy())
    return pairs, pairs_scale


def on_device(x):
    t = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
    return t.cuda() if DEVICE == "cuda" else t


def as_fp8(x):
    t = on_device(x)
    return t.view(torch.float8_e4m3fn) if t.dtype == torch.uint8 else t


def rel(x, ref):
    return float((x.double() - ref).norm() / ref.norm())


def batched_slots(ids, e):
    """The batched format's placement of a step's (token, slot) pairs: each expert's tokens in its own
    slab, in token order (a dispatch's output). Returns the counts (e,) int32 and, for each pair,
    (t, s, expert, row)."""
    ids = ids.cpu()
    counts = torch.zeros(e, dtype=torch.int32)
    where = []
    for t in range(ids.shape[0]):
        for s in range(ids.shape[1]):
            x = int(ids[t, s])
            where.append((t, s, x, int(counts[x])))
            counts[x] += 1
    return counts, where


def batched_combine(rows, where, weights, m, k):
    """The top-k weighted sum of the experts' rows (E, M, K) in fp32, rounded once to bf16, as float."""
    weights = weights.cpu()
    got = torch.zeros(m, k)
    for t, s, x, r in where:
        got[t] += float(weights[t, s]) * rows[x, r]
    return got.to(torch.bfloat16).float()


def check(got, vllm_ref, exact, atol, rtol):
    """vLLM's tolerance against the float64 reference of the same operands, and against vLLM's own
    reference except where that reference is the farther of the two from float64 (its bf16
    intermediates: e.g. M = 1, N = 4608, K = 7168, E = 2, top-2, column 269: float64 0.04952, moekit
    0.04980, vLLM's reference 0.01367)."""
    g, v = got.double(), vllm_ref.double()
    torch.testing.assert_close(g, exact, atol=atol, rtol=rtol)
    apart = (g - v).abs() > atol + rtol * v.abs()
    nearer = (g - exact).abs() < (v - exact).abs()
    bad = apart & ~nearer
    allowed = int(bad.numel() * 1e-6) if DEVICE == "cuda" else 0  # the GPU's FP8 sums (module docstring)
    assert int(bad.sum()) <= allowed, (f"{int(bad.sum())} elements beyond vLLM's tolerance of its reference, not "
                                       f"nearer float64 (allowed {allowed})")
    return int(apart.sum())


def assert_nearer_float64(e_moekit, e_vllm):
    """moekit's whole-output error from float64 is at most vLLM's reference's: per case on the CPU,
    over the grid on the GPU (test_zz_report; module docstring)."""
    if DEVICE != "cuda":
        assert e_moekit <= e_vllm * 1.05 + 1e-4, f"moekit {e_moekit:.3e} vs vLLM's reference {e_vllm:.3e} from float64"


RESULTS = []


@pytest.mark.parametrize("seed", [0])
@pytest.mark.parametrize("topk", TOP_KS)
@pytest.mark.parametrize("E", BLOCK_E)
@pytest.mark.parametrize(("M", "N", "K"), BLOCK_MNK)
def test_block_fp8_grid(M, N, K, E, topk, seed):
    if topk > E:
        pytest.skip(f"topk = {topk} > E = {E} (vLLM skips it too)")
    if not runs_here(M, N, K, topk, E):
        pytest.skip(f"{flops(M, N, K, topk) / 1e9:.1f} GFLOP, {3.0 * E * N * K:.1e} weights: past the CPU's share "
                    "(MOEKIT_VLLM_GRID=full runs it)")
    aq, as_, w1q, w1s, w2q, w2s, weights, ids = draw(M, N, K, E, topk, seed)
    vllm_ref, exact = references(aq, as_, w1q, w1s, w2q, w2s, weights, ids)
    w1, w1_scale = moekit_w1(w1q, w1s)
    out = on_device(torch.empty(M, K, dtype=torch.bfloat16))
    ops.standard_experts(as_fp8(aq.view(torch.uint8)), on_device(as_), on_device(ids), on_device(weights),
                         as_fp8(w1), on_device(w1_scale), as_fp8(w2q.view(torch.uint8)),
                         on_device(w2s.reshape(E, -1).contiguous()), out, quant="block128", w1_layout="block_pairs")
    if DEVICE == "cuda":
        ops.check_status()
    got = out.float().cpu()
    tol = 0.035 if M < 8192 else 0.039
    apart = check(got, vllm_ref, exact, tol, tol)
    e_moekit, e_vllm = rel(got, exact), rel(vllm_ref.float(), exact)
    RESULTS.append(("block_fp8", M, N, K, E, topk, e_moekit, e_vllm, apart))
    # moekit keeps W1's output in fp32 and sums the top-k in fp32: closer to float64 than vLLM's
    # bf16 reference (a margin for one-row cases, where both are one rounding apart).
    assert_nearer_float64(e_moekit, e_vllm)


BATCHED_CASES = [c for c in itertools.product(BATCHED_M, BATCHED_N, BATCHED_K, BATCHED_E, TOP_KS)]


@pytest.mark.parametrize(("m", "n", "k", "e", "topk"), BATCHED_CASES)
def test_batched_grid(m, n, k, e, topk):
    if not runs_here(m, n, k, topk):
        pytest.skip(f"{flops(m, n, k, topk) / 1e9:.0f} GFLOP: past the CPU's share (MOEKIT_VLLM_GRID=full runs it)")
    aq, as_, w1q, w1s, w2q, w2s, weights, ids = draw(m, n, k, e, topk, 7)
    vllm_ref, exact = references(aq, as_, w1q, w1s, w2q, w2s, weights, ids)
    aq, as_ = aq.cpu(), as_.cpu()
    # The batched format: each expert's tokens in its own slab of M = m rows (a dispatch's output),
    # the rest padding (NaN: never read into a result).
    counts, where = batched_slots(ids, e)
    slab = torch.full((e, m, k), 0x7F, dtype=torch.uint8)
    slab_scale = torch.full((e, m, k // 128), float("nan"))
    for t, _, x, r in where:
        slab[x, r] = aq[t].view(torch.uint8)
        slab_scale[x, r] = as_[t]
    w1, w1_scale = moekit_w1(w1q, w1s)
    out = on_device(torch.full((e, m, k), float("nan"), dtype=torch.bfloat16))
    ops.batched_experts(as_fp8(slab), on_device(slab_scale), on_device(counts), as_fp8(w1), on_device(w1_scale),
                        as_fp8(w2q.view(torch.uint8)), on_device(w2s.reshape(e, -1).contiguous()), out,
                        quant="block128", w1_layout="block_pairs")
    if DEVICE == "cuda":
        ops.check_status()
    got = batched_combine(out.float().cpu(), where, weights, m, k)
    apart = check(got, vllm_ref, exact, 2e-2, 0)
    e_moekit, e_vllm = rel(got, exact), rel(vllm_ref.float(), exact)
    RESULTS.append(("batched", m, n, k, e, topk, e_moekit, e_vllm, apart))
    assert_nearer_float64(e_moekit, e_vllm)


def test_zz_report():
    """The table: each case's distance to float64, moekit's and vLLM's reference's."""
    fp8 = [r for r in RESULTS if r[0] in ("block_fp8", "batched")]
    if not fp8:
        pytest.skip("no grid case ran")
    print(f"\n{'grid':10s} {'M':>5s} {'N':>5s} {'K':>5s} {'E':>3s} {'topk':>4s}  moekit vs f64  vLLM ref vs f64  "
          "apart")
    for g, M, N, K, E, topk, a, b, apart in fp8:
        print(f"{g:10s} {M:5d} {N:5d} {K:5d} {E:3d} {topk:4d}  {a:13.3e}  {b:15.3e}  {apart:5d}")
    a = np.array([r[6] for r in fp8])
    b = np.array([r[7] for r in fp8])
    print(f"{len(fp8)} cases: moekit closer to float64 in {int((a < b).sum())}; median moekit {np.median(a):.3e}, "
          f"vLLM's reference {np.median(b):.3e}")
    if DEVICE == "cuda":
        assert (a <= b * 1.05 + 1e-4).mean() >= 0.95 and np.median(a) <= np.median(b), "moekit not nearer float64"


# test_moe.py's test_fused_moe: (M, N, K), E, top-k, ep_size, dtype, padding.
FUSED_MNK = [(1, 128, 128), (1, 2048, 128), (33, 2048, 128), (32768, 2048, 511), (40000, 1024, 1024)]
FUSED_E = [8, 64, 192]
FUSED_TOP_KS = [2, 6]
# test_batched_moe.py's MNK_FACTORS (test_fused_moe_batched_experts, dtype bf16).
BATCHED_BF16_MNK = [(1, 128, 128), (1, 128, 2048), (1, 512, 512), (1, 1024, 128), (1, 1024, 2048), (32, 128, 128),
                    (32, 512, 512), (32, 1024, 2048), (45, 128, 128), (45, 128, 2048), (45, 512, 512),
                    (45, 1024, 128), (45, 1024, 2048), (64, 512, 512), (64, 1024, 2048), (222, 128, 128),
                    (222, 128, 2048), (222, 1024, 128), (222, 1024, 2048)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The unquantized recipes' whole-output distance from float64: the roundings of W1's output, the
# activation and the result, each ~2^-9 relative RMS in bf16 (measured 3.6-4.3e-3, CPU and GPU) and
# 8x finer in fp16 (2^-12).
UNQUANTIZED_REL = {"bf16": 1e-2, "fp16": 2e-3}


def unquantized_expert(x, w1, w2, exact):
    """One expert's rows as vLLM's torch_experts computes them: each GEMM in the operands' dtype (fp32
    sums, a 16-bit result), SiLU-and-mul in that dtype; exact: float64 throughout, nothing rounded."""
    if exact:
        h = x.double() @ w1.double().T
    else:
        h = (x.float() @ w1.float().T).to(x.dtype)  # what a 16-bit GEMM gives: fp32 sums, one rounding
    n = h.shape[-1] // 2
    act = torch.nn.functional.silu(h[:, :n]) * h[:, n:]
    if exact:
        return act @ w2.double().T
    return (act.float() @ w2.float().T).to(x.dtype)


def unquantized_references(a, w1, w2, weights, ids):
    """vLLM's reference (16-bit rows, the top-k sum in fp32, one rounding) and float64, (M, K) each.
    ids are local expert ids, -1 for a slot no local expert holds (it adds nothing)."""
    M, K = a.shape
    topk = ids.shape[1]
    rows_v = torch.zeros(M, topk, K, dtype=a.dtype, device=a.device)
    rows_d = torch.zeros(M, topk, K, dtype=torch.float64, device=a.device)
    for e in ids.unique().tolist():
        if e < 0:
            continue
        t, slot = (ids == e).nonzero(as_tuple=True)
        rows_v[t, slot] = unquantized_expert(a[t], w1[e], w2[e], False)
        rows_d[t, slot] = unquantized_expert(a[t], w1[e], w2[e], True)
    vllm_ref = (rows_v.float() * weights.float()[:, :, None]).sum(dim=1).to(a.dtype)
    exact = (rows_d * weights.double()[:, :, None]).sum(dim=1)
    return vllm_ref.float().cpu(), exact.cpu()


def refused(call, words):
    """moekit refuses the case by contract: the error names it (`words` in its text)."""
    with pytest.raises(moekit.Error) as err:
        call()
    assert words in str(err.value), str(err.value)
    return str(err.value)


@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("ep_size", [1, 4])
@pytest.mark.parametrize("topk", FUSED_TOP_KS)
@pytest.mark.parametrize("E", FUSED_E)
@pytest.mark.parametrize(("M", "N", "K"), FUSED_MNK)
def test_fused_moe_unquantized_grid(M, N, K, E, topk, ep_size, dtype, padding):
    if not runs_here(M, N, K, topk, E):
        pytest.skip(f"{flops(M, N, K, topk) / 1e9:.1f} GFLOP, {3.0 * E * N * K:.1e} weights: past the CPU's share "
                    "(MOEKIT_VLLM_GRID=full runs it)")
    dt = DTYPES[dtype]
    dev = "cuda" if DEVICE == "cuda" else "cpu"
    g = torch.Generator(device=dev).manual_seed(7)
    refusal = K % 16 != 0  # refused before any value is read: no weights drawn
    a = (torch.randn(M, K, generator=g, device=dev) / 10).to(dt)
    if refusal:
        w1, w2 = torch.zeros(E, 2 * N, K, dtype=dt, device=dev), torch.zeros(E, K, N, dtype=dt, device=dev)
    else:
        w1 = (torch.randn(E, 2 * N, K, generator=g, device=dev) / 10).to(dt)
        w2 = (torch.randn(E, K, N, generator=g, device=dev) / 10).to(dt)
    score = torch.randn(M, E, generator=g, device=dev).to(dt)
    weights, ids = torch.topk(torch.softmax(score.float(), dim=-1), topk, dim=-1)  # fused_topk, not renormalized
    expert_map = None
    local = ids
    if ep_size > 1:  # vLLM's: E / ep_size random experts held here (a repeated draw keeps its last slot)
        local_e = E // ep_size
        e_ids = torch.randint(0, E, (local_e,), generator=g, device=dev)
        expert_map = torch.full((E,), -1, dtype=torch.int32, device=dev)
        expert_map[e_ids] = torch.arange(local_e, dtype=torch.int32, device=dev)
        w1, w2 = w1[e_ids], w2[e_ids]
        local = expert_map[ids].long()
    out = torch.full((M, K), float("nan"), dtype=dt, device=dev)

    def call(w1_, w2_):
        ops.standard_experts(a, None, ids, weights, w1_, None, w2_, None, out, quant=dtype, expert_map=expert_map)
        if DEVICE == "cuda":
            ops.check_status()

    if K % 16:  # the shape is checked first, in every dtype
        RESULTS.append((f"fused-{dtype}", M, N, K, E, topk, float("nan"), float("nan"), -1))
        refused(lambda: call(w1, w2), f"K = {K} and I = {N} must be multiples of 16")
        return
    if padding:  # vLLM pads K by 128 and slices it off: a row stride of K + 128
        w1p = torch.nn.functional.pad(w1, (0, 128))[..., :-128]
        w2p = torch.nn.functional.pad(w2, (0, 128))[..., :-128]
        refused(lambda: call(w1p, w2p), "not C-contiguous")
        w1, w2 = w1p.contiguous(), w2p.contiguous()
    call(w1, w2)
    vllm_ref, exact = unquantized_references(a, w1, w2, weights, local)
    got = out.float().cpu()
    assert torch.isfinite(got).all(), "an output row was not written"
    torch.testing.assert_close(got, vllm_ref, atol=2e-2, rtol=0)
    torch.testing.assert_close(got.double(), exact, atol=2e-2, rtol=0)
    apart = int(((got - vllm_ref).abs() > 2e-2).sum())
    if float(exact.norm()) == 0:  # every slot held by another rank: moekit writes zeros
        assert float(got.abs().max()) == 0, "rows of no local expert: zeros expected"
        return
    # vLLM's atol alone passes an all-zero output where the outputs are small (K = 128: |y| ~ 1e-2):
    # the whole output within the dtype's roundings of float64 (bf16: 4.3e-3 measured at most; zeros give 1).
    assert rel(got, exact) < UNQUANTIZED_REL[dtype], f"relative error {rel(got, exact):.3e} from float64"
    if DEVICE != "cuda":  # one rounding of the activation, not two: nearer float64 (the GPU: the report)
        assert rel(got, exact) <= rel(vllm_ref, exact) * 1.05 + 1e-5, "moekit farther from float64 than vLLM's reference"
    RESULTS.append((f"fused-{dtype}", M, N, K, E, topk, rel(got, exact), rel(vllm_ref, exact), apart))


@pytest.mark.parametrize("topk", TOP_KS)
@pytest.mark.parametrize("e", BATCHED_E)
@pytest.mark.parametrize(("m", "n", "k"), BATCHED_BF16_MNK)
def test_batched_bf16_grid(m, n, k, e, topk):
    if topk > e:
        pytest.skip(f"topk = {topk} > e = {e} (vLLM skips it too)")
    if not runs_here(m, n, k, topk):
        pytest.skip(f"{flops(m, n, k, topk) / 1e9:.0f} GFLOP: past the CPU's share (MOEKIT_VLLM_GRID=full runs it)")
    dev = "cuda" if DEVICE == "cuda" else "cpu"
    g = torch.Generator(device=dev).manual_seed(7)
    a = (torch.randn(m, k, generator=g, device=dev) / 10).to(torch.bfloat16)
    score = torch.randn(m, e, generator=g, device=dev).to(torch.bfloat16)
    w1 = (torch.randn(e, 2 * n, k, generator=g, device=dev) / 15).to(torch.bfloat16)
    w2 = (torch.randn(e, k, n, generator=g, device=dev) / 15).to(torch.bfloat16)
    weights, ids = torch.topk(torch.softmax(score.float(), dim=-1), topk, dim=-1)
    vllm_ref, exact = unquantized_references(a, w1, w2, weights, ids)
    a_cpu = a.cpu()
    # Each expert's tokens in its own slab of m rows (a dispatch's output), the rest padding (NaN).
    counts, where = batched_slots(ids, e)
    slab = torch.full((e, m, k), float("nan"), dtype=torch.bfloat16)
    for t, _, x, r in where:
        slab[x, r] = a_cpu[t]
    out = on_device(torch.full((e, m, k), float("nan"), dtype=torch.bfloat16))
    ops.batched_experts(on_device(slab), None, on_device(counts), w1, None, w2, None, out, quant="bf16")
    if DEVICE == "cuda":
        ops.check_status()
    rows = out.float().cpu()
    got = batched_combine(rows, where, weights, m, k)
    assert torch.isfinite(got).all(), "a valid row was not written"
    for x in range(e):  # padding rows never written
        assert torch.isnan(rows[x, int(counts[x]):]).all(), f"expert {x}: a padding row was written"
    torch.testing.assert_close(got, vllm_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.double(), exact, atol=2e-2, rtol=2e-2)
    apart = int(((got - vllm_ref).abs() > 2e-2 + 2e-2 * vllm_ref.abs()).sum())
    assert rel(got, exact) < UNQUANTIZED_REL["bf16"], f"relative error {rel(got, exact):.3e} from float64"
    RESULTS.append(("batched-bf16", m, n, k, e, topk, rel(got, exact), rel(vllm_ref, exact), apart))


def test_zz_unquantized_report():
    """The unquantized table: each case's distance to float64, moekit's and vLLM's reference's."""
    rows = [r for r in RESULTS if r[0].startswith(("fused-", "batched-bf16"))]
    if not rows:
        pytest.skip("no unquantized case ran")
    ran = [r for r in rows if r[8] >= 0]
    print(f"\n{len(ran)} unquantized cases ran, {len(rows) - len(ran)} refused by contract (K = 511)")
    for g in ("fused-bf16", "fused-fp16", "batched-bf16"):
        mine = [r for r in ran if r[0] == g]
        if mine:
            a = np.array([r[6] for r in mine])
            b = np.array([r[7] for r in mine])
            print(f"{g}: {len(mine)} cases, moekit vs float64 median {np.median(a):.3e} (max {a.max():.3e}), vLLM's "
                  f"reference {np.median(b):.3e} (max {b.max():.3e}); elements apart beyond the tolerance: "
                  f"{sum(r[8] for r in mine)}")
            # moekit rounds where vLLM's reference does but sums the top-k once: at least as near float64.
            assert np.median(a) <= np.median(b), f"{g}: moekit's median error above vLLM's reference's"
