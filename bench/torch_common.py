"""Shared by the PyTorch baselines (torch_baseline.py, torch_layer.py): CUDA-event timing."""
import statistics

import torch


def median_p99_ms(fn, reps=20):
    """Median and p99 of `fn`'s time in ms over `reps` runs after 3 warm-up runs (CUDA events)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))]


def random_fp8(shape, gen):
    """Random e4m3 codes over most of the range, for timing runs."""
    return (torch.randn(shape, device="cuda", generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
