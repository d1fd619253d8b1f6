"""The Python package on a GPU with torch (skipped, by name, without torch or a CUDA device): the
layer over CUDA tensors equals `moekit run --device cuda` bit for bit, on torch's current stream and
under torch.cuda.graph; the experts ops on CUDA agree with the CPU ops and are captured by
torch.cuda.graph and torch.compile(fullgraph=True) with the same bits; a first call inside a capture
and bad counts raise moekit.Error; expert parallelism over torch.distributed (torchrun, 2 GPUs)
equals `moekit run --dp 2`. The ops' host overhead over the direct C++ call is measured and printed
(MOEKIT_PY_RESULTS: also written there as JSON)."""
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import moekit

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or moekit._moekit.cuda_device_count() == 0,
                                reason="needs a CUDA device and moekit built with CUDA")

from test_moekit import CLI, small_model  # noqa: E402
from test_ops import bf16_to_f64, random_codes  # noqa: E402

POISON = -1  # int16 0xFFFF: a bfloat16 NaN


def bits(t):
    return t.view(torch.int16).cpu().numpy().view(np.uint16)


def cli_output(tmp_path, model, quant, T, seed, dp=1, extra=()):
    out_file = tmp_path / f"cli-{quant}-{dp}.bin"
    subprocess.run([CLI, "run", "--model", model, "--dp", str(dp), "--tokens-per-rank", str(T), "--steps", "1",
                    "--device", "cuda", "--quant", quant, "--seed", str(seed), "--output", str(out_file), *extra],
                   check=True, capture_output=True)
    return out_file


@pytest.mark.parametrize("quant,fuse_w1", [("per-token", False), ("block128", False), ("block128", True),
                                           ("bf16", False)])
