"""The whole DeepSeek-V3 layer expert-parallel on the GPUs of one node, from Python, under CUDA graph
replay: per tokens-per-rank T, the layer step (router, dispatch, experts, combine), the experts
alone on the same local work (moekit.ops.batched_experts, E_local experts, the rows uniform routing
sends each), and the transport's dispatch + combine as `moekit bench dispatch` measured them in the
same round (its JSON): issue 9's target is layer <= 1.25 x (experts + dispatch + combine) at T = 128.
Then the same steps on a layer built for BIG = 1024 tokens per rank (as an engine builds one for
prefill and decodes on it), undeclared and declared (enqueue's max_tokens_any_rank = T): what the
declaration saves there (the GEMM launches of experts larger than P x T rows).

    torchrun --nproc-per-node 2 bench/ep_layer.py DISPATCH_JSON OUT_JSON COMMIT [T ...]

Random finite FP8 weights (128x128 block scales), made on the GPU: nothing is downloaded. The
max over ranks of each rank's median (and p99) is reported.
"""
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

import moekit

K, I, E, TOPK = 7168, 2048, 256, 8


def fp8(shape, gen):
    """Random e4m3 codes without NaN (0x7F / 0xFF become 0x7E / 0xFE)."""
    c = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=gen)
    return torch.where((c & 0x7F) == 0x7F, c - 1, c).view(torch.float8_e4m3fn)


def graph_times(fn, iters):
    """Each replay of fn's graph timed with events: (median, p99) in microseconds."""
    fn()  # warm: workspaces, lazy state
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    dist.barrier()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in events:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    us = np.array([a.elapsed_time(b) * 1e3 for a, b in events])
    return float(np.median(us)), float(np.percentile(us, 99))


def max_over_ranks(x):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return max(out)


def main():
    dispatch_json, out_json, commit = sys.argv[1], sys.argv[2], sys.argv[3]
    Ts = [int(t) for t in sys.argv[4:]] or [32, 128, 512]
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    rank, P = dist.get_rank(), dist.get_world_size()
    E_local = E // P
    gen = torch.Generator(device="cuda").manual_seed(1 + rank)
    w = {
        "w1": fp8((E_local, 2 * I, K), gen),
        "w1_scale": torch.full((E_local, (2 * I // 128) * (K // 128)), 2e-3, device="cuda"),
        "w2": fp8((E_local, K, I), gen),
        "w2_scale": torch.full((E_local, (K // 128) * (I // 128)), 2e-3, device="cuda"),
        "e_score_correction_bias": torch.zeros(E, device="cuda"),
    }
    transport = {(r["routing"], r["T"]): r for r in json.load(open(dispatch_json))["rows"]}
    BIG = max(1024, *Ts)
    big = moekit.MoeLayer("deepseek-v3", weights=w, max_tokens_per_rank=BIG, quant="block128", group=dist.group.WORLD)
    rows = []
    for T in Ts:
        layer = moekit.MoeLayer("deepseek-v3", weights=w, max_tokens_per_rank=T, quant="block128",
                                group=dist.group.WORLD)
        hidden = (torch.randn((T, K), generator=gen, device="cuda") * 0.1).to(torch.bfloat16)
        logits = torch.randn((T, E), generator=gen, device="cuda")
        out = torch.empty_like(hidden)
        layer_us = graph_times(lambda: layer.enqueue(hidden, logits, out), 50)
        layer.check_status()
        big_us = graph_times(lambda: big.enqueue(hidden, logits, out), 50)
        declared_us = graph_times(lambda: big.enqueue(hidden, logits, out, max_tokens_any_rank=T), 50)
        big.check_status()
        # The experts alone on the local work uniform routing gives this rank: P*T*TOPK/E rows per
        # expert on average, drawn multinomially, in a buffer of M = P*T rows per expert.
        M = P * T
        counts = np.random.default_rng(T + rank).multinomial(P * T * TOPK // P, [1 / E_local] * E_local)
        a1q = fp8((E_local, M, K), gen)
        a1q_scale = torch.full((E_local, M, K // 128), 1e-2, device="cuda")
        cnt = torch.tensor(np.minimum(counts, M), dtype=torch.int32, device="cuda")
        y = torch.empty((E_local, M, K), dtype=torch.bfloat16, device="cuda")
        # Random codes: read as block pairs (what the op reads under block128) they are as random.
        experts_us = graph_times(lambda: moekit.ops.batched_experts(a1q, a1q_scale, cnt, w["w1"], w["w1_scale"],
                                                                    w["w2"], w["w2_scale"], y,
                                                                    w1_layout="block_pairs"), 50)
        moekit.ops.check_status()
        layer_med, experts_med = max_over_ranks(layer_us[0]), max_over_ranks(experts_us[0])
        layer_p99 = max_over_ranks(layer_us[1])
        t = transport.get(("uniform", T))
        disp, comb = (t["dispatch_us"][0], t["combine_us"][0]) if t else (float("nan"), float("nan"))
        budget = experts_med + disp + comb
        rows.append({"T": T, "layer_us": layer_med, "layer_p99_us": layer_p99, "experts_us": experts_med,
                     "big_layer_us": max_over_ranks(big_us[0]), "big_declared_us": max_over_ranks(declared_us[0]),
                     "dispatch_us": disp, "combine_us": comb, "ratio": layer_med / budget,
                     "workspace_bytes": layer.workspace_bytes, "mean_rows_per_expert": float(counts.mean())})
        del layer
        torch.cuda.synchronize()
        dist.barrier()
    if rank == 0:
        print(f"moekit layer on {P} x {torch.cuda.get_device_name()} (DeepSeek-V3, 256 experts, {E_local} per GPU, "
              f"block128, nccl), graph replay, max over ranks of each rank's median")
        print(f"{'T':>5} {'layer us':>9} {'p99':>7} {'experts us':>10} {'disp us':>8} {'comb us':>8} "
              f"{'layer / (experts+disp+comb)':>28} {'BIG undeclared':>14} {'BIG declared':>12}")
        for r in rows:
            print(f"{r['T']:>5} {r['layer_us']:>9.1f} {r['layer_p99_us']:>7.1f} {r['experts_us']:>10.1f} "
                  f"{r['dispatch_us']:>8.1f} {r['combine_us']:>8.1f} {r['ratio']:>28.2f} "
                  f"{r['big_layer_us']:>14.1f} {r['big_declared_us']:>12.1f}")
        print(f"(BIG: a layer built for {BIG} tokens per rank, the step undeclared and declared with "
              f"max_tokens_any_rank = T)")
        json.dump({"commit": commit, "device": f"{P} x {torch.cuda.get_device_name()}", "rows": rows},
                  open(out_json, "w"), indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
