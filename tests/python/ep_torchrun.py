"""One rank of the expert-parallel layer from Python, under torchrun (test_gpu.py runs it on 2 GPUs):
    python -m torch.distributed.run --nproc-per-node 2 ep_torchrun.py MODEL T SEED QUANT E CLI_OUTPUT
Each rank builds its E / ranks experts and its T tokens as `moekit run --dp ranks --seed SEED` draws
them, runs the layer over torch.distributed's world (NCCL between the GPUs), and compares its output
with the CLI's CLI_OUTPUT.rank<r>; then one step captured by torch.cuda.graph and replayed."""
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

import moekit


def main():
    model, T, seed, quant, E, cli_prefix = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], \
        int(sys.argv[5]), sys.argv[6]
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    rank, ranks = dist.get_rank(), dist.get_world_size()
    w = moekit.synthetic_inputs(model, tokens=T, quant=quant, seed=seed, rank=rank, ranks=ranks, num_experts=E,
                                device="cuda")
    layer = moekit.MoeLayer(model, weights=w, max_tokens_per_rank=T, quant=quant, group=dist.group.WORLD,
                            num_experts=E)
    out = layer(w["hidden"], w["router_logits"])
    got = out.view(torch.int16).cpu().numpy().view(np.uint16).reshape(-1)
    equal = np.array_equal(got, np.fromfile(f"{cli_prefix}.rank{rank}", dtype=np.uint16))

    static = torch.full_like(out.view(torch.int16), -1).view(torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer.enqueue(w["hidden"], w["router_logits"], static)
    static.view(torch.int16).fill_(-1)
    dist.barrier()
    graph.replay()
    layer.check_status()
    replay_equal = torch.equal(static.view(torch.int16), out.view(torch.int16))
    # The same step with the most tokens of any rank declared (every rank feeds T): the same bits.
    declared = torch.full_like(out.view(torch.int16), -1).view(torch.bfloat16)
    layer.enqueue(w["hidden"], w["router_logits"], declared, max_tokens_any_rank=T)
    layer.check_status()
    replay_equal = replay_equal and torch.equal(declared.view(torch.int16), out.view(torch.int16))
    print(f"rank {rank}: equal to moekit run --dp {ranks}: {equal}; graph replay equal: {replay_equal}; "
          f"dispatch {layer.dispatch}, E_local {w['w1'].shape[0]}, workspace {layer.workspace_bytes} bytes", flush=True)
    del graph, layer
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0 if equal and replay_equal else 1)


if __name__ == "__main__":
    main()
