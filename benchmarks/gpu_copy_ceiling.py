"""The GPU's copy ceiling, measured: a 4 GiB device-to-device copy through PyTorch (the GPU
image has it; tallow does not need it), timed with CUDA events, median of 10 after 3 warm-ups,
counting bytes read plus bytes written. The decode roofline uses the datasheet figure; this
is the figure the card reaches, to read the measured decode speed against."""

import statistics

import torch

n = 4 << 30
src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
dst = torch.empty_like(src)
for _ in range(3):
    dst.copy_(src)
times = []
for _ in range(10):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dst.copy_(src)
    end.record()
    end.synchronize()
    times.append(start.elapsed_time(end) / 1e3)
t = statistics.median(times)
name = torch.cuda.get_device_name()
print(f"{name}: copy {2 * n / t / 1e12:.2f} TB/s (median of 10, {t * 1e3:.2f} ms)")
