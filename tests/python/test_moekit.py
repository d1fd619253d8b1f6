"""The Python package over the CPU backend (no GPU, no torch): plan figures equal the C++ golden
figures and `moekit plan --format json`; a layer forward equals `moekit run`'s outputs on the same
seed bit for bit; bad dtypes, shapes, layouts and devices raise moekit.Error; constructing and
running layers in a loop does not grow the process. ctest runs it (python.pytest) with the build's
package on PYTHONPATH and the CLI in MOEKIT_CLI."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import moekit

CLI = os.environ.get("MOEKIT_CLI", "moekit")


def small_model(tmp_path, name="qwen3-30b-a3b", experts=16, **keys):
    """A preset's config.json with fewer experts: the same shapes, a short run (`keys` override more)."""
    src = os.path.join(os.path.dirname(__file__), "..", "..", "models", f"{name}.json")
    data = json.load(open(src))
    for key in ("num_experts", "n_routed_experts", "num_local_experts"):
        if key in data:
            data[key] = experts
    data.update(keys)
    path = tmp_path / f"{name}-{experts}.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_plan_golden_figures():
    plans = {p.name: p for p in moekit.plan("deepseek-v3", dp=32, ep=32, max_tokens_per_rank=256, local_experts=16)}
    assert plans["upstream-batched-cutlass-before-fix"].workspace_bytes == 120259084288  # 112 GiB
    assert plans["upstream-batched-cutlass-after-fix"].workspace_bytes == 3758096384  # 3.5 GiB
    ours = plans["batched-fp8 (cuda)"]
    assert ours.M == 8192 and ours.E_local == 16 and ours.reference is False and ours.runs
    # DeepSeek-V3's checkpoint is block-quantized: quant="auto" plans block128 (1x128 activation
    # scales: 16 x 8192 x 16 fp32 = 8 MiB); per-token keeps one scale per row (512 KiB).
    assert ours.quant == "block128"
    # block128 fuses W1 by default: the activation and its quantization run in W1's epilogue, no w1_out
    # (1 GiB); the experts of <= 64 rows write fp32 rows into w1_small (16 MiB) for the activation
    # kernel: 0.27 GiB. fuse_w1=False: the unfused recipe, 1.26 GiB.
    fused = ours
    assert fused.workspace_bytes == 268435456 + 8388608 + 6144 + 6144 + 1048576 + 256 + 256 + 16777216
    unfused = {p.name: p for p in moekit.plan("deepseek-v3", dp=32, ep=32, max_tokens_per_rank=256, local_experts=16,
                                              fuse_w1=False)}["batched-fp8 (cuda)"]
    assert unfused.workspace_bytes == 1073741824 + 268435456 + 8388608 + 6144 + 6144 + 1048576 + 256 + 256
    assert "w1_out" not in {r.name for r in fused.regions}
    assert {r.name: r.bytes for r in fused.regions}["w1_small"] == 16 * 64 * 4096 * 4
    with pytest.raises(moekit.Error, match="fuse-w1"):
        moekit.plan("deepseek-v3", dp=32, ep=32, max_tokens_per_rank=256, quant="per-token", fuse_w1=True)
    per_token = {p.name: p for p in moekit.plan("deepseek-v3", dp=32, ep=32, max_tokens_per_rank=256, local_experts=16,
                                                quant="per-token")}["batched-fp8 (cuda)"]
    assert per_token.workspace_bytes == 1073741824 + 268435456 + 524288 + 6144 + 6144 + 1048576 + 256 + 256
    assert unfused.region("w1_out").shape == (16, 8192, 4096) and ours.region("w1_small").shape == (16, 64, 4096)
    assert ours.region("ep_recv").persistent
    assert sum(s.bytes for s in ours.sections) == ours.total_bytes


