"""Host memory bandwidth and a fused CPU AdamW on this machine's cores (torch), the bound
on floe's host optimizer (`engine.offload_optimizer`): prints GB/s of a copy, a triad and
torch's fused AdamW over 2^28 f32 parameters (1 GiB each of weights, grads, m, v)."""
import os
import time

import torch

torch.set_num_threads(os.cpu_count())
n = 1 << 28
a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)


def best(f, reps=4):
    f()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


gb = n * 4 / 1e9
print(f"threads {torch.get_num_threads()}")
print(f"copy  {2 * gb / best(lambda: a.copy_(b)):.1f} GB/s")
print(f"triad {3 * gb / best(lambda: torch.add(b, c, alpha=0.5, out=a)):.1f} GB/s")
p, g, m, v = torch.rand(n), torch.rand(n) * 1e-2, torch.zeros(n), torch.zeros(n)
steps = torch.zeros((), dtype=torch.float32)


def adamw():
    steps.add_(1)
    torch._fused_adamw_([p], [g], [m], [v], [], [steps], lr=1e-3, beta1=0.9, beta2=0.999,
                        weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)


t = best(adamw)
# Reads p, g, m, v and writes p, m, v: 28 bytes a parameter.
print(f"torch fused AdamW: {n / t / 1e9:.2f} G params/s ({28 * n / t / 1e9:.1f} GB/s); "
      f"8.2B params would take {8.2e9 * t / n:.2f} s")
