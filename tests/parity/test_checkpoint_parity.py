"""The parity cases run from checkpoint directories: transformers writes a small model of each family
with save_pretrained (sharded, with its index: the layout as published), moekit.Checkpoint loads each
MoE layer from the directory, and transformers' from_pretrained of the same directory is the
reference (its MoE block, moekit's activation quantization emulated as in
test_transformers_parity.py). The weights are made FP8-exact in the recipe's scheme before saving,
so loading requantizes them to themselves and the tolerance is the in-memory parity test's.

Also: a DeepSeek-V3 FP8 checkpoint as published (float8_e4m3fn weights with 128x128
weight_scale_inv, quantization_config fp8) loads as stored and runs bit for bit as the same codes
passed in memory; several layers share one Runtime (one workspace allocation); `moekit run
--checkpoint --check` and `moekit plan --checkpoint` read the same directories.
"""
import json
import os
import subprocess

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import moekit  # noqa: E402
import test_transformers_parity as parity  # noqa: E402

FAMILIES = ["deepseek_v3", "qwen2_moe", "qwen3_moe_norm", "mixtral", "gpt_oss", "granitemoe", "jamba"]
# Small attention for the saved model (the MoE block is what is tested).
ATTENTION = {"num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 64, "head_dim": 32,
             "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16}


def moe_block(layer):
    """A decoder layer's MoE block, wherever its family keeps it (mlp, block_sparse_moe, feed_forward)."""
    for attr in ("mlp", "block_sparse_moe", "feed_forward"):
        if hasattr(layer, attr):
            return getattr(layer, attr)
    return None


def save_checkpoint(case, scheme, path, seed=1, fp8_exact=True, dtype=None):
    """A CausalLM of `case`'s config whose MoE blocks are parity.build_block's (seed + layer), made
    FP8-exact in `scheme`, saved by transformers (float32, or `dtype`, sharded). Returns the MoE layer
    numbers."""
    model_type, config_cls, module, block_cls, keys = parity.CASES[case]
    cfg = getattr(transformers, config_cls)(**{**ATTENTION, **keys})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    layers = []
    for i, layer in enumerate(model.model.layers):
        mlp = moe_block(layer)
        if type(mlp).__name__ != block_cls:
            continue
        block, _ = parity.build_block(case, seed + i)
        if fp8_exact:
            parity.arrange(block, scheme, case in parity.TRANSPOSED)
            parity.arrange_shared(block, scheme)
        mlp.load_state_dict(block.state_dict())
        layers.append(i)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(str(path), max_shard_size="300KB")
    assert (path / "model.safetensors.index.json").exists(), "the test checkpoint is meant to be sharded"
    return layers


def reference(block, case, scheme, x):
    """The block's output with moekit's activation quantization emulated, and its router logits."""
    mlp = parity.shared_mlp(block)
    router = parity.router_of(block)
    with torch.no_grad():
        routed = router(x)
        logits = (routed[0] if isinstance(routed, tuple) else routed).float().contiguous()
        if case in parity.TRANSPOSED:
            return parity.reference_transposed(block, x, scheme), logits
        w1 = list(block.experts.gate_up_proj) + ([mlp.gate_proj.weight, mlp.up_proj.weight] if mlp else [])
        w2 = list(block.experts.down_proj) + ([mlp.down_proj.weight] if mlp else [])
        T = x.shape[0]
        with parity.emulated_activation_quant({"w1": w1, "w2": w2}, scheme, x.abs().amax(),
                                              w1_out_bf16=scheme != "block128"):
            ref = block(x.reshape(1, T, -1))
        return (ref[0] if isinstance(ref, tuple) else ref).reshape(T, -1), logits


def to_bits(x):
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def from_bits(out):
    return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16).float()


