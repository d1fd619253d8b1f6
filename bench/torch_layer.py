#!/usr/bin/env python3
"""Baseline for `moekit bench layer`, run on the GPU machine in the same round: the same MoE layer in
PyTorch - the model's routing (DeepSeek-V3: sigmoid scores, e_score_correction_bias, grouped top-k,
renormalized, scaled; Qwen3-MoE: softmax top-k, renormalized), the experts on the rows permuted by
expert, the top-k weighted combine - eager and under torch.compile, for the same tokens per step, in
the recipe moekit ran: FP8 recipes against per-token FP8 (torch._scaled_grouped_mm, W1 -> SiLU-and-mul
-> per-token FP8 -> W2), the bf16 / fp16 recipes against bf16 / fp16 (torch._grouped_mm, W1 ->
SiLU-and-mul in that dtype -> W2). Random weights of the same shapes. Merges its times into moekit's JSON, writes the results JSON
and a plot.

usage: torch_layer.py moekit_layer.json results.json plot.png [commit]
"""
import json
import sys

import torch
import torch.nn.functional as F

from torch_common import median_p99_ms, random_fp8

# Routing of the models `moekit bench layer` runs here: (n_group, topk_group, routed_scaling_factor)
# for DeepSeek-V3's grouped sigmoid routing; None: softmax top-k, renormalized (Qwen3-MoE).
ROUTING = {"deepseek-v3": (8, 4, 2.5), "qwen3-30b-a3b": None, "qwen3-235b-a22b": None}


SIXTEEN_BIT = {"bf16": torch.bfloat16, "fp16": torch.float16}


def baseline_recipe(res):
    """The recipe the PyTorch layer runs for moekit's: bf16 / fp16 for bf16 / fp16, per-token FP8 for the
    FP8 ones."""
    return res["quant"] if res.get("quant") in SIXTEEN_BIT else "per-token FP8"


def make_layer(E, K, I, topk, routing, gen, bias_mode="model", recipe="per-token FP8"):
    N = 2 * I
    dt = SIXTEEN_BIT.get(recipe)
    sixteen = dt is not None
    if sixteen:  # weights of rms 1 / sqrt(k), as trained ones
        w1 = torch.randn((E, N, K), device="cuda", generator=gen, dtype=dt).div_(K ** 0.5)
        w2 = torch.randn((E, K, I), device="cuda", generator=gen, dtype=dt).div_(I ** 0.5)
    else:
        w1 = random_fp8((E, N, K), gen)
        w2 = random_fp8((E, K, I), gen)
        s1 = torch.full((E, N), 1 / (448 * K ** 0.5), device="cuda")
        s2 = torch.full((E, K), 1 / (448 * I ** 0.5), device="cuda")
    bias = torch.randn((E,), device="cuda", generator=gen) * 0.1
    if bias_mode == "uniform":  # moekit bench layer --routing uniform: the correction bias zeroed
        bias.zero_()

    def quant(x):
        s = (x.abs().amax(-1, keepdim=True).float() / 448).clamp(min=1e-12)
        return (x.float() / s).to(torch.float8_e4m3fn), s.squeeze(-1).contiguous()

    def route(logits):
        T = logits.shape[0]
        if routing is None:  # softmax top-k, renormalized
            w, ids = logits.float().softmax(-1).topk(topk, dim=-1)
            return ids, w / w.sum(-1, keepdim=True)
        n_group, topk_group, scale = routing
        scores = logits.sigmoid()
        choice = scores + bias
        groups = choice.view(T, n_group, -1).topk(2, dim=-1)[0].sum(-1)
        keep = torch.zeros_like(groups).scatter_(1, groups.topk(topk_group, dim=-1)[1], 1.0)
        keep = keep.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
        ids = choice.masked_fill(keep == 0, float("-inf")).topk(topk, dim=-1)[1]
        w = scores.gather(1, ids)
        return ids, w / (w.sum(-1, keepdim=True) + 1e-20) * scale

    def layer(hidden, logits):
        T = hidden.shape[0]
        ids, w = route(logits)
        flat = ids.view(-1)
        order = flat.argsort(stable=True)
        offs = torch.bincount(flat, minlength=E).cumsum(0).to(torch.int32)
        rows = order // topk
        if sixteen:  # the layer's bf16 hidden states in the recipe's dtype, as moekit's prepare
            h = torch._grouped_mm(hidden[rows].to(dt), w1.transpose(-2, -1), offs=offs)
            y = torch._grouped_mm(F.silu(h[:, :I]) * h[:, I:], w2.transpose(-2, -1), offs=offs)
        else:
            q, sq = quant(hidden)
            h = torch._scaled_grouped_mm(q[rows], w1.transpose(-2, -1), sq[rows], s1, offs=offs,
                                         out_dtype=torch.bfloat16)
            a, sa = quant(F.silu(h[:, :I]) * h[:, I:])
            y = torch._scaled_grouped_mm(a, w2.transpose(-2, -1), sa, s2, offs=offs, out_dtype=torch.bfloat16)
        out = torch.empty_like(y).index_copy_(0, order, y).view(T, topk, K)
        return (out.float() * w.unsqueeze(-1)).sum(1).to(torch.bfloat16)

    return layer