def test_recipes_are_the_tables_rows():
    """moekit.recipes() is the C++ recipe table: every name plans, with the row's operand dtypes and
    scale shapes (DeepSeek-V3 on one rank: 256 experts, M = 256, K = 7168)."""
    rows = moekit.recipes()
    assert [r["name"] for r in rows] == ["per-tensor", "per-token", "block128", "bf16", "fp16"]
    scales_per_expert = {"per-tensor": 1, "per-row": 256, "1x128": 256 * 7168 // 128, "none": 0}
    for r in rows:
        p = {p.name: p for p in moekit.plan("deepseek-v3", dp=1, ep=1, max_tokens_per_rank=256, quant=r["name"],
                                            device="cpu")}["batched-fp8 (cpu)"]
        assert p.quant == r["name"]
        assert p.region("a1q").dtype == r["activation_dtype"], r
        if r["activation_scales"] == "none":  # no scale region is declared at all
            assert "a1q_scale" not in [g.name for g in p.regions], r
        else:
            assert p.region("a1q_scale").bytes == 256 * scales_per_expert[r["activation_scales"]] * 4, r
        assert r["device_vs_cpu_tolerance"] > 0
    assert [r["fused_w1"] for r in rows] == [False, False, True, False, False]
    assert [r["cuda_experts"] for r in rows] == [True, True, True, True, True]
    with pytest.raises(moekit.Error, match="per-tensor, per-token, block128, bf16, fp16"):
        moekit.plan("deepseek-v3", quant="fp4")


@pytest.mark.parametrize("device,dispatch", [("cuda", None), ("cuda", "nccl-reference"), ("cpu", None)])
def test_plan_equals_cli_json(device, dispatch):
    args = [CLI, "plan", "--model", "kimi-k2", "--dp", "8", "--ep", "8", "--max-tokens-per-rank", "128", "--device",
            device, "--format", "json"] + (["--dispatch", dispatch] if dispatch else [])
    cli = json.loads(subprocess.run(args, check=True, capture_output=True, text=True).stdout)["plans"]
    py = moekit.plan("kimi-k2", dp=8, ep=8, max_tokens_per_rank=128, device=device, dispatch=dispatch)
    assert [p["name"] for p in cli] == [p.name for p in py]
    for c, p in zip(cli, py):
        assert (c["total_bytes"], c["workspace_bytes"]) == (p.total_bytes, p.workspace_bytes)
        assert [r["name"] for r in c["regions"]] == [r.name for r in p.regions]
        assert [r["bytes"] for r in c["regions"]] == [r.bytes for r in p.regions]


def test_plan_errors_are_moekit_errors():
    with pytest.raises(moekit.Error, match="dp = 0 must be >= 1"):
        moekit.plan("deepseek-v3", dp=0)
    with pytest.raises(moekit.Error, match="no prepare/finalize of that name"):
        moekit.plan("deepseek-v3", dispatch="magic")


@pytest.mark.parametrize("quant", ["per-token", "block128", "bf16"])
def test_forward_equals_the_cli(tmp_path, quant):
    model = small_model(tmp_path)
    T, seed = 6, 3
    out_file = tmp_path / "out.bin"
    subprocess.run([CLI, "run", "--model", model, "--dp", "1", "--tokens-per-rank", str(T), "--steps", "1",
                    "--device", "cpu", "--quant", quant, "--seed", str(seed), "--output", str(out_file)],
                   check=True, capture_output=True)
    cli_out = np.fromfile(out_file, dtype=np.uint16)
    w = moekit.synthetic_inputs(model, tokens=T, quant=quant, seed=seed)
    layer = moekit.MoeLayer(model, weights=w, max_tokens_per_rank=T, quant=quant)
    out = layer.forward(w["hidden"], w["router_logits"])
    assert out.dtype == np.uint16 and out.shape == (T, w["hidden"].shape[1])
    assert np.array_equal(out.reshape(-1), cli_out)
    # The workspace is the plan's total for this layout (CPU, dp = ep = 1).
    plans = {p.name: p for p in moekit.plan(model, dp=1, ep=1, max_tokens_per_rank=T, device="cpu", quant=quant)}
    assert layer.workspace_bytes == plans["batched-fp8 (cpu)"].total_bytes
    # In place, and chunked steps give the same bits.
    again = np.full_like(out, 0xFFFF)
    layer.forward(w["hidden"], w["router_logits"], out=again)
    assert np.array_equal(again, out)
    chunked = moekit.MoeLayer(model, weights=w, max_tokens_per_rank=4, quant=quant)
    assert np.array_equal(chunked.forward(w["hidden"], w["router_logits"]), out)
    if quant == "bf16":  # bf16 bits and no scales; an FP8 layer refuses them by name, never misreads them
        assert w["w1"].dtype == np.uint16 and w["w1_scale"].size == 0
        with pytest.raises(moekit.Error, match="w1: dtype uint16 where uint8 FP8 e4m3 codes is needed"):
            moekit.MoeLayer(model, weights=w, max_tokens_per_rank=T, quant="per-token")
    # enqueue with the step's most tokens of any rank declared (one rank: its own T).
    declared = np.full_like(out, 0xFFFF)
    layer.enqueue(w["hidden"], w["router_logits"], declared, max_tokens_any_rank=T)
    layer.check_status()
    assert np.array_equal(declared, out)


def test_bad_inputs_raise_moekit_error(tmp_path):
    model = small_model(tmp_path)
    w = moekit.synthetic_inputs(model, tokens=4)
    layer = moekit.MoeLayer(model, weights=w, max_tokens_per_rank=4)
    h, g = w["hidden"], w["router_logits"]
    cases = [
        ((h.astype(np.float32), g), "hidden: dtype float32 where bfloat16"),
        ((h, g.astype(np.float64)), "router_logits: dtype float64 where float32"),
        ((h[:, :100], g), "hidden: shape \\(4, 100\\) where \\(4, 2048\\)"),
        ((h, g[:3]), "router_logits: shape \\(3, 16\\) where \\(4, 16\\)"),
        ((np.asfortranarray(h), g), "hidden: not C-contiguous"),
        ((np.ascontiguousarray(np.asfortranarray(h)), g), None),  # a contiguous copy is fine
    ]
    for args, message in cases:
        if message is None:
            layer.forward(*args)
            continue
        with pytest.raises(moekit.Error, match=message):
            layer.forward(*args)
    out = np.empty_like(h)
    for most in (3, 5):  # under the rank's 4 tokens, over max_tokens_per_rank
        with pytest.raises(moekit.Error, match=f"max_tokens_any_rank = {most}"):
            layer.enqueue(h, g, out, max_tokens_any_rank=most)
    with pytest.raises(moekit.Error, match="tokens .* exceed|max_tokens_per_rank|must be"):
        moekit.MoeLayer(model, weights=w, max_tokens_per_rank=0)
    bad = dict(w)
    bad["w1"] = w["w1"][:, :, :-16]
    with pytest.raises(moekit.Error, match="w1: shape"):
        moekit.MoeLayer(model, weights=bad, max_tokens_per_rank=4)
    bad = dict(w)
    bad["w2_scale"] = w["w2_scale"].astype(np.float16)
    with pytest.raises(moekit.Error, match="w2_scale: dtype float16 where float32"):
        moekit.MoeLayer(model, weights=bad, max_tokens_per_rank=4)
    # Weights the model does not have, or that MoeLayer would not read, are refused, never ignored.
    with pytest.raises(moekit.Error, match=r"unknown weight keys \['gate_up_proj_bias'\]"):
        moekit.MoeLayer(model, weights={**w, "gate_up_proj_bias": w["w1_scale"]}, max_tokens_per_rank=4)
    with pytest.raises(moekit.Error, match="has no expert biases"):
        moekit.MoeLayer(model, weights={**w, "w1_bias": w["w1_scale"], "w2_bias": w["w1_scale"]}, max_tokens_per_rank=4)
    with pytest.raises(moekit.Error, match="routes without e_score_correction_bias"):
        moekit.MoeLayer(model, weights={**w, "e_score_correction_bias": np.zeros(16, np.float32)}, max_tokens_per_rank=4)


def test_expert_biases_are_required_where_the_model_has_them(tmp_path):
    """gpt-oss's experts have biases: the layer takes them (and computes them, tests/parity), and a
    gpt-oss layer without them is refused."""
    model = small_model(tmp_path, "gpt-oss-120b", experts=8)
    w = moekit.synthetic_inputs(model, tokens=3)
    assert w["w1_bias"].shape == (8, 2 * 2880) and w["w2_bias"].shape == (8, 2880)
    layer = moekit.MoeLayer(model, weights=w, max_tokens_per_rank=3)
    with_bias = layer(w["hidden"], w["router_logits"])
    no_bias = {k: v for k, v in w.items() if not k.endswith("_bias")}
    with pytest.raises(moekit.Error, match="has expert biases: pass w1_bias"):
        moekit.MoeLayer(model, weights=no_bias, max_tokens_per_rank=3)
    zero = {**w, "w2_bias": np.zeros_like(w["w2_bias"])}
    assert not np.array_equal(moekit.MoeLayer(model, weights=zero, max_tokens_per_rank=3)(w["hidden"], w["router_logits"]),
                              with_bias)


def test_shared_experts_are_part_of_the_layer(tmp_path):
    """DeepSeek-V3's shared expert: synthetic_inputs draws it (shared_*), the layer computes it, its
    checkpoint's 2-D shapes are taken as well; without it the layer is refused, unless asked to run
    the routed experts only; a model without shared experts refuses shared_* keys."""
    model = small_model(tmp_path, "deepseek-v3", experts=16, hidden_size=256, moe_intermediate_size=128, n_group=4,
                        topk_group=2, num_experts_per_tok=4)
    w = moekit.synthetic_inputs(model, tokens=3, quant="per-token")
    assert w["shared_w1"].shape == (1, 2 * 128, 256) and w["shared_w2"].shape == (1, 256, 128)
    layer = moekit.MoeLayer(model, weights=w, max_tokens_per_rank=3, quant="per-token")
    out = layer(w["hidden"], w["router_logits"])
    two_d = {**w, **{k: w[k][0] for k in ("shared_w1", "shared_w1_scale", "shared_w2", "shared_w2_scale")}}
    assert np.array_equal(moekit.MoeLayer(model, weights=two_d, max_tokens_per_rank=3, quant="per-token")(
        w["hidden"], w["router_logits"]), out)
    routed = {k: v for k, v in w.items() if not k.startswith("shared_")}
    with pytest.raises(moekit.Error, match="has shared experts .shared_intermediate_size = 128.: pass shared_w1"):
        moekit.MoeLayer(model, weights=routed, max_tokens_per_rank=3, quant="per-token")
    alone = moekit.MoeLayer(model, weights=routed, max_tokens_per_rank=3, quant="per-token", shared_experts=False)
    assert alone.workspace_bytes < layer.workspace_bytes
    assert not np.array_equal(alone(w["hidden"], w["router_logits"]), out)
    with pytest.raises(moekit.Error, match="runs with shared_experts=False"):
        moekit.MoeLayer(model, weights=w, max_tokens_per_rank=3, quant="per-token", shared_experts=False)
    with pytest.raises(moekit.Error, match="has no shared expert gate: drop shared_expert_gate"):
        moekit.MoeLayer(model, weights={**w, "shared_expert_gate": w["hidden"][0]}, max_tokens_per_rank=3,
                        quant="per-token")
    qwen = small_model(tmp_path)
    q = moekit.synthetic_inputs(qwen, tokens=3)
    with pytest.raises(moekit.Error, match="has no shared experts"):
        moekit.MoeLayer(qwen, weights={**q, "shared_w1": q["w1"][:1]}, max_tokens_per_rank=3)


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_nothing_grows_in_a_loop(tmp_path):
    model = small_model(tmp_path)
    w = moekit.synthetic_inputs(model, tokens=4)
    sizes = []
    for _ in range(6):
        layer = moekit.MoeLayer(model, weights=w, max_tokens_per_rank=4)
        layer.forward(w["hidden"], w["router_logits"])
        del layer
        try:
            moekit.MoeLayer(model, weights={**w, "w1": w["w1"][:1]}, max_tokens_per_rank=4)
        except moekit.Error:
            pass
        sizes.append(rss_bytes())
    assert sizes[-1] - sizes[1] < 8 << 20, f"RSS grew from {sizes[1]} to {sizes[-1]} bytes"


class ThreadGroup:
    """Ranks as threads of this process: the group interface moekit.MoeLayer takes (rank, size,
    all_gather), as moekit.TorchGroup gives it over torch.distributed."""

    def __init__(self, shared, rank):
        self.shared, self._rank = shared, rank

    def rank(self):
        return self._rank

    def size(self):
        return self.shared["size"]

    def all_gather(self, data):
        s = self.shared
        s["slots"][self._rank] = data
        s["barrier"].wait(timeout=60)
        out = list(s["slots"])
        s["barrier"].wait(timeout=60)  # nobody overwrites a slot before everyone has read
        return out


@pytest.mark.parametrize("quant", ["per-token", "block128"])
def test_expert_parallel_over_a_python_group_equals_the_cli(tmp_path, quant):
    import threading

    model = small_model(tmp_path)
    P, T, seed = 2, 5, 4
    out_file = tmp_path / "out.bin"
    subprocess.run([CLI, "run", "--model", model, "--dp", str(P), "--tokens-per-rank", str(T), "--steps", "1",
                    "--device", "cpu", "--quant", quant, "--seed", str(seed), "--output", str(out_file)],
                   check=True, capture_output=True)
    shared = {"size": P, "slots": [None] * P, "barrier": threading.Barrier(P)}
    outs, errors = [None] * P, []

    def rank_main(r):
        try:
            w = moekit.synthetic_inputs(model, tokens=T, quant=quant, seed=seed, rank=r, ranks=P)
            layer = moekit.MoeLayer(model, weights=w, max_tokens_per_rank=T, quant=quant,
                                    group=ThreadGroup(shared, r))
            assert (layer.rank, layer.ranks) == (r, P)
            assert w["w1"].shape[0] == 16 // P
            outs[r] = layer.forward(w["hidden"], w["router_logits"])
            del layer
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)
            shared["barrier"].abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for r in range(P):
        cli_out = np.fromfile(f"{out_file}.rank{r}", dtype=np.uint16)
        assert np.array_equal(outs[r].reshape(-1), cli_out), f"rank {r} differs from moekit run --dp {P}"


