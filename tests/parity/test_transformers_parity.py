"""moekit's layer against Hugging Face transformers' own MoE block classes (the truth for what a
model computes), one small valid config per supported model_type: the whole block, routed and
shared experts (Qwen2-MoE's gate included).

Each case builds the family's block from transformers (e.g. DeepseekV3MoE(config)) with random
weights, quantizes the experts' weights (routed and shared) to FP8 in moekit's scheme and writes the
dequantized values back into the block, so both sides hold the same weights. The block's router gives the logits both
sides route from. The reference runs transformers' forward in float32 with moekit's two activation
quantizations emulated (the input of every expert linear is quantized and dequantized as moekit
quantizes it: per token, per 1x128 group, or per tensor), so what remains is accumulation order and
the bf16 roundings (tolerance() below). A routing rule moekit got wrong moves whole experts: 10-100% error.

torch and transformers come from PyPI through scripts/install-deps.sh (versions pinned there); the
module is skipped by name where they are missing. MOEKIT_PARITY_DEVICE=cuda runs the layer on a GPU.
"""
import contextlib
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import moekit  # noqa: E402

DEVICE = os.environ.get("MOEKIT_PARITY_DEVICE", "cpu")
FP8_MAX = 448.0
# The CPU computes the emulated recipe up to bf16 roundings and summation order (2.4-3.4e-3
# measured); a GPU adds its GEMMs' accumulation and the FP8 code flips that follow: moekit's
# device-against-CPU bound (check::device_vs_cpu_tolerance), wider where one per-tensor scale spans
# the rows (a moved scale re-rounds every code).
# One token (T = 1) is one output row: a flipped code there is not averaged over other rows
# (gpt-oss per-token on an H100: T = 1 2.3e-2 / 3.5e-2 with swiglu_alpha 1.702 / 1.0, every T >= 7
# 1.2-2.0e-2 for both), so the GPU's bound for one token is 1.5x.
CPU_TOL = 5e-3
GPU_TOL = {"per-token": 3e-2, "block128": 3e-2, "per-tensor": 5e-2}
GPU_ONE_TOKEN = 1.5


def tolerance(scheme, tokens=None):
    if DEVICE == "cpu":
        return CPU_TOL
    return GPU_TOL[scheme] * (GPU_ONE_TOKEN if tokens == 1 else 1.0)

K, I, E, TOPK = 256, 128, 16, 4  # block128 needs K and I in whole 128 blocks
BASE = {"hidden_size": K, "num_hidden_layers": 2, "hidden_act": "silu"}
HEADS = {"num_attention_heads": 4, "num_key_value_heads": 4}


# ---- the families: transformers' config and block, the config keys moekit reads ------------------
def _ds(extra):
    return {**BASE, "moe_intermediate_size": I, "n_routed_experts": E, "num_experts_per_tok": TOPK,
            "first_k_dense_replace": 0, **extra}


def _softmax(extra, intermediate_key="moe_intermediate_size", experts_key="num_experts"):
    return {**BASE, intermediate_key: I, experts_key: E, "num_experts_per_tok": TOPK, **extra}


