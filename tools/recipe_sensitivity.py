"""How far each FP8 recipe moves the experts' output when W1's sums move by a small relative amount
(the GPU's sums differ from the CPU's fp32 ones: Hopper's FP8 tensor cores keep ~14 bits within the
128-element k-tile between promotions). DeepSeek-V3 shapes (K = 7168, I = 2048), 64 tokens, one
expert, float64 otherwise. per-token rounds W1's output to bf16 and quantizes the activation with
one scale per row; block128 (fused) quantizes the fp32 activation per 1x128 group. Both move
~sqrt(perturbation): an FP8 code flips at a rate that grows with it, each flip a 2^-4 step.
docs/PERF.md ("per-token's distance to the CPU") reads it. `python3 tools/recipe_sensitivity.py`"""
import torch
torch.manual_seed(0)
T, K, I = 64, 7168, 2048
FP8 = 448.0
def q_rows(x, group):  # per-row (group=None) or 1x128 groups, amax/448, e4m3 round
    if group is None:
        s = x.abs().amax(-1, keepdim=True) / FP8
        return (x / s).clamp(-FP8, FP8).to(torch.float8_e4m3fn).to(torch.float64) * s
    g = x.reshape(x.shape[0], -1, group)
    s = g.abs().amax(-1, keepdim=True) / FP8
    return ((g / s).clamp(-FP8, FP8).to(torch.float8_e4m3fn).to(torch.float64) * s).reshape(x.shape)
a = q_rows(torch.randn(T, K, dtype=torch.float64) / 10, 128)
w1 = q_rows(torch.randn(2 * I, K, dtype=torch.float64) / 15, 128)
w2 = q_rows(torch.randn(K, I, dtype=torch.float64) / 15, 128)
h = a @ w1.T  # exact sums
def layer(h, recipe):
    if recipe == "per-token":  # bf16 w1_out, activation, per-row FP8
        h = h.to(torch.bfloat16).to(torch.float64)
        act = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
        aq = q_rows(act, None)
    else:  # block128 fused: fp32 W1 output, activation, 1x128 FP8
        h = h.to(torch.float32).to(torch.float64)
        act = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
        aq = q_rows(act, 128)
    return (aq @ w2.T).to(torch.bfloat16).to(torch.float64)
for delta in (1e-6, 1e-5, 1e-4, 3e-4, 6.9e-4):
    for recipe in ("per-token", "block128"):
        ref = layer(h, recipe)
        errs = []
        for s in range(3):
            noisy = h * (1 + delta * torch.randn_like(h))
            errs.append(float((layer(noisy, recipe) - ref).norm() / ref.norm()))
        print(f"W1 perturbed by {delta:.1e} relative: {recipe:9s} output moves {sum(errs)/3:.2e}")