def test_a_group_that_fails_raises_moekit_error(tmp_path):
    model = small_model(tmp_path)
    w = moekit.synthetic_inputs(model, tokens=2, rank=0, ranks=2)

    class Broken:
        def rank(self):
            return 0

        def size(self):
            return 2

        def all_gather(self, data):
            raise RuntimeError("peer 1 is gone")

    with pytest.raises(moekit.Error, match="all_gather raised: .*peer 1 is gone"):
        moekit.MoeLayer(model, weights=w, max_tokens_per_rank=2, group=Broken())

    class OutOfStep(Broken):  # rank 1 is one collective ahead (it skipped one after raising)
        def all_gather(self, data):
            ahead = (int.from_bytes(data[:8], "little") + 1).to_bytes(8, "little") + data[8:]
            return [data, ahead]

    with pytest.raises(moekit.Error, match="rank 1 is at collective 1 .* where this rank is at 0"):
        moekit.MoeLayer(model, weights=w, max_tokens_per_rank=2, group=OutOfStep())

    class NotBytes(Broken):
        def all_gather(self, data):
            return [data, 7]

    with pytest.raises(moekit.Error, match="must return a list of bytes"):
        moekit.MoeLayer(model, weights=w, max_tokens_per_rank=2, group=NotBytes())


