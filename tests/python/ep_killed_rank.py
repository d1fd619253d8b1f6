"""A rank killed mid-run (test_gpu.py starts this twice, one process per GPU, without torchrun,
whose agent would stop the survivor too): both ranks run a good step; rank 1 then SIGKILLs itself;
rank 0 steps again, eagerly (forward: its per-step exchange finds the peer gone) and enqueued (the
NCCL kernels wait for the dead peer's flags until MOEKIT_EP_TIMEOUT_MS), and must raise
moekit.Error both times within a bounded time, never hang. Prints one line per outcome.
    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python ep_killed_rank.py"""
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import moekit


def main():
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("gloo")
    model, T, E = "deepseek-v3", 16, 32
    w = moekit.synthetic_inputs(model, tokens=T, rank=rank, ranks=2, num_experts=E, device="cuda")
    layer = moekit.MoeLayer(model, weights=w, max_tokens_per_rank=T, num_experts=E,
                            group=moekit.TorchGroup(timeout_s=20))
    out = layer(w["hidden"], w["router_logits"])
    torch.cuda.synchronize()
    print(f"rank {rank}: first step ok", flush=True)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(2)  # rank 1 is gone
    for how in ("forward", "enqueue"):
        start = time.perf_counter()
        try:
            if how == "forward":
                layer(w["hidden"], w["router_logits"], out=out)
            else:
                layer.enqueue(w["hidden"], w["router_logits"], out)
                layer.check_status()
            print(f"rank 0: {how} after the peer died: no error", flush=True)
        except moekit.Error as e:
            first = str(e).splitlines()[0][:300]
            print(f"rank 0: {how} after the peer died: moekit.Error after {time.perf_counter() - start:.1f} s: {first}",
                  flush=True)
    sys.stdout.flush()
    os._exit(0)  # the group is broken; the teardown of a broken layer is not what this checks


if __name__ == "__main__":
    main()