def plot_labels(res):
    """The x-axis label and each moekit curve's label: the recipes the two sides ran (moekit's from
    its JSON, `moekit bench layer`'s --quant; this baseline's from baseline_recipe)."""
    recipe = res.get("quant", "?")
    xlabel = (f"tokens per step T ({res.get('model', 'deepseek-v3')}, {res.get('E', 256)} experts on one GPU, "
              f"top-{res.get('topk', 8)}; moekit {recipe}, PyTorch {baseline_recipe(res)})")
    return xlabel, {name: f"moekit {name} ({recipe})" for name in ("batched-fp8", "standard-fp8")}


def main():
    bench_path, out_path, plot_path = sys.argv[1:4]
    commit = sys.argv[4] if len(sys.argv) > 4 else "unknown"
    with open(bench_path) as f:
        res = json.load(f)
    res["commit"] = commit
    res["torch"] = torch.__version__
    E, K, I, topk = res["E"], res["K"], res["I"], res["topk"]
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    model = res.get("model", "deepseek-v3")
    if model not in ROUTING:
        sys.exit(f"torch_layer.py: no PyTorch routing for {model} (have: {', '.join(ROUTING)})")
    res["torch_recipe"] = baseline_recipe(res)
    layer = make_layer(E, K, I, topk, ROUTING[model], gen, res.get("routing", "model"), res["torch_recipe"])
    compiled = torch.compile(layer)
    tokens = sorted({r["T"] for r in res["rows"]})
    torch_rows = {}
    for T in tokens:
        hidden = torch.randn((max(T, 1), K), device="cuda", generator=gen).to(torch.bfloat16)[:T]
        logits = torch.randn((max(T, 1), E), device="cuda", generator=gen)[:T] * 2
        reps = 20 if T >= 2048 else 50
        row = {}
        for name, fn in (("eager", layer), ("compile", compiled)):
            try:
                row[name] = median_p99_ms(lambda: fn(hidden, logits), reps)
            except Exception as e:  # record why, keep moekit's results
                print(f"torch {name} T={T} failed: {type(e).__name__}: {e}", file=sys.stderr)
                row[name] = (None, None)
        torch_rows[T] = row
        print(f"torch T={T}: eager {row['eager'][0]} ms, compile {row['compile'][0]} ms", file=sys.stderr, flush=True)
    for r in res["rows"]:
        t = torch_rows[r["T"]]
        r["torch_eager_ms"], r["torch_eager_p99_ms"] = t["eager"]
        r["torch_compile_ms"], r["torch_compile_p99_ms"] = t["compile"]
    with open(out_path, "w") as f:
        json.dump(res, f, indent=2)

    print(f"{'experts':<13} {'T':>6} {'ms':>9} {'p99':>9} {'floor':>9} {'x floor':>8} {'rest %':>7} {'eager ms':>9} "
          f"{'compile':>9} {'x eager':>8} {'x compile':>9}")
    for r in res["rows"]:
        st = r["stages_ms"]
        rest = 100 * (st["route"] + st["prepare"] + st["finalize"]) / r["median_ms"]
        e, c = r["torch_eager_ms"], r["torch_compile_ms"]
        nan = float("nan")
        print(f"{r['experts']:<13} {r['T']:>6} {r['median_ms']:>9.4f} {r['p99_ms']:>9.4f} {r['floor_ms']:>9.4f} "
              f"{r['median_ms'] / r['floor_ms']:>8.2f} {rest:>7.1f} {e if e else nan:>9.4f} {c if c else nan:>9.4f} "
              f"{(e / r['median_ms']) if e else nan:>8.2f} {(c / r['median_ms']) if c else nan:>9.2f}")

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        xlabel, curve_labels = plot_labels(res)
        for name, style in (("batched-fp8", "o-"), ("standard-fp8", "s-")):
            rows = sorted((r for r in res["rows"] if r["experts"] == name and r["T"] > 0), key=lambda r: r["T"])
            if rows:
                ax.plot([r["T"] for r in rows], [r["median_ms"] for r in rows], style, label=curve_labels[name])
        rows = sorted((r for r in res["rows"] if r["experts"] == res["rows"][0]["experts"] and r["T"] > 0),
                      key=lambda r: r["T"])
        ax.plot([r["T"] for r in rows], [r["floor_ms"] for r in rows], "k--", label="floor (measured ceilings)")
        for key, style, label in (("torch_eager_ms", "r^-", "PyTorch eager"), ("torch_compile_ms", "mv-",
                                                                               "PyTorch torch.compile")):
            pts = [(r["T"], r[key]) for r in rows if r.get(key)]
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("ms per layer step")
        ax.set_title(f"{res['device']}, {res['date'][:10]}, commit {commit[:10]}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot_path, dpi=120)
    except Exception as e:
        print(f"plot failed: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()
