#!/usr/bin/env python3
"""Baseline for bench_gpu_experts, run on the GPU machine in the same round: the same experts
pipeline (W1 grouped FP8 GEMM -> the run's activation, as the models' PyTorch code writes it, on
moekit's W1 row layout -> per-token FP8 quantization -> W2 grouped FP8 GEMM) with PyTorch's
torch._scaled_grouped_mm on the valid rows gathered contiguously. Every activation moekit has
(DeepSeek-V3's silu by default; `bench_gpu_experts --model gpt-oss-120b` times swigluoai). Per-token only
(PyTorch has no block-scaled grouped GEMM on Hopper): block128 cases carry the per-token baseline
of their m_e for reference. Merges its times
into the C++ results, writes the results JSON and a plot of time vs m_e with the floor drawn in.

usage: torch_baseline.py bench.json results.json plot.png [commit]
"""
import json
import sys

import torch
import torch.nn.functional as F

from torch_common import median_p99_ms, random_fp8


def median_ms(fn, reps=20):
    return median_p99_ms(fn, reps)[0]


def activate(h, activation, I):
    """The activation of W1's output rows h (rows, N) into (rows, I): halves (gate | up) for silu /
    gelu / gelu_tanh, gpt-oss's interleaved (gate, up) pairs with its clamps for swigluoai, the
    row itself for the non-gated relu2 / silu_no_mul (numerics/activation.h's formulas)."""
    if activation == "swigluoai":
        g = h[:, 0::2].clamp(max=7.0)
        u = h[:, 1::2].clamp(min=-7.0, max=7.0)
        return (u + 1) * (g * torch.sigmoid(1.702 * g))
    if activation == "relu2":
        return F.relu(h).square()
    if activation == "silu_no_mul":
        return F.silu(h)
    gate = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}[activation]
    return gate(h[:, :I]) * h[:, I:]


def baseline(E, m_e, K, N, I, activation, gen):
    rows = E * m_e
    a = random_fp8((rows, K), gen)
    sa = torch.full((rows,), 1 / 16, device="cuda")
    w1 = random_fp8((E, N, K), gen)
    s1 = torch.full((E, N), 1 / 448, device="cuda")
    w2 = random_fp8((E, K, I), gen)
    s2 = torch.full((E, K), 1 / 448, device="cuda")
    offs = torch.arange(1, E + 1, dtype=torch.int32, device="cuda") * m_e

    def gemm1():
        return torch._scaled_grouped_mm(a, w1.transpose(-2, -1), sa, s1, offs=offs, out_dtype=torch.bfloat16)

    h = gemm1()
    x = activate(h, activation, I)
    s = (x.abs().amax(-1, keepdim=True).float() / 448).clamp(min=1e-12)
    q = (x / s).to(torch.float8_e4m3fn)
    sq = s.squeeze(-1).contiguous()

    def gemm2():
        return torch._scaled_grouped_mm(q, w2.transpose(-2, -1), sq, s2, offs=offs, out_dtype=torch.bfloat16)

    def pipeline():
        hh = gemm1()
        xx = activate(hh, activation, I)
        ss = (xx.abs().amax(-1, keepdim=True).float() / 448).clamp(min=1e-12)
        qq = (xx / ss).to(torch.float8_e4m3fn)
        return torch._scaled_grouped_mm(qq, w2.transpose(-2, -1), ss.squeeze(-1).contiguous(), s2, offs=offs,
                                        out_dtype=torch.bfloat16)

    gemms = median_ms(lambda: (gemm1(), gemm2()))
    return median_ms(pipeline), gemms


def main():
    bench_path, out_path, plot_path = sys.argv[1:4]
    commit = sys.argv[4] if len(sys.argv) > 4 else "unknown"
    with open(bench_path) as f:
        res = json.load(f)
    res["commit"] = commit
    res["torch"] = torch.__version__
    E, K, N, I = res["E_local"], res["K"], res["N"], res["I"]
    activation = res.get("activation", "silu")
    gated = activation not in ("relu2", "silu_no_mul")
    if N != (2 * I if gated else I):
        sys.exit(f"torch_baseline: {activation} with N = {N}, I = {I}: a gated activation reads N = 2 I, "
                 "a non-gated one N = I")
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    cache = {}
    for case in res["cases"]:
        m_e = case["m_e"]
        if m_e not in cache:
            try:
                cache[m_e] = baseline(E, m_e, K, N, I, activation, gen)
            except Exception as e:  # record why, keep the C++ results
                print(f"baseline m_e={m_e} failed: {e}", file=sys.stderr)
                cache[m_e] = (None, None)
        case["baseline_ms"], case["baseline_gemms_ms"] = cache[m_e]
    with open(out_path, "w") as f:
        json.dump(res, f, indent=2)

    print(f"{'quant':<9} {'M':>6} {'m_e':>6} {'config':<20} {'ms':>9} {'floor':>9} {'x floor':>8} {'torch ms':>9} "
          f"{'torch gemms':>11} {'x torch':>8}")
    for c in res["cases"]:
        if not c["selected"]:
            continue
        b = c["baseline_ms"]
        bg = c["baseline_gemms_ms"]
        print(f"{c.get('quant', 'per-token'):<9} {c['M']:>6} {c['m_e']:>6} {c['config']:<20} {c['ms']:>9.4f} {c['floor_ms']:>9.4f} "
              f"{c['ms'] / c['floor_ms']:>8.2f} {b if b else float('nan'):>9.4f} {bg if bg else float('nan'):>11.4f} "
              f"{(b / c['ms']) if b else float('nan'):>8.2f}")

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for M, style in ((2048, "o-"), (8192, "s-")):
            for quant in ("per-token", "block128"):
                sel = sorted((c for c in res["cases"] if c["selected"] and c["M"] == M
                              and c.get("quant", "per-token") == quant), key=lambda c: c["m_e"])
                if sel:
                    ax.plot([c["m_e"] for c in sel], [c["ms"] for c in sel], style if quant == "per-token" else
                            style.replace("-", ":"), label=f"moekit {quant}, M={M}")
        sel = sorted((c for c in res["cases"] if c["selected"] and c["M"] == 8192
                      and c.get("quant", "per-token") == "per-token"), key=lambda c: c["m_e"])
        ax.plot([c["m_e"] for c in sel], [c["floor_ms"] for c in sel], "k--", label="floor (measured ceilings)")
        bl = [(c["m_e"], c["baseline_ms"]) for c in sel if c["baseline_ms"]]
        if bl:
            ax.plot([x for x, _ in bl], [y for _, y in bl], "r^-", label="torch._scaled_grouped_mm pipeline")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"valid rows per expert m_e (E_local = {E}, {res.get('model', 'deepseek-v3')} shapes)")
        ax.set_ylabel("ms per experts step")
        ax.set_title(f"{res['device']}, {res['date'][:10]}, commit {commit[:10]}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot_path, dpi=120)
    except Exception as e:
        print(f"plot failed: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()