def test_layer_on_cuda_equals_the_cli_eager_stream_and_graph(tmp_path, quant, fuse_w1):
    model = small_model(tmp_path)
    T, seed = 37, 3
    extra = ("--fuse-w1",) if fuse_w1 else ("--no-fuse-w1",)
    cli_out = np.fromfile(cli_output(tmp_path, model, quant, T, seed, extra=extra), dtype=np.uint16)
    w = moekit.synthetic_inputs(model, tokens=T, quant=quant, seed=seed, device="cuda")
    layer = moekit.MoeLayer(model, weights=w, max_tokens_per_rank=T, quant=quant, fuse_w1=fuse_w1)
    assert layer.device == f"cuda:{torch.cuda.current_device()}"
    out = layer(w["hidden"], w["router_logits"])
    assert out.dtype == torch.bfloat16 and out.is_cuda and out.shape == (T, w["hidden"].shape[1])
    assert np.array_equal(bits(out).reshape(-1), cli_out)
    plans = {p.name: p for p in moekit.plan(model, dp=1, ep=1, max_tokens_per_rank=T, device="cuda", quant=quant,
                                            fuse_w1=fuse_w1)}
    assert layer.workspace_bytes == plans["batched-fp8 (cuda)"].total_bytes
    assert ("w1_out" in {r.name for r in plans["batched-fp8 (cuda)"].regions}) == (not fuse_w1)
    # On a side stream (torch's current one there): the same bits.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        again = layer(w["hidden"], w["router_logits"])
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(again.view(torch.int16), out.view(torch.int16))
    # One step captured by torch.cuda.graph, replayed over a poisoned output.
    static = torch.full_like(out.view(torch.int16), POISON).view(torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer.enqueue(w["hidden"], w["router_logits"], static)
    static.view(torch.int16).fill_(POISON)
    graph.replay()
    layer.check_status()
    assert torch.equal(static.view(torch.int16), out.view(torch.int16))
    # Bad input names what is wrong: a CPU array for a CUDA layer.
    with pytest.raises(moekit.Error, match="router_logits: on cpu where cuda:"):
        layer(w["hidden"], w["router_logits"].cpu())


def experts_case(quant, E=4, M=64, K=512, I=256, seed=11, counts=(64, 0, 17, 1)):
    """NumPy operands of the batched op: FP8 codes, scales of `quant`, and poisoned outputs."""
    rng = np.random.default_rng(seed)
    N = 2 * I
    n1, n2 = {"per-token": (N, K), "block128": (N // 128 * K // 128, K // 128 * I // 128)}[quant]
    case = {
        "a1q": random_codes(rng, (E, M, K)),
        "a1q_scale": (rng.uniform(0.5, 1.5, (E, M) if quant == "per-token" else (E, M, K // 128)) / 64).astype(np.float32),
        "expert_num_tokens": np.array(counts, np.int32),
        "w1": random_codes(rng, (E, N, K)),
        "w1_scale": (rng.uniform(0.5, 1.5, (E, n1)) / (64 * np.sqrt(K))).astype(np.float32),
        "w2": random_codes(rng, (E, K, I)),
        "w2_scale": (rng.uniform(0.5, 1.5, (E, n2)) / (64 * np.sqrt(I))).astype(np.float32),
    }
    if quant == "block128":  # random codes: their rows are block pairs as well as anything else
        case["w1_layout"] = "block_pairs"
    return case


def to_cuda(case):
    t = {k: torch.from_numpy(v).cuda() if isinstance(v, np.ndarray) else v for k, v in case.items()}
    for k in ("a1q", "w1", "w2"):
        t[k] = t[k].view(torch.float8_e4m3fn)
    return t


def poisoned(shape, dtype=torch.bfloat16):
    return torch.full(shape, POISON, dtype=torch.int16, device="cuda").view(dtype)


@pytest.mark.parametrize("quant,fuse_w1", [("per-token", False), ("block128", False), ("block128", True)])
def test_batched_op_on_cuda_agrees_with_the_cpu_and_leaves_padding(quant, fuse_w1):
    case = experts_case(quant)
    E, M, K = case["a1q"].shape
    cpu_out = np.full((E, M, K), 0xFFFF, np.uint16)
    moekit.ops.batched_experts(**case, out=cpu_out, fuse_w1=fuse_w1)
    t = to_cuda(case)
    out = poisoned((E, M, K))
    before = moekit.ops.workspace_bytes()
    moekit.ops.batched_experts(**t, out=out, fuse_w1=fuse_w1)
    if fuse_w1:  # the unfused workspace of this shape exists already (the block128 case before)
        unfused = dict(case, a1q=case["a1q"][:, :M - 1].copy())  # a fresh shape: M - 1 rows
        unfused["a1q_scale"] = case["a1q_scale"][:, :M - 1].copy()
        unfused["expert_num_tokens"] = np.minimum(case["expert_num_tokens"], M - 1).astype(np.int32)
        fused_bytes = moekit.ops.workspace_bytes() - before
        mid = moekit.ops.workspace_bytes()
        moekit.ops.batched_experts(**to_cuda(unfused), out=poisoned((E, M - 1, K)), fuse_w1=False)
        unfused_bytes = moekit.ops.workspace_bytes() - mid
        mid = moekit.ops.workspace_bytes()
        moekit.ops.batched_experts(**to_cuda(unfused), out=poisoned((E, M - 1, K)))  # fused: block128's default
        fused_small = moekit.ops.workspace_bytes() - mid
        # w1_out (bf16, every row) out, w1_small (fp32, min(64, M - 1) rows an expert) in.
        N = case["w1"].shape[1]
        assert fused_bytes > 0 and unfused_bytes - fused_small == E * (M - 1) * N * 2 - E * min(64, M - 1) * N * 4, \
            (fused_bytes, unfused_bytes, fused_small)
    moekit.ops.check_status()
    got = bits(out)
    for e, m in enumerate(case["expert_num_tokens"]):
        assert (got[e, m:] == 0xFFFF).all(), f"expert {e}: a padding row was written"
        if m:
            a, b = bf16_to_f64(got[e, :m]), bf16_to_f64(cpu_out[e, :m])
            err = np.linalg.norm(a - b) / np.linalg.norm(b)
            assert err < 1e-2, f"expert {e}: CUDA vs CPU relative error {err:.3e}"


def test_standard_op_on_cuda_agrees_with_the_cpu():
    rng = np.random.default_rng(5)
    E, T, topk, K, I = 8, 45, 4, 512, 256
    case = experts_case("block128", E=E, M=1, K=K, I=I)
    a1q = random_codes(rng, (T, K))
    a1q_scale = (rng.uniform(0.5, 1.5, (T, K // 128)) / 64).astype(np.float32)
    ids = rng.integers(-1, E, (T, topk)).astype(np.int32)
    weights = rng.uniform(0, 1, (T, topk)).astype(np.float32)
    args = dict(a1q=a1q, a1q_scale=a1q_scale, topk_ids=ids, topk_weights=weights, w1=case["w1"],
                w1_scale=case["w1_scale"], w2=case["w2"], w2_scale=case["w2_scale"])
    cpu_out = np.zeros((T, K), np.uint16)
    moekit.ops.standard_experts(**args, out=cpu_out, w1_layout="block_pairs")
    t = {k: torch.from_numpy(v).cuda() for k, v in args.items()}
    out = poisoned((T, K))
    moekit.ops.standard_experts(**t, out=out, w1_layout="block_pairs")
    moekit.ops.check_status()
    a, b = bf16_to_f64(bits(out)), bf16_to_f64(cpu_out)
    err = np.linalg.norm(a - b) / np.linalg.norm(b)
    assert err < 1e-2, f"CUDA vs CPU relative error {err:.3e}"


@pytest.mark.parametrize("quant", ["bf16", "fp16"])
def test_sixteen_bit_ops_on_cuda_agree_with_the_cpu_and_leave_padding(quant):
    """quant="bf16" / "fp16" on CUDA tensors: the batched op (padding rows untouched) and the standard op
    (ids of -1 skipped) against the CPU ops on the same operands, and under a CUDA graph the eager bits."""
    dt = torch.bfloat16 if quant == "bf16" else torch.float16
    # Both devices round the same stored values; they differ where fp32 sums in other orders round to
    # neighbouring values: a few ulps (bf16 2^-8, fp16 2^-11) at most, rarely.
    bound = 8e-3 if quant == "bf16" else 2e-3

    def f64(t):
        return t.cpu().float().double().numpy()

    rng = np.random.default_rng(9)
    E, M, K, I = 4, 64, 512, 256
    counts = np.array([64, 0, 17, 1], np.int32)
    draw = lambda shape, s: torch.from_numpy(rng.normal(0, s, shape).astype(np.float32)).to(dt)  # noqa
    a1q, w1, w2 = draw((E, M, K), 1.0), draw((E, 2 * I, K), K ** -0.5), draw((E, K, I), I ** -0.5)
    cpu_out = torch.full((E, M, K), float("nan"), dtype=dt)
    moekit.ops.batched_experts(a1q, None, torch.from_numpy(counts), w1, None, w2, None, cpu_out, quant=quant)
    t = [x.cuda() for x in (a1q, w1, w2)]
    counts_cuda = torch.from_numpy(counts).cuda()  # made before the capture (no host copy inside one)
    out = poisoned((E, M, K), dt)
    moekit.ops.batched_experts(t[0], None, counts_cuda, t[1], None, t[2], None, out, quant=quant)
    moekit.ops.check_status()
    got = bits(out)
    for e, m in enumerate(counts):
        assert (got[e, m:] == 0xFFFF).all(), f"expert {e}: a padding row was written"
        if m:
            a, b = f64(out[e, :m]), f64(cpu_out[e, :m])
            err = np.linalg.norm(a - b) / np.linalg.norm(b)
            assert err < bound, f"{quant} expert {e}: CUDA vs CPU relative error {err:.3e}"
    static = poisoned((E, M, K), dt)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moekit.ops.batched_experts(t[0], None, counts_cuda, t[1], None, t[2], None, static, quant=quant)
    static.view(torch.int16).fill_(POISON)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static.view(torch.int16), out.view(torch.int16))
    # The standard op: T tokens, top-4 ids with -1 slots, out in the recipe's dtype.
    T, topk = 45, 4
    x = draw((T, K), 1.0)
    ids = torch.from_numpy(rng.integers(-1, E, (T, topk)).astype(np.int64))
    weights = torch.from_numpy(rng.uniform(0, 1, (T, topk)).astype(np.float32))
    cpu_std = torch.zeros(T, K, dtype=dt)
    moekit.ops.standard_experts(x, None, ids, weights, w1, None, w2, None, cpu_std, quant=quant)
    std = poisoned((T, K), dt)
    moekit.ops.standard_experts(x.cuda(), None, ids.cuda(), weights.cuda(), t[1], None, t[2], None, std, quant=quant)
    moekit.ops.check_status()
    a, b = f64(std), f64(cpu_std)
    err = np.linalg.norm(a - b) / np.linalg.norm(b)
    assert err < bound, f"{quant} standard op: CUDA vs CPU relative error {err:.3e}"


def test_torch_ops_under_cuda_graph_and_compile_give_the_eager_bits():
    t = to_cuda(experts_case("block128"))
    E, M, K = t["a1q"].shape
    eager = poisoned((E, M, K))
    torch.ops.moekit.batched_experts(**t, out=eager)
    static = poisoned((E, M, K))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.moekit.batched_experts(**t, out=static)
    static.view(torch.int16).fill_(POISON)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static.view(torch.int16), eager.view(torch.int16))

    def step(a1q, out):
        torch.ops.moekit.batched_experts(a1q, t["a1q_scale"], t["expert_num_tokens"], t["w1"], t["w1_scale"], t["w2"],
                                         t["w2_scale"], out, w1_layout="block_pairs")
        return out.float().sum(dim=-1)

    compiled = torch.compile(step, fullgraph=True)
    out = poisoned((E, M, K))
    sums = compiled(t["a1q"], out)
    assert torch.equal(out.view(torch.int16), eager.view(torch.int16))
    # The padding rows are NaN in both; inductor may sum in another order.
    torch.testing.assert_close(sums, eager.float().sum(dim=-1), equal_nan=True, rtol=1e-5, atol=1e-3)


def test_first_call_inside_a_capture_and_bad_counts_raise():
    t = to_cuda(experts_case("per-token", M=48, counts=(48, 0, 3, 1)))  # M = 48: no other test calls it
    out = poisoned(tuple(t["a1q"].shape))
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(moekit.Error, match="inside CUDA graph capture.*call it once before capturing"):
        with torch.cuda.graph(graph):
            moekit.ops.batched_experts(**t, out=out)
    torch.cuda.synchronize()
    good = torch.tensor([4, 0, 3, 1], dtype=torch.int32, device="cuda")
    t["expert_num_tokens"] = torch.tensor([49, 0, 3, 1], dtype=torch.int32, device="cuda")
    moekit.ops.batched_experts(**t, out=out)
    moekit.ops.batched_experts(**{**t, "expert_num_tokens": good}, out=poisoned(tuple(out.shape)))
    # The bad call's flag outlives the good call after it, until check_status reads it.
    with pytest.raises(moekit.Error, match="expert_num_tokens\\[0\\] = 49 is outside \\[0, M = 48\\]"):
        moekit.ops.check_status()
    assert (bits(out)[0] == 0xFFFF).all(), "the expert with a bad count wrote rows"
    moekit.ops.batched_experts(**{**t, "expert_num_tokens": good}, out=out)
    moekit.ops.check_status()  # read and cleared


def test_max_rows_on_cuda_plans_the_call_and_an_expert_past_it_is_raised():
    """max_rows on a GPU (M = 96, three GEMM ranges planned without it, one with max_rows = 9): the same
    bits as undeclared; an expert past it skipped (rows untouched, the others' the same bits) and raised
    by check_status."""
    t = to_cuda(experts_case("block128", M=96, counts=(5, 9, 0, 7)))
    undeclared, declared, under = (poisoned(tuple(t["a1q"].shape)) for _ in range(3))
    moekit.ops.batched_experts(**t, out=undeclared)
    moekit.ops.batched_experts(**t, out=declared, max_rows=9)
    moekit.ops.check_status()
    assert np.array_equal(bits(declared), bits(undeclared))
    moekit.ops.batched_experts(**t, out=under, max_rows=8)
    with pytest.raises(moekit.Error, match="expert 1 received 9 rows, more than the 8"):
        moekit.ops.check_status()
    got, ref = bits(under), bits(undeclared)
    assert (got[1] == 0xFFFF).all(), "the skipped expert's rows were written"
    assert all(np.array_equal(got[e], ref[e]) for e in (0, 2, 3))


def test_same_shape_calls_on_two_streams_give_the_one_stream_bits():
    cases = [to_cuda(experts_case("block128", seed=s)) for s in (21, 22)]
    E, M, K = cases[0]["a1q"].shape
    ref = []
    for t in cases:
        out = poisoned((E, M, K))
        moekit.ops.batched_experts(**t, out=out)
        ref.append(out)
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = [poisoned((E, M, K)) for _ in cases]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for _ in range(3):  # alternate: each call waits for the other stream's call on the shared workspace
        for s, t, o in zip(streams, cases, outs):
            with torch.cuda.stream(s):
                moekit.ops.batched_experts(**t, out=o)
    torch.cuda.synchronize()
    for o, r in zip(outs, ref):
        assert torch.equal(o.view(torch.int16), r.view(torch.int16))


def test_op_overhead_over_the_direct_call():
    """Host time per call (enqueue only, no synchronization inside the timed loop) of the C++ entry
    point called with the tensors themselves (nanobind takes each by torch's __dlpack__), moekit.ops
    (the Python wrapper) and torch.ops.moekit (the registered op); and the per-tensor conversions."""
    t = to_cuda(experts_case("per-token", E=8, M=16, counts=(16, 3, 0, 0, 1, 2, 5, 9)))
    E, M, K = t["a1q"].shape
    out = poisoned((E, M, K))
    views = {k: (v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v) for k, v in t.items()}
    names = ("a1q", "a1q_scale", "expert_num_tokens", "w1", "w1_scale", "w2", "w2_scale")
    stream = torch.cuda.current_stream().cuda_stream
    b = to_cuda(experts_case("block128", E=8, M=16, counts=(16, 3, 0, 0, 1, 2, 5, 9)))
    b_out = poisoned((E, M, K))

    def uncached(call):  # every launch redoes its bound host work (cuda/launch_cache.h)
        def run():
            moekit._moekit._set_launch_cache(False)
            try:
                call()
            finally:
                moekit._moekit._set_launch_cache(True)
        return run

    calls = {
        "C++ entry, tensors": lambda: moekit._moekit.batched_experts(*[views[k] for k in names], out, "silu", "", False,
                                                                      1, stream, 0, 7.0, 1.702, "precise", "gate_up",
                                                                      None),
        "moekit.ops.batched_experts": lambda: moekit.ops.batched_experts(**t, out=out),
        "torch.ops.moekit.batched_experts": lambda: torch.ops.moekit.batched_experts(**t, out=out),
        "  no launch cache": uncached(lambda: moekit.ops.batched_experts(**t, out=out)),
        "  block128 (its rule: fused W1)": lambda: moekit.ops.batched_experts(**b, out=b_out),
        "  block128, no launch cache": uncached(lambda: moekit.ops.batched_experts(**b, out=b_out)),
    }
    n, repeats, us = 60, 7, {}
    for name, call in calls.items():
        call()
        torch.cuda.synchronize()
        loops = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(n):
                call()
            loops.append((time.perf_counter() - start) / n * 1e6)
            torch.cuda.synchronize()
        us[name] = float(np.median(loops))
    # The launch cache changes no bit of the result.
    ref = b_out.clone()
    uncached(lambda: moekit.ops.batched_experts(**b, out=b_out))()
    torch.cuda.synchronize()
    assert torch.equal(ref.view(torch.int16), b_out.view(torch.int16))
    x = t["w1_scale"]
    conversions = {}
    for name, f in {"tensor.__dlpack__()": lambda: x.__dlpack__(), "torch._C._to_dlpack": lambda: torch._C._to_dlpack(x),
                    "current stream (torch.cuda)": lambda: torch.cuda.current_stream(x.device).cuda_stream,
                    "current stream (raw)": lambda: torch._C._cuda_getCurrentRawStream(x.device.index)}.items():
        start = time.perf_counter()
        for _ in range(2000):
            f()
        conversions[name] = (time.perf_counter() - start) / 2000 * 1e6
    direct = us["C++ entry, tensors"]
    lines = [f"{name:<34} {v:8.1f} us/call  ({v - direct:+.1f} over the C++ entry)" for name, v in us.items()]
    lines += [f"  {name:<32} {v:8.2f} us" for name, v in conversions.items()]
    print("\nmoekit op host time per call (median of 7 loops of 60, enqueue only)\n" + "\n".join(lines))
    results = os.environ.get("MOEKIT_PY_RESULTS")
    if results:
        with open(results, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "us_per_call": us,
                       "overhead_us": {k: v - direct for k, v in us.items()}, "conversion_us": conversions}, f,
                      indent=1)
    assert all(v > 0 for v in us.values())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("quant", ["block128"])
def test_expert_parallel_over_torch_distributed_equals_the_cli(tmp_path, quant):
    model, T, seed, E = "deepseek-v3", 24, 5, 32
    prefix = cli_output(tmp_path, model, quant, T, seed, dp=2,
                        extra=("--ep", "2", "--comm", "in-process", "--num-experts", str(E)))
    script = os.path.join(os.path.dirname(__file__), "ep_torchrun.py")
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", script, model,
                        str(T), str(seed), quant, str(E), str(prefix)], env=env, capture_output=True, text=True,
                       timeout=300)
    print(r.stdout[-4000:], r.stderr[-4000:])
    assert r.returncode == 0
    for rank in range(2):
        assert f"rank {rank}: equal to moekit run --dp 2: True; graph replay equal: True" in r.stdout


def test_the_readme_example_runs():
    """The README's PyTorch example, as written (it cannot rot)."""
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    blocks = [b.split("```", 1)[0] for b in readme.split("```python\n")[1:]]
    example = [b for b in blocks if 'device="cuda"' in b]
    assert len(example) == 1, "the README has one GPU example"
    assert len(example[0].strip().splitlines()) <= 10, "the example stays ten lines"
    scope = {}
    exec(compile(example[0], "README.md", "exec"), scope)
    out = scope["out"]
    assert out.shape == (128, 7168) and out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_killed_rank_makes_the_other_raise_within_a_bounded_time():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = os.path.join(os.path.dirname(__file__), "ep_killed_rank.py")
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "MOEKIT_EP_TIMEOUT_MS": "3000", "NCCL_NVLS_ENABLE": "0",
               "NVSHMEM_DISABLE_NVLS": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
        procs.append(subprocess.Popen([sys.executable, script], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    out0 = outs[0]
    print(out0[-3000:])
    assert "rank 0: first step ok" in out0 and "rank 1: first step ok" in outs[1]
    for how in ("forward", "enqueue"):
        m = re.search(rf"rank 0: {how} after the peer died: moekit.Error after ([0-9.]+) s", out0)
        assert m, f"{how} did not raise"
        # forward: the exchange finds the peer gone at once; enqueue: MOEKIT_EP_TIMEOUT_MS = 3 s
        assert float(m.group(1)) < 15, f"{how} took {m.group(1)} s"