@pytest.mark.parametrize("scheme", parity.SCHEMES)
@pytest.mark.parametrize("case", FAMILIES)
def test_checkpoint_matches_transformers(tmp_path, case, scheme):
    path = tmp_path / case
    layers = save_checkpoint(case, scheme, path)
    ck = moekit.Checkpoint(str(path))
    assert ck.moe_layers == layers
    # The eager experts (one F.linear per expert, where the emulation quantizes their inputs), as the
    # in-memory parity blocks run.
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                                  experts_implementation="eager").eval()
    T = 37
    x = parity.bf16(torch.randn(T, parity.K, generator=torch.Generator().manual_seed(5)))
    rt = moekit.Runtime(ck.config_path, max_tokens_per_rank=T, quant=scheme, device=parity.DEVICE)
    loaded = [ck.load_layer(L, quant=scheme, device=parity.DEVICE) for L in layers]
    assert "quantized to" in loaded[0].note and loaded[0].quant == scheme
    for lw in loaded:
        rt.add_layer(lw)
    for index, L in enumerate(layers):
        ref, logits = reference(moe_block(ref_model.model.layers[L]), case, scheme, x)
        xin = to_bits(x) if parity.DEVICE == "cpu" else x.to(torch.bfloat16).cuda()
        mine = loaded[index].router_logits(xin)
        mine = mine if parity.DEVICE == "cpu" else mine.cpu().numpy()
        np.testing.assert_allclose(mine, logits.numpy(), rtol=1e-4, atol=1e-4)  # the router, from the file
        if parity.DEVICE == "cuda":
            got = rt.forward(index, x.to(torch.bfloat16).cuda(), torch.from_numpy(logits.numpy()).cuda()).float().cpu()
        else:
            got = from_bits(rt.forward(index, to_bits(x), logits.numpy()))
        err = float((got - ref).norm() / ref.norm())
        assert err < parity.tolerance(scheme), f"{case} {scheme} layer {L}: relative error {err:.3e}"
        print(f"{case:16s} {scheme:10s} layer {L}: relative error from the checkpoint {err:.2e}")


def rewrite_checkpoint(src, dst, convert, quantization_config):
    """`src` (a checkpoint transformers saved, sharded) rewritten into `dst` as a release stores it:
    convert(name, tensor) gives the tensors that replace it (None: kept as it is), shard by shard, the
    index following; config.json with `quantization_config`."""
    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        out = {}
        for name, t in load_file(str(src / shard)).items():
            out.update(convert(name, t) or {name: t})
        save_file(out, str(dst / shard), metadata={"format": "pt"})
        weight_map.update({name: shard for name in out})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))