# name: (model_type, transformers config class, module path, block class, config keys)
CASES = {
    "deepseek_v3": ("deepseek_v3", "DeepseekV3Config", "deepseek_v3", "DeepseekV3MoE",
                    _ds({"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "n_shared_experts": 1,
                         "norm_topk_prob": True})),
    "kimi_k2": ("kimi_k2", "DeepseekV3Config", "deepseek_v3", "DeepseekV3MoE",
                _ds({"n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827, "n_shared_experts": 1,
                     "scoring_func": "sigmoid", "topk_method": "noaux_tc"})),
    "deepseek_v2_greedy": ("deepseek_v2", "DeepseekV2Config", "deepseek_v2", "DeepseekV2Moe",
                           _ds({"topk_method": "greedy", "routed_scaling_factor": 16.0, "n_shared_experts": 2})),
    "deepseek_v2_group_limited": ("deepseek_v2", "DeepseekV2Config", "deepseek_v2", "DeepseekV2Moe",
                                  _ds({"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
                                       "routed_scaling_factor": 16.0, "n_shared_experts": 2})),
    "glm4_moe": ("glm4_moe", "Glm4MoeConfig", "glm4_moe", "Glm4MoeMoE",
                 _ds({"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "n_shared_experts": 1})),
    "glm_moe_dsa": ("glm_moe_dsa", "GlmMoeDsaConfig", "glm_moe_dsa", "GlmMoeDsaMoE",
                    _ds({"n_shared_experts": 1})),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeConfig", "qwen2_moe", "Qwen2MoeSparseMoeBlock",
                  _softmax({"shared_expert_intermediate_size": 2 * I, "norm_topk_prob": False})),
    "qwen3_moe_norm": ("qwen3_moe", "Qwen3MoeConfig", "qwen3_moe", "Qwen3MoeSparseMoeBlock",
                       _softmax({"norm_topk_prob": True})),
    "qwen3_moe_no_norm": ("qwen3_moe", "Qwen3MoeConfig", "qwen3_moe", "Qwen3MoeSparseMoeBlock",
                          _softmax({"norm_topk_prob": False})),
    "olmoe": ("olmoe", "OlmoeConfig", "olmoe", "OlmoeSparseMoeBlock", _softmax({}, "intermediate_size")),
    "mixtral": ("mixtral", "MixtralConfig", "mixtral", "MixtralSparseMoeBlock",
                _softmax({}, "intermediate_size", "num_local_experts")),
    "gpt_oss": ("gpt_oss", "GptOssConfig", "gpt_oss", "GptOssMLP",
                _softmax({"swiglu_limit": 7.0}, "intermediate_size", "num_local_experts")),
    # A limit inside the W1 outputs' range: the clamp bites on most values.
    "gpt_oss_limit": ("gpt_oss", "GptOssConfig", "gpt_oss", "GptOssMLP",
                      _softmax({"swiglu_limit": 0.25}, "intermediate_size", "num_local_experts")),
    # An alpha other than the released 1.702 (GptOssExperts' gate * sigmoid(gate * alpha)).
    "gpt_oss_alpha": ("gpt_oss", "GptOssConfig", "gpt_oss", "GptOssMLP",
                      _softmax({"swiglu_limit": 7.0, "swiglu_alpha": 1.0}, "intermediate_size", "num_local_experts")),
    # Families that run one of the blocks above under their own config class and defaults.
    "deepseek_v32": ("deepseek_v32", "DeepseekV32Config", "deepseek_v32", "DeepseekV32MoE",
                     _ds({"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "n_shared_experts": 1,
                          **HEADS})),
    "glm4_moe_lite": ("glm4_moe_lite", "Glm4MoeLiteConfig", "glm4_moe_lite", "Glm4MoeLiteMoE",
                      _ds({"n_shared_experts": 1, "first_k_dense_replace": 1, **HEADS})),
    "dots1": ("dots1", "Dots1Config", "dots1", "Dots1MoE",
              _ds({"n_group": 4, "topk_group": 2, "n_shared_experts": 2, "routed_scaling_factor": 2.5, **HEADS})),
    "dots1_no_norm": ("dots1", "Dots1Config", "dots1", "Dots1MoE", _ds({"n_shared_experts": 1, **HEADS})),
    "qwen3_next": ("qwen3_next", "Qwen3NextConfig", "qwen3_next", "Qwen3NextSparseMoeBlock",
                   _softmax({"shared_expert_intermediate_size": 2 * I, **HEADS})),
    "flex_olmo": ("flex_olmo", "FlexOlmoConfig", "flex_olmo", "FlexOlmoSparseMoeBlock",
                  _softmax({**HEADS}, "intermediate_size")),
    "minimax": ("minimax", "MiniMaxConfig", "minimax", "MiniMaxSparseMoeBlock",
                _softmax({**HEADS}, "intermediate_size", "num_local_experts")),
    "granitemoe": ("granitemoe", "GraniteMoeConfig", "granitemoe", "GraniteMoeMoE",
                   _softmax({**HEADS}, "intermediate_size", "num_local_experts")),
    "jamba": ("jamba", "JambaConfig", "jamba", "JambaSparseMoeBlock", _softmax({**HEADS}, "intermediate_size")),
}
# Experts stored as x @ W (transformers' (E, K, N) layout), gate / up interleaved, with biases.
TRANSPOSED = {"gpt_oss", "gpt_oss_limit", "gpt_oss_alpha"}
SCHEMES = ["per-token", "block128", "per-tensor"]
TOKENS = [1, 7, 64, 300]


def build_block(case, seed):
    model_type, config_cls, module, block_cls, keys = CASES[case]
    cfg = getattr(transformers, config_cls)(**keys)
    mod = __import__(f"transformers.models.{module}.modeling_{module}", fromlist=[block_cls])
    torch.manual_seed(seed)
    block = getattr(mod, block_cls)(cfg).float().eval()
    with torch.no_grad():
        for name, p in list(block.named_parameters()) + list(block.named_buffers()):
            if "e_score_correction_bias" in name:
                p.copy_(torch.randn_like(p) * 0.05)
            elif name.endswith("gate.weight") or name.endswith("router.weight"):
                p.copy_(torch.randn_like(p) * (1.0 / K ** 0.5))
            else:
                p.copy_(torch.randn_like(p) * (2.0 / K ** 0.5))
    return block, {"model_type": model_type, **keys}


# ---- FP8 as moekit quantizes it -----------------------------------------------------------------
def fp8(x, scale):
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quantize_weight(w, scheme):
    """(E, n, k) float32 -> FP8 codes (uint8), their float32 scales in moekit's layout, and the
    dequantized weight."""
    e, n, k = w.shape
    if scheme == "per-token":  # per output channel
        scale = w.abs().amax(dim=2, keepdim=True) / FP8_MAX
        codes = fp8(w, scale)
        return codes, scale.reshape(e, n), codes.float() * scale
    if scheme == "per-tensor":
        scale = w.abs().amax(dim=(1, 2), keepdim=True) / FP8_MAX
        codes = fp8(w, scale)
        return codes, scale.reshape(e, 1), codes.float() * scale
    nb, kb = n // 128, (k + 127) // 128
    blocks = torch.nn.functional.pad(w, (0, kb * 128 - k)).reshape(e, nb, 128, kb, 128)
    scale = blocks.abs().amax(dim=(2, 4), keepdim=True) / FP8_MAX
    codes = fp8(blocks, scale)
    deq = (codes.float() * scale).reshape(e, n, kb * 128)[:, :, :k]
    return codes.reshape(e, n, kb * 128)[:, :, :k].contiguous(), scale.reshape(e, nb * kb), deq


def checkpoint_scale(scale, shape, scheme):
    """Block scales in the checkpoint's (E, n / 128, k / 128) shape (weight_scale_inv, one expert's
    per block row); the other schemes' as they are."""
    if scheme != "block128":
        return scale
    e, n, k = shape
    return scale.reshape(e, n // 128, (k + 127) // 128)


def quantize_activation(x, scheme, tensor_amax=None):
    """Rows of x as moekit's activation quantization leaves them (dequantized)."""
    if scheme == "per-token":
        scale = torch.where(x.abs().amax(-1, keepdim=True) > 0, x.abs().amax(-1, keepdim=True) / FP8_MAX, 1.0)
        return fp8(x, scale).float() * scale
    if scheme == "per-tensor":
        amax = x.abs().amax() if tensor_amax is None else tensor_amax
        scale = amax / FP8_MAX if amax > 0 else torch.tensor(1.0)
        return fp8(x, scale).float() * scale
    shape, k = x.shape, x.shape[-1]
    g = torch.nn.functional.pad(x.reshape(-1, k), (0, (-k) % 128)).reshape(-1, (k + 127) // 128, 128)
    amax = g.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, 1.0)
    return (fp8(g, scale).float() * scale).reshape(g.shape[0], -1)[:, :k].reshape(shape)


@contextlib.contextmanager
def emulated_activation_quant(expert_weights, scheme, hidden_amax, w1_out_bf16):
    """Every F.linear whose weight is one of the experts' quantizes its input first, as moekit does
    before W1 (the dispatched hidden rows: per-tensor over the rank's tokens) and before W2 (the
    activation's output: per-tensor over the expert's rows). w1_out_bf16: the unfused recipe keeps
    W1's output in bf16 before the activation (the fused W1 of block128 keeps it in fp32); a bf16
    ulp there moves ~3% of the activation's FP8 codes by one step, ~1e-2 of the output."""
    w1_ptrs = {w.data_ptr() for w in expert_weights["w1"]}
    w2_ptrs = {w.data_ptr() for w in expert_weights["w2"]}
    linear = torch.nn.functional.linear

    def patched(x, weight, bias=None):
        ptr = weight.data_ptr()
        if ptr in w1_ptrs:
            out = linear(quantize_activation(x, scheme, hidden_amax), weight, bias)
            return bf16(out) if w1_out_bf16 else out
        if ptr in w2_ptrs:
            x = quantize_activation(x, scheme)
        return linear(x, weight, bias)

    torch.nn.functional.linear = patched
    try:
        yield
    finally:
        torch.nn.functional.linear = linear


def bf16(x):
    return x.to(torch.bfloat16).float()


def shared_mlp(block):
    """The block's shared experts (one MLP: a family's several are one wider MLP), or None."""
    return getattr(block, "shared_experts", None) or getattr(block, "shared_expert", None)


def arrange_shared(block, scheme):
    """The shared experts' FP8 weights in moekit's layout: W1 = gate_proj then up_proj (one expert,
    block pairs under block128), W2 = down_proj; the dequantized ones written back. Qwen2-MoE's
    shared_expert_gate is rounded to bf16, the dtype moekit takes it in."""
    mlp = shared_mlp(block)
    if mlp is None:
        return {}
    w1 = torch.cat([mlp.gate_proj.weight.data, mlp.up_proj.weight.data])[None]
    c1, s1, d1 = quantize_weight(w1, scheme)
    c2, s2, d2 = quantize_weight(mlp.down_proj.weight.data[None], scheme)
    half = mlp.gate_proj.weight.shape[0]
    with torch.no_grad():
        mlp.gate_proj.weight.copy_(d1[0, :half])
        mlp.up_proj.weight.copy_(d1[0, half:])
        mlp.down_proj.weight.copy_(d2[0])
    codes1, scale1 = c1.view(torch.uint8).numpy(), s1.contiguous().numpy()
    out = {"shared_w1": np.ascontiguousarray(codes1[0]), "shared_w1_scale": np.ascontiguousarray(scale1[0]),
           "shared_w2": np.ascontiguousarray(c2.view(torch.uint8).numpy()[0]),
           "shared_w2_scale": np.ascontiguousarray(s2.contiguous().numpy()[0])}
    gate = getattr(block, "shared_expert_gate", None)
    if gate is not None:
        with torch.no_grad():
            gate.weight.copy_(bf16(gate.weight))
        out["shared_expert_gate"] = gate.weight.detach().to(torch.bfloat16).view(torch.int16).numpy().view(
            np.uint16).copy()  # (1, K): nn.Linear's shape
    return out


def arrange(block, scheme, transposed):
    """The experts' FP8 weights in moekit's layout (and the dequantized ones written back)."""
    experts = block.experts
    t = (lambda w: w.transpose(1, 2)) if transposed else (lambda w: w)
    w1, w1_scale, w1_deq = quantize_weight(t(experts.gate_up_proj.data).contiguous(), scheme)
    w2, w2_scale, w2_deq = quantize_weight(t(experts.down_proj.data).contiguous(), scheme)
    with torch.no_grad():
        experts.gate_up_proj.copy_(t(w1_deq))
        experts.down_proj.copy_(t(w2_deq))
    # As a checkpoint stores them: W1 gate rows then up rows (the layer arranges block128's block
    # pairs itself), block scales in weight_scale_inv's (E, n / 128, k / 128) shape.
    codes1 = w1.view(torch.uint8).numpy()
    scale1 = checkpoint_scale(w1_scale.contiguous(), w1.shape, scheme).numpy()
    out = {"w1": np.ascontiguousarray(codes1), "w1_scale": np.ascontiguousarray(scale1),
           "w2": np.ascontiguousarray(w2.view(torch.uint8).numpy()),
           "w2_scale": np.ascontiguousarray(checkpoint_scale(w2_scale.contiguous(), w2.shape, scheme).numpy())}
    if hasattr(experts, "gate_up_proj_bias"):  # in W1's row order already (interleaved)
        out["w1_bias"] = experts.gate_up_proj_bias.detach().float().numpy().copy()
        out["w2_bias"] = experts.down_proj_bias.detach().float().numpy().copy()
    return out


def reference_transposed(block, x, scheme):
    """gpt-oss: its experts (x @ W + b, the clamped SwiGLU, @ W2 + b) on the routed tokens, with
    moekit's quantization emulated: the hidden rows quantized first, W1's output (bias included)
    rounded to bf16 and the activation's output quantized inside its _apply_gate."""
    experts = block.experts
    apply_gate = experts._apply_gate
    experts._apply_gate = lambda gate_up: quantize_activation(apply_gate(bf16(gate_up)), scheme)
    try:
        _, scores, ids = block.router(x)
        return experts(quantize_activation(x, scheme), ids, scores)
    finally:
        del experts._apply_gate


def router_of(block):
    return getattr(block, "gate", None) or block.router


def run_case(tmp_path, case, scheme, T, seed, shared_experts=True, moekit_keys=None):
    """The relative error of moekit's layer against the block; moekit_keys: config keys that
    moekit's copy of the config changes (a deliberately wrong config)."""
    block, keys = build_block(case, seed)
    weights = arrange(block, scheme, case in TRANSPOSED)
    shared_weights = arrange_shared(block, scheme)
    if shared_experts:
        weights.update(shared_weights)
    mlp = shared_mlp(block)
    gen = torch.Generator().manual_seed(seed + 1000)
    x = bf16(torch.randn(T, K, generator=gen))
    router = router_of(block)
    with torch.no_grad():
        routed = router(x)  # a Linear (Jamba) or a router module returning (logits, ...)
        logits = (routed[0] if isinstance(routed, tuple) else routed).float().contiguous()
        if case in TRANSPOSED:
            ref = reference_transposed(block, x, scheme)
        else:
            w1 = list(block.experts.gate_up_proj) + ([mlp.gate_proj.weight, mlp.up_proj.weight] if mlp else [])
            w2 = list(block.experts.down_proj) + ([mlp.down_proj.weight] if mlp else [])
            with emulated_activation_quant({"w1": w1, "w2": w2}, scheme, x.abs().amax(),
                                           w1_out_bf16=scheme != "block128"):
                ref = block(x.reshape(1, T, K))
            ref = (ref[0] if isinstance(ref, tuple) else ref).reshape(T, K)
    if hasattr(router, "e_score_correction_bias"):
        weights["e_score_correction_bias"] = router.e_score_correction_bias.detach().float().numpy().copy()
    path = tmp_path / f"{case}.json"
    path.write_text(json.dumps({**keys, **(moekit_keys or {})}))
    if DEVICE == "cuda":
        weights = {k: torch.from_numpy(v).cuda() for k, v in weights.items()}
        for k in ("w1", "w2", "shared_w1", "shared_w2"):
            if k in weights:
                weights[k] = weights[k].view(torch.float8_e4m3fn)
        if "shared_expert_gate" in weights:
            weights["shared_expert_gate"] = weights["shared_expert_gate"].view(torch.bfloat16)
    layer = moekit.MoeLayer(str(path), weights=weights, max_tokens_per_rank=max(T, 1), quant=scheme, device=DEVICE,
                            shared_experts=shared_experts)
    if DEVICE == "cuda":
        got = layer(x.to(torch.bfloat16).cuda(), logits.cuda()).float().cpu()
    else:
        hidden = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        out = layer(hidden, logits.numpy())
        got = torch.from_numpy(out.view(np.int16)).view(torch.bfloat16).float()
    err = float((got - ref).norm() / ref.norm())
    return err


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_matches_transformers(tmp_path, case, scheme):
    worst = 0.0
    for T in TOKENS:
        for seed in (1, 2):
            err = run_case(tmp_path, case, scheme, T, seed)
            worst = max(worst, err)
            assert err < tolerance(scheme, T), \
                f"{case} {scheme} T={T} seed={seed}: relative error {err:.3e} >= {tolerance(scheme, T)}"
    print(f"{case:28s} {scheme:10s} worst relative error {worst:.2e}")


@pytest.mark.parametrize("case", ["deepseek_v3", "qwen2_moe"])
def test_shared_experts_are_part_of_the_block(tmp_path, case):
    """Without its shared experts (shared_experts=False) the layer is not the block: the check above
    would fail by their share of the output."""
    err = run_case(tmp_path, case, "block128", 64, 1, shared_experts=False)
    assert err > 0.1, f"{case}: the block without its shared experts is only {err:.3e} away"


def test_swiglu_limit_is_the_configs(tmp_path):
    """gpt-oss's clamp comes from its config: the block with swiglu_limit 0.25 is not the layer run
    with the default limit (7)."""
    err = run_case(tmp_path, "gpt_oss_limit", "per-token", 64, 1, moekit_keys={"swiglu_limit": 7.0})
    assert err > 0.1, f"the limit changed the block's output by only {err:.3e}"


def test_swiglu_alpha_is_the_configs(tmp_path):
    """gpt-oss's alpha comes from its config: the block with swiglu_alpha 1.0 is not the layer run
    with the released alpha (1.702), which is what moekit ran when it ignored the key."""
    err = run_case(tmp_path, "gpt_oss_alpha", "per-token", 64, 1, moekit_keys={"swiglu_alpha": 1.702})
    assert err > 2e-2, f"alpha changed the block's output by only {err:.3e}"