def test_device_errors(tmp_path):
    model = small_model(tmp_path)
    w = moekit.synthetic_inputs(model, tokens=2)
    if moekit._moekit.cuda_device_count() == 0:
        with pytest.raises(moekit.Error, match="device = 'cuda' but"):
            moekit.MoeLayer(model, weights=w, max_tokens_per_rank=2, device="cuda")
    with pytest.raises(moekit.Error, match="device = 'tpu'"):
        moekit.MoeLayer(model, weights=w, max_tokens_per_rank=2, device="tpu")
    with pytest.raises(moekit.Error, match="rank = 2 of ranks = 2"):
        moekit.synthetic_inputs(model, tokens=2, rank=2, ranks=2)


def test_arrange_w1_block_pairs():
    """HF's halves (gate rows, then up rows) to block128's block pairs: per 256 rows a gate block then
    its up block, the block scales in the same order; nothing re-rounded."""
    rng = np.random.default_rng(3)
    E, I, K = 2, 256, 160
    w1 = rng.integers(0, 256, size=(E, 2 * I, K), dtype=np.uint8)
    kb = (K + 127) // 128
    scale = rng.random((E, 2 * I // 128 * kb), dtype=np.float32)
    pairs, pairs_scale = moekit.arrange_w1_block_pairs(w1, scale)
    for b in range(I // 128):
        np.testing.assert_array_equal(pairs[:, 256 * b:256 * b + 128], w1[:, 128 * b:128 * b + 128])
        np.testing.assert_array_equal(pairs[:, 256 * b + 128:256 * b + 256], w1[:, I + 128 * b:I + 128 * b + 128])
        np.testing.assert_array_equal(pairs_scale[:, 2 * b * kb:(2 * b + 1) * kb], scale[:, b * kb:(b + 1) * kb])
        np.testing.assert_array_equal(pairs_scale[:, (2 * b + 1) * kb:(2 * b + 2) * kb],
                                      scale[:, (I // 128 + b) * kb:(I // 128 + b + 1) * kb])
    # The ops' 3-D scale shape (E, 2I/128, ceil(K/128)): the same move, the shape kept.
    pairs3, pairs_scale3 = moekit.arrange_w1_block_pairs(w1, scale.reshape(E, 2 * I // 128, kb))
    np.testing.assert_array_equal(pairs3, pairs)
    assert pairs_scale3.shape == (E, 2 * I // 128, kb)
    np.testing.assert_array_equal(pairs_scale3.reshape(E, -1), pairs_scale)
    with pytest.raises(moekit.Error, match="multiple of 128"):
        moekit.arrange_w1_block_pairs(w1[:, :384], scale)
    with pytest.raises(moekit.Error, match="w1_scale"):
        moekit.arrange_w1_block_pairs(w1, scale[:, :-1])
    with pytest.raises(moekit.Error, match=r"w1_scale: shape \(2, 2, 4\)"):  # transposed blocks
        moekit.arrange_w1_block_pairs(w1, scale.reshape(E, kb, 2 * I // 128))


def test_w1_as_checkpoints_store_it(tmp_path):
    """W1 in the checkpoint's gate-then-up rows (the default) is arranged by the layer under block128:
    the same bits as an arranged W1 passed with w1_layout="block_pairs"; block scales in
    weight_scale_inv's 3-D shape are read as they are; "block_pairs" where the recipe reads W1 as
    stored is refused (it would compute something else), and so is an unknown layout."""
    model = small_model(tmp_path, "deepseek-v3", experts=16, hidden_size=256, moe_intermediate_size=256, n_group=4,
                        topk_group=2, num_experts_per_tok=4)
    w = moekit.synthetic_inputs(model, tokens=5, quant="block128")
    E, N, K = w["w1"].shape
    layer = moekit.MoeLayer(model, weights=w, max_tokens_per_rank=5, quant="block128")
    out = layer(w["hidden"], w["router_logits"])
    assert "w1" not in layer._runtime._held[0]  # arranged into the runtime's own copy
    pairs, pairs_scale = moekit.arrange_w1_block_pairs(w["w1"], w["w1_scale"])
    shared_pairs, shared_scale = moekit.arrange_w1_block_pairs(w["shared_w1"], w["shared_w1_scale"])
    arranged = {**w, "w1": pairs, "w1_scale": pairs_scale, "shared_w1": shared_pairs, "shared_w1_scale": shared_scale}
    same = moekit.MoeLayer(model, weights=arranged, max_tokens_per_rank=5, quant="block128", w1_layout="block_pairs")
    assert np.array_equal(same(w["hidden"], w["router_logits"]), out)
    blocks = {**w, "w1_scale": w["w1_scale"].reshape(E, N // 128, K // 128),
              "w2_scale": w["w2_scale"].reshape(E, K // 128, -1)}
    assert np.array_equal(moekit.MoeLayer(model, weights=blocks, max_tokens_per_rank=5, quant="block128")(
        w["hidden"], w["router_logits"]), out)
    # Passing the halves as if arranged is the mistake the default prevents: a different layer.
    wrong = moekit.MoeLayer(model, weights=w, max_tokens_per_rank=5, quant="block128", w1_layout="block_pairs")
    assert not np.array_equal(wrong(w["hidden"], w["router_logits"]), out)
    t = moekit.synthetic_inputs(model, tokens=5, quant="per-token")
    with pytest.raises(moekit.Error, match="w1_layout = 'block_pairs' is block128's arranged W1"):
        moekit.MoeLayer(model, weights=t, max_tokens_per_rank=5, quant="per-token", w1_layout="block_pairs")
    with pytest.raises(moekit.Error, match="w1_layout = 'pairs'"):
        moekit.MoeLayer(model, weights=t, max_tokens_per_rank=5, quant="per-token", w1_layout="pairs")


def test_bf16_router_logits_are_read_as_float32(tmp_path):
    """A torch gate's bfloat16 logits (what transformers' Qwen3 / Mixtral gates return) route as their
    float32 values do."""
    torch = pytest.importorskip("torch")
    model = small_model(tmp_path)
    w = moekit.synthetic_inputs(model, tokens=4)
    layer = moekit.MoeLayer(model, weights=w, max_tokens_per_rank=4)
    hidden = torch.from_numpy(w["hidden"].view(np.int16)).view(torch.bfloat16)
    logits = torch.from_numpy(w["router_logits"]).to(torch.bfloat16)
    assert torch.equal(layer(hidden, logits), layer(hidden, logits.float()))


@pytest.mark.parametrize("quant", ["per-token", "block128"])
def test_redundant_experts_change_where_not_what(tmp_path, quant):
    """A runtime holding 24 slots for 16 experts (EPLB's placement of a skewed load): the weights are
    the slots' experts, the output equals the unreplicated layer's bit for bit, each slot's pairs are
    counted and rebalance_experts turns the counts into a placement that runs too."""
    model = small_model(tmp_path)
    T, E, slots = 20, 16, 24
    w = moekit.synthetic_inputs(model, tokens=T, quant=quant, seed=5)
    want = moekit.MoeLayer(model, weights=w, max_tokens_per_rank=T, quant=quant).forward(w["hidden"],
                                                                                        w["router_logits"])
    load = [1.0] * E
    load[4] = 30.0
    placement = moekit.rebalance_experts(load, slots)
    assert len(placement) == slots and placement.count(4) > 1 and sorted(set(placement)) == list(range(E))
    rt = moekit.Runtime(model, max_tokens_per_rank=T, quant=quant, local_experts=slots)
    per_slot = {k: np.ascontiguousarray(w[k][placement]) for k in ("w1", "w1_scale", "w2", "w2_scale")}
    layer = rt.add_layer(per_slot, placement=placement)
    assert rt.placement(layer) == placement
    np.testing.assert_array_equal(rt.forward(layer, w["hidden"], w["router_logits"]), want)
    counts = rt.expert_load(layer)
    assert counts.shape == (slots,) and counts.sum() == T * 8  # qwen3: top-8
    assert rt.expert_load(layer).sum() == 0  # reading clears
    # Each expert's load is the sum of its slots'; the default placement is round robin.
    logical = np.zeros(E)
    np.add.at(logical, placement, counts)
    again = moekit.rebalance_experts(list(logical), slots)
    rt2 = moekit.Runtime(model, max_tokens_per_rank=T, quant=quant, local_experts=slots)
    layer2 = rt2.add_layer({k: np.ascontiguousarray(w[k][again]) for k in ("w1", "w1_scale", "w2", "w2_scale")},
                           placement=again)
    np.testing.assert_array_equal(rt2.forward(layer2, w["hidden"], w["router_logits"]), want)
    assert moekit.round_robin_placement(4, 6) == [0, 1, 2, 3, 0, 1]
    with pytest.raises(moekit.Error, match="make it with 24 slots"):
        rt.add_layer(per_slot, placement=moekit.round_robin_placement(E, 20))
    with pytest.raises(moekit.Error, match="expert 4 is in no slot"):
        rt.add_layer(per_slot, placement=[e if e != 4 else 5 for e in placement])


def test_cpu_level_check_names_the_missing_flags(tmp_path):
    """A package built for a CPU level this machine lacks raises ImportError naming the flags (and how
    to rebuild), never dies on SIGILL; the build's own level is one this machine has."""
    import platform

    from moekit import _build, _cpu

    assert _cpu.missing_flags(_build.CPU_ARCH) == []
    if platform.machine() != "x86_64":
        pytest.skip("the check covers x86-64 levels")
    old = tmp_path / "cpuinfo"
    old.write_text("processor\t: 0\nflags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx\n")
    assert _cpu.missing_flags("x86-64-v3", str(old)) == ["avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"]
    assert _cpu.missing_flags("x86-64-v2", str(old)) == []
    assert _cpu.missing_flags("native", str(old)) == []
    with pytest.raises(ImportError, match="x86-64-v3.*avx2"):
        import unittest.mock

        with unittest.mock.patch.object(_cpu, "missing_flags", lambda level: ["avx2"]):
            _cpu.check("x86-64-v3")


def _import_moekit_in_child(tmp_path, torch_init):
    """`import moekit` in a fresh interpreter whose `torch` is a stand-in package (torch_init: its
    __init__.py; None: torch absent), the package under test first on the path. (rc, stdout, stderr)"""
    stand_in = tmp_path / "stand_in"
    stand_in.mkdir()
    if torch_init is not None:
        (stand_in / "torch").mkdir()
        (stand_in / "torch" / "__init__.py").write_text(torch_init)
    package_root = os.path.dirname(os.path.dirname(moekit.__file__))
    code = ("import sys\n"
            f"sys.path[:0] = [{str(stand_in)!r}, {package_root!r}]\n"
            + ("" if torch_init is not None else "sys.modules['torch'] = None\n")
            + "import moekit\nprint('torch', moekit.ops._torch is not None, moekit.ops.torch_op_error)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout, r.stderr


def test_a_torch_that_does_not_import_is_named_not_called_missing(tmp_path):
    """An installed torch whose import fails (an older libnccl.so.2 loaded first, say) raises
    ImportError with torch's own reason; only a torch that is not installed leaves moekit on NumPy."""
    rc, out, err = _import_moekit_in_child(
        tmp_path, "raise ImportError('libtorch_cuda.so: undefined symbol: ncclCommInitRankScalable')\n")
    assert rc != 0, out
    assert "ImportError: moekit: torch is installed but does not import" in err, err
    assert "undefined symbol: ncclCommInitRankScalable" in err and "import torch first" in err, err
    assert "torch is not installed" not in err + out


def test_without_torch_moekit_runs_on_numpy(tmp_path):
    rc, out, err = _import_moekit_in_child(tmp_path, None)
    assert rc == 0, err
    assert out.split() == ["torch", "False", "torch", "is", "not", "installed"], out




def test_device_copies_keep_bf16_weights_bf16():
    """The CUDA load's host-to-torch step (_to_torch, run here on the CPU): FP8 codes (uint8) become
    float8_e4m3fn, the bf16 recipe's weights (uint16 bits) bfloat16 of the same shape, never FP8 views
    of twice the columns."""
    torch = pytest.importorskip("torch")
    arrays = {"w1": np.arange(2 * 4 * 8, dtype=np.uint16).reshape(2, 4, 8), "w1_scale": np.zeros((2, 0), np.float32),
              "w2": np.zeros((2, 8, 2), np.uint8), "w2_scale": np.ones((2, 8), np.float32)}
    t = moekit._to_torch(arrays, "cpu")
    assert t["w1"].dtype == torch.bfloat16 and tuple(t["w1"].shape) == (2, 4, 8)
    assert t["w1"].view(torch.int16)[1, 3, 7].item() == 2 * 4 * 8 - 1
    assert t["w2"].dtype == torch.float8_e4m3fn and tuple(t["w2"].shape) == (2, 8, 2)
    assert t["w2_scale"].dtype == torch.float32 and not arrays  # each host array dropped once copied
    # The fp16 recipe's weights become float16 (the router's and the hidden states stay bfloat16).
    arrays = {"w1": np.full((2, 4, 8), 0x3C00, np.uint16), "hidden": np.zeros((3, 8), np.uint16)}
    t = moekit._to_torch(arrays, "cpu", "fp16")
    assert t["w1"].dtype == torch.float16 and float(t["w1"][1, 3, 7]) == 1.0
    assert t["hidden"].dtype == torch.bfloat16


def test_a_float16_checkpoint_config_plans_fp16(tmp_path):
    """config.json's torch_dtype float16 (no quantization_config): quant "auto" plans fp16, the
    synthetic weights are fp16 values, and "bf16" is still asked for by name."""
    src = os.path.join(os.path.dirname(__file__), "..", "..", "models", "qwen3-30b-a3b.json")
    cfg = json.load(open(src))
    cfg["torch_dtype"] = "float16"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert moekit.plan(str(path), dp=1, ep=1, max_tokens_per_rank=4, device="cpu")[0].quant == "fp16"
    assert moekit.plan(str(path), dp=1, ep=1, max_tokens_per_rank=4, device="cpu", quant="bf16")[0].quant == "bf16"
    d = moekit.synthetic_inputs(str(path), tokens=2, num_experts=8)
    w1 = d["w1"].view(np.float16)  # uint16 bits of the recipe's dtype
    assert np.isfinite(w1).all() and 0 < np.abs(w1).max() < 1