def write_fp8_blocks(src, dst):
    """`src` (a bf16/fp32 DeepSeek-style checkpoint) as DeepSeek-V3 publishes its FP8 release: every
    expert and shared-expert projection float8_e4m3fn with float32 weight_scale_inv in 128x128 blocks
    (w = code * scale), quantization_config fp8 with weight_block_size [128, 128]."""
    def convert(name, t):
        if not (".mlp." in name and "_proj.weight" in name and "experts" in name):
            return None
        n, k = t.shape
        blocks = t.float().reshape(n // 128, 128, k // 128, 128)
        scale = blocks.abs().amax(dim=(1, 3), keepdim=True) / parity.FP8_MAX
        return {name: (blocks / scale).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(n, k),
                name + "_scale_inv": scale.reshape(n // 128, k // 128).contiguous()}

    rewrite_checkpoint(src, dst, convert, {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                           "weight_block_size": [128, 128]})


def to_mxfp4(w):
    """(E, R, C) float -> gpt-oss's MXFP4: (E, R, C / 32, 16) packed e2m1 codes (the lower nibble the
    first) and (E, R, C / 32) e8m0 exponents, each group's exponent the smallest putting it within 6."""
    from transformers.integrations.mxfp4 import FP4_VALUES

    E_, R, C = w.shape
    g = w.float().reshape(E_, R, C // 32, 32)
    amax = g.abs().amax(-1).clamp_min(2.0 ** -100)
    exp = torch.ceil(torch.log2(amax / 6.0))
    scaled = g / torch.exp2(exp)[..., None]
    lut = torch.tensor(FP4_VALUES[:8])
    idx = (scaled.abs()[..., None] - lut).abs().argmin(-1)
    nib = (idx | ((scaled < 0).long() << 3)).to(torch.uint8)
    packed = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return packed.contiguous(), (exp + 127).to(torch.uint8).contiguous()


def write_mxfp4(src, dst):
    """`src` (a gpt-oss checkpoint transformers saved) as gpt-oss is released: every expert tensor
    MXFP4 (gate_up_proj_blocks / _scales, down_proj_blocks / _scales: rows the output features),
    quantization_config mxfp4. Returns {tensor name: (blocks, scales)}."""
    packed = {}

    def convert(name, t):
        if not (name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj")):
            return None
        packed[name] = to_mxfp4(t.transpose(1, 2))  # HF's (E, in, out) -> rows the outputs
        return {name + "_blocks": packed[name][0], name + "_scales": packed[name][1]}

    rewrite_checkpoint(src, dst, convert, {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]})
    return packed


def test_gpt_oss_mxfp4_release_matches_transformers(tmp_path):
    """gpt-oss as released (MXFP4 experts): moekit converts them exactly to FP8 at load; the reference
    is transformers' block with the weights its Mxfp4 integration dequantizes (convert_moe_packed_tensors),
    moekit's activation quantization emulated: the in-memory parity's tolerance, on this module's device."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    layers = save_checkpoint("gpt_oss", "per-token", tmp_path / "fp32", fp8_exact=False)
    packed = write_mxfp4(tmp_path / "fp32", tmp_path / "mxfp4")
    ck = moekit.Checkpoint(str(tmp_path / "mxfp4"))
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "fp32"), dtype=torch.float32,
                                                                  experts_implementation="eager").eval()
    T = 29
    x = parity.bf16(torch.randn(T, parity.K, generator=torch.Generator().manual_seed(6)))
    rt = moekit.Runtime(ck.config_path, max_tokens_per_rank=T, device=parity.DEVICE)  # quant auto: per-token
    for L in layers:
        lw = ck.load_layer(L, device=parity.DEVICE)
        assert lw.quant == "per-token" and "MXFP4 (fused tensors), converted exactly" in lw.note, lw.note
        rt.add_layer(lw)
    for index, L in enumerate(layers):
        experts = ref_model.model.layers[L].mlp.experts
        with torch.no_grad():
            for proj in ("gate_up_proj", "down_proj"):
                blocks, scales = packed[f"model.layers.{L}.mlp.experts.{proj}"]
                getattr(experts, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
        ref, logits = reference(ref_model.model.layers[L].mlp, "gpt_oss", "per-token", x)
        if parity.DEVICE == "cuda":
            got = rt.forward(index, x.to(torch.bfloat16).cuda(), logits.cuda()).float().cpu()
        else:
            got = from_bits(rt.forward(index, to_bits(x), logits.numpy()))
        err = float((got - ref).norm() / ref.norm())
        assert err < parity.tolerance("per-token"), f"gpt-oss MXFP4 layer {L}: relative error {err:.3e}"
        print(f"gpt_oss MXFP4 layer {L}: relative error from the released layout {err:.2e}")


def test_deepseek_fp8_blocks_load_as_stored_and_run_as_in_memory(tmp_path):
    layers = save_checkpoint("deepseek_v3", "block128", tmp_path / "bf16", fp8_exact=False)
    write_fp8_blocks(tmp_path / "bf16", tmp_path / "fp8")
    ck = moekit.Checkpoint(str(tmp_path / "fp8"))
    loaded = ck.load_layer(layers[0])  # auto: the checkpoint's block128
    assert loaded.quant == "block128" and "loaded as stored (block128)" in loaded.note, loaded.note
    # The codes are the file's, byte for byte (gate rows then up rows).
    from safetensors import safe_open

    files = json.loads((tmp_path / "fp8" / "model.safetensors.index.json").read_text())["weight_map"]
    name = f"model.layers.{layers[0]}.mlp.experts.3.up_proj.weight"
    with safe_open(str(tmp_path / "fp8" / files[name]), "pt") as f:
        up = f.get_tensor(name).view(torch.uint8).numpy()
    I = up.shape[0]
    np.testing.assert_array_equal(loaded.weights["w1"][3, I:], up)
    T = 19
    x = to_bits(parity.bf16(torch.randn(T, parity.K, generator=torch.Generator().manual_seed(3))))
    logits = loaded.router_logits(x)
    rt = moekit.Runtime(ck.config_path, max_tokens_per_rank=T)
    rt.add_layer(loaded)
    layer = moekit.MoeLayer(ck.config_path, weights=loaded.weights, max_tokens_per_rank=T)
    np.testing.assert_array_equal(rt.forward(0, x, logits), layer(x, logits))


def test_layers_share_one_runtime(tmp_path):
    layers = save_checkpoint("qwen2_moe", "per-token", tmp_path / "ck")
    assert len(layers) == 2
    ck = moekit.Checkpoint(str(tmp_path / "ck"))
    loaded = [ck.load_layer(L) for L in layers]
    before = moekit.workspace_allocations()
    rt = moekit.Runtime(ck.config_path, max_tokens_per_rank=8)
    for lw in loaded:
        rt.add_layer(lw)
    assert moekit.workspace_allocations() - before == 1 and rt.num_layers == 2
    x = to_bits(parity.bf16(torch.randn(8, parity.K, generator=torch.Generator().manual_seed(4))))
    for index, lw in enumerate(loaded):
        logits = lw.router_logits(x)
        alone = moekit.MoeLayer(ck.config_path, weights=lw.weights, max_tokens_per_rank=8)
        np.testing.assert_array_equal(rt.forward(index, x, logits), alone(x, logits))
    # The router's logits from a torch tensor: a tensor, the same values.
    xt = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    np.testing.assert_allclose(loaded[0].router_logits(xt).numpy(), loaded[0].router_logits(x), rtol=1e-5, atol=1e-6)
    # Rank 1 of 2 reads only its experts, and gets the upper half.
    half = ck.load_layer(layers[0], rank=1, ranks=2)
    np.testing.assert_array_equal(half.weights["w1"], loaded[0].weights["w1"][8:])


# The bf16 recipe against transformers' block directly, nothing emulated: moekit rounds W1's output
# and the activation's to bf16 and sums in fp32, the block runs in fp32 on the same bf16 weights
# (a few bf16 roundings of 2^-9 relative each: 3.7-4.2e-3 measured on the CPU over the 7 families).
# A GPU adds its GEMMs' summation order (check::device_vs_cpu_tolerance's bf16 row, 8e-3).
BF16_TOL = {"cpu": 6e-3, "cuda": 1.2e-2}
# fp16 rounds W1's output and the activation 8x finer: what is left is the layer's own bf16 output
# (~1.7e-3 measured on the CPU, 1.69-2.16e-3); a recipe that kept bf16 intermediates would give ~4e-3.
FP16_TOL = {"cpu": 3e-3, "cuda": 4e-3}


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("case", FAMILIES)
def test_bf16_checkpoint_matches_transformers(tmp_path, case, dtype):
    """A bf16 (fp16) checkpoint as shipped (save_pretrained in bfloat16 / float16, no
    quantization_config) runs in its own dtype by default (quant "auto", from config.json's dtype): its
    values read bit for bit, the output (bf16, the layer's) within bf16 roundings of the fp32 block
    (transformers' from_pretrained of the same directory)."""
    path = tmp_path / case
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16
    layers = save_checkpoint(case, None, path, fp8_exact=False, dtype=torch_dtype)
    ck = moekit.Checkpoint(str(path))
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                                  experts_implementation="eager").eval()
    T = 37
    x = parity.bf16(torch.randn(T, parity.K, generator=torch.Generator().manual_seed(6)))
    rt = moekit.Runtime(ck.config_path, max_tokens_per_rank=T, device=parity.DEVICE)
    loaded = [ck.load_layer(L, device=parity.DEVICE) for L in layers]
    assert loaded[0].quant == dtype and f"read as {dtype}, bit for bit" in loaded[0].note, loaded[0].note
    for lw in loaded:
        rt.add_layer(lw)
    for index, L in enumerate(layers):
        block = moe_block(ref_model.model.layers[L])
        with torch.no_grad():
            routed = parity.router_of(block)(x)
            logits = (routed[0] if isinstance(routed, tuple) else routed).float().contiguous()
            ref = block(x.reshape(1, T, -1))
            ref = (ref[0] if isinstance(ref, tuple) else ref).reshape(T, -1)
        if parity.DEVICE == "cuda":
            got = rt.forward(index, x.to(torch.bfloat16).cuda(), logits.cuda()).float().cpu()
        else:
            got = from_bits(rt.forward(index, to_bits(x), logits.numpy()))
        err = float((got - ref).norm() / ref.norm())
        tol = (BF16_TOL if dtype == "bf16" else FP16_TOL)[parity.DEVICE]
        assert err < tol, f"{case} {dtype} layer {L}: relative error {err:.3e}"
        print(f"{case:16s} {dtype}       layer {L}: relative error from the fp32 block {err:.2e}")


def test_the_readme_checkpoint_example_runs(tmp_path):
    """The README's checkpoint example, as written (extracted from README.md, so the two cannot drift),
    on a DeepSeek-V3 checkpoint transformers wrote, on this module's device (MOEKIT_PARITY_DEVICE):
    every layer on one runtime, the output the layer's own on the same weights, bit for bit."""
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    blocks = [b.split("```", 1)[0] for b in readme.split("```python\n")[1:]]
    example = [b for b in blocks if "moekit.Checkpoint(" in b]
    assert len(example) == 1 and '"/path/to/DeepSeek-V3"' in example[0], "the README has one checkpoint example"
    layers = save_checkpoint("deepseek_v3", "block128", tmp_path / "ck", fp8_exact=False)
    hidden = parity.bf16(torch.randn(5, parity.K, generator=torch.Generator().manual_seed(8))).to(torch.bfloat16)
    hidden = hidden.to(parity.DEVICE)
    scope = {"moekit": moekit, "device": parity.DEVICE, "hidden": hidden}
    code = example[0].replace('"/path/to/DeepSeek-V3"', repr(str(tmp_path / "ck")))
    exec(compile(code, "README.md", "exec"), scope)
    out, rt, lws = scope["out"], scope["rt"], scope["layers"]
    assert rt.num_layers == len(layers) == len(lws) and out.shape == (5, parity.K) and out.dtype == torch.bfloat16
    assert out.device.type == parity.DEVICE and torch.isfinite(out.float()).all()
    if parity.DEVICE == "cuda":
        assert all(w.is_cuda for w in lws[0].weights.values()) and lws[0].router_weight.is_cuda
    alone = moekit.MoeLayer(scope["ck"].config_path, weights=lws[0].weights, max_tokens_per_rank=128)
    assert torch.equal(out.view(torch.int16), alone(hidden, lws[0].router_logits(hidden)).view(torch.int16))
    # A CUDA runtime given a layer loaded onto the host names the fix.
    if parity.DEVICE == "cuda":
        host = scope["ck"].load_layer(layers[0])
        with pytest.raises(moekit.Error, match="load_layer\\(.*device='cuda:0'\\)"):
            rt.add_layer(host)


def test_cli_runs_and_plans_a_checkpoint(tmp_path):
    cli = os.environ.get("MOEKIT_CLI")
    if not cli:
        pytest.skip("MOEKIT_CLI (the moekit binary) not set")
    save_checkpoint("deepseek_v3", "block128", tmp_path / "bf16", fp8_exact=False)
    write_fp8_blocks(tmp_path / "bf16", tmp_path / "fp8")
    run = subprocess.run([cli, "run", "--checkpoint", str(tmp_path / "fp8"), "--device", "cpu", "--dp", "2",
                          "--tokens-per-rank", "5", "--steps", "1", "--check"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "loaded as stored (block128)" in run.stdout and run.stdout.count("check layer") == 2, run.stdout
    plan = subprocess.run([cli, "plan", "--checkpoint", str(tmp_path / "fp8"), "--dp", "2", "--ep", "2",
                           "--max-tokens-per-rank", "8"], capture_output=True, text=True)
    assert plan.returncode == 0, plan.stderr
    assert "whole model per GPU: 2 MoE layers on one runtime" in plan.stdout, plan.stdout
    bad = subprocess.run([cli, "run", "--checkpoint", str(tmp_path / "fp8"), "--layers", "7-9", "--device", "cpu",
                          "--dp", "1"], capture_output=True, text=True)
    assert bad.returncode != 0 and "no MoE layer of the checkpoint lies there" in bad.stderr, bad.stderr


@pytest.mark.parametrize("case", ["qwen2_moe", "qwen3_moe_norm", "mixtral", "gpt_oss", "granitemoe", "jamba"])
def test_cli_runs_each_family(tmp_path, case):
    """`moekit run --checkpoint --check` on transformers' own directory of each family: two ranks, every
    MoE layer, the float64 reference of the loaded weights."""
    cli = os.environ.get("MOEKIT_CLI")
    if not cli:
        pytest.skip("MOEKIT_CLI (the moekit binary) not set")
    layers = save_checkpoint(case, "per-token", tmp_path / case)
    run = subprocess.run([cli, "run", "--checkpoint", str(tmp_path / case), "--device", "cpu", "--dp", "2",
                          "--tokens-per-rank", "6", "--steps", "1", "--check", "--layers", f"{layers[-1]}"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    # fp32 tensors without a quantization_config: quant auto runs them in bf16.
    assert f"MoE layers {layers[-1]} on one runtime" in run.stdout and "rounded once to bf16 at load" in run.stdout
    assert run.stdout.count("check layer") == 1, run.stdout
