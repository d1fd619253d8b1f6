"""PyTorch baselines for `moekit bench dispatch`, run in the same round on the same GPUs.

    python3 bench/torch_dispatch.py MOEKIT_JSON OUT_JSON [COMMIT]

MOEKIT_JSON is `moekit bench dispatch --format json`; its shapes (K, E, top-k, tokens per rank,
routing) are reused. One process per GPU (torch.multiprocessing), NCCL process group.

- all_to_all_single: the expert-parallel dispatch/combine a PyTorch user writes. Dispatch: FP8
  per-token quantization, one row per (token, expert) pair sorted by destination rank (the
  permutation is counted), the counts exchanged with all_to_all_single and read on the host, then
  rows, scales and expert ids with all_to_all_single. Combine: the expert rows (bf16) back with
  all_to_all_single, weighted and summed per token (index_add_). Eager (host reads the counts).
- all_to_all_vdev_2d (PyTorch symmetric memory, NVSHMEM): counts stay on the device; run where
  it works, reported with its error otherwise.
Medians and p99 in microseconds, the max over ranks. Writes OUT_JSON (moekit rows + baselines) and
prints a table with moekit's speed-up over each baseline.
"""
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

for var, value in (("NCCL_NVLS_ENABLE", "0"), ("NVSHMEM_DISABLE_NVLS", "1"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
    os.environ[var] = value  # NVLink multicast stays off on these machines


def routing_ids(routing, T, E, E_local, topk, seed):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    pool = E_local if routing == "skewed" else E
    scores = torch.rand(T, pool, generator=gen)
    ids = scores.topk(topk, dim=1).indices.to(torch.int32)
    weights = 0.05 + torch.rand(T, topk, generator=gen) / 4
    return ids.cuda(), weights.cuda()


def timed(fn, iters, group):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(iters):
        dist.barrier(group)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(1e3 * a.elapsed_time(b))
    times.sort()
    med, p99 = statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))]
    out = torch.tensor([med, p99], device="cuda")
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out.tolist()


def a2a_case(rank, P, T, K, E, topk, routing, iters):
    E_local = E // P
    ids, weights = routing_ids(routing, T, E, E_local, topk, 100 + rank)
    hidden = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    state = {}

    def dispatch():
        amax = hidden.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
        scale = amax / 448.0
        q = (hidden.float() / scale).to(torch.float8_e4m3fn)
        flat = ids.reshape(-1).long()
        dest = flat // E_local
        order = torch.argsort(dest, stable=True)
        token = order // topk
        send_counts = torch.bincount(dest, minlength=P)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        sc, rc = send_counts.tolist(), recv_counts.tolist()
        rows = q.view(torch.uint8)[token]
        recv_rows = torch.empty(sum(rc), K, device="cuda", dtype=torch.uint8)
        dist.all_to_all_single(recv_rows, rows, rc, sc)
        recv_scale = torch.empty(sum(rc), 1, device="cuda")
        dist.all_to_all_single(recv_scale, scale[token].contiguous(), rc, sc)
        recv_ids = torch.empty(sum(rc), device="cuda", dtype=torch.int64)
        dist.all_to_all_single(recv_ids, flat[order].contiguous(), rc, sc)
        state.update(order=order, token=token, sc=sc, rc=rc, recv_rows=recv_rows, recv_ids=recv_ids)

    dispatch()
    expert_rows = torch.randn(sum(state["rc"]), K, device="cuda", dtype=torch.bfloat16)

    def combine():
        back = torch.empty(len(state["order"]), K, device="cuda", dtype=torch.bfloat16)
        dist.all_to_all_single(back, expert_rows, state["sc"], state["rc"])
        w = weights.reshape(-1)[state["order"]].unsqueeze(1)
        out = torch.zeros(T, K, device="cuda", dtype=torch.float32)
        out.index_add_(0, state["token"], back.float() * w)
        return out.to(torch.bfloat16)

    def both():
        dispatch()
        combine()

    return {"dispatch_us": timed(dispatch, iters, None), "combine_us": timed(combine, iters, None),
            "round_trip_us": timed(both, iters, None)}


def symm_case(rank, P, T, K, E, topk, routing, iters):
    import torch.distributed._symmetric_memory as symm_mem
    E_local = E // P
    ids, _ = routing_ids(routing, T, E, E_local, topk, 100 + rank)
    group_name = dist.group.WORLD.group_name
    symm_mem.set_backend("NVSHMEM")
    max_out = T * topk * P
    inp = symm_mem.empty(T * topk, K, dtype=torch.bfloat16, device="cuda")
    out = symm_mem.empty(max_out, K, dtype=torch.bfloat16, device="cuda")
    in_splits = symm_mem.empty(E, dtype=torch.int64, device="cuda")
    out_splits_offsets = symm_mem.empty((2, E), dtype=torch.int64, device="cuda")
    in_splits.copy_(torch.bincount(ids.reshape(-1).long(), minlength=E))
    inp.normal_()

    def dispatch():
        torch.ops.symm_mem.all_to_all_vdev_2d(inp, out, in_splits, out_splits_offsets, group_name, major_align=1)

    return {"dispatch_us": timed(dispatch, iters, None)}


def worker(rank, P, spec, queue):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=P, device_id=torch.device("cuda", rank))
    results = []
    for row in spec["rows"]:
        T, routing = row["T"], row["routing"]
        entry = {"T": T, "routing": routing}
        entry["all_to_all_single"] = a2a_case(rank, P, T, spec["K"], spec["E"], spec["topk"], routing, 30)
        try:
            entry["all_to_all_vdev_2d"] = symm_case(rank, P, T, spec["K"], spec["E"], spec["topk"], routing, 30)
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            entry["all_to_all_vdev_2d"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        results.append(entry)
        if rank == 0:
            print(f"torch baselines: {routing} T = {T} done", file=sys.stderr, flush=True)
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main():
    spec = json.load(open(sys.argv[1]))
    out_path = sys.argv[2]
    commit = sys.argv[3] if len(sys.argv) > 3 else ""
    P = spec["ranks"]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, P, spec, queue)) for r in range(P)]
    for p in procs:
        p.start()
    results = queue.get(timeout=900)
    for p in procs:
        p.join(timeout=120)
    spec["commit"] = commit
    spec["torch"] = torch.__version__
    spec["baselines"] = results
    json.dump(spec, open(out_path, "w"), indent=2)
    print(f"{'routing':<8} {'T':>5} {'moekit disp':>11} {'torch disp':>10} {'x':>6} {'moekit comb':>11} "
          f"{'torch comb':>10} {'x':>6} {'vdev_2d disp':>12}")
    for row, base in zip(spec["rows"], results):
        a = base["all_to_all_single"]
        v = base["all_to_all_vdev_2d"]
        vtext = f"{v['dispatch_us'][0]:.1f}" if "dispatch_us" in v else "n/a"
        print(f"{row['routing']:<8} {row['T']:>5} {row['dispatch_us'][0]:>11.1f} {a['dispatch_us'][0]:>10.1f} "
              f"{a['dispatch_us'][0] / row['dispatch_us'][0]:>6.1f} {row['combine_us'][0]:>11.1f} "
              f"{a['combine_us'][0]:>10.1f} {a['combine_us'][0] / row['combine_us'][0]:>6.1f} {vtext:>12}")
    for base in results:
        if "error" in base["all_to_all_vdev_2d"]:
            print(f"all_to_all_vdev_2d did not run: {base['all_to_all_vdev_2d']['error']}")
            break


if __name__ == "__main__":
    main()
