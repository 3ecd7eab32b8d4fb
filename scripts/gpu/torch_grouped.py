"""cuBLAS baseline for the APK GPU check: the same grouped expert computation
(GateUp -> SiLU(gate)*up -> Down per local expert, bf16) through PyTorch's
matmul, timed with CUDA events (median of repeats after warm-up).

Usage:
  python3 torch_grouped.py HIDDEN INTER LOCAL_EXPERTS ROWS_PER_EXPERT REPEATS
      prints one JSON object (time and TFLOP/s);
  python3 torch_grouped.py profile HIDDEN INTER LOCAL_EXPERTS M_T REPEATS
      prints a moeforge latency profile of the `moe` component:
      {"samples": [{"component": "moe", "x": x_moe, "s": 0, "t": seconds}, ...]}
      over rows per expert from 1 to 2048, x_moe = LOCAL_EXPERTS * ceil(rows / M_T)
      (ExpertPlex Eq. 3), for `moeforge compile/simulate --profile`.
"""
import json
import sys

import torch


def time_grouped(hidden: int, inter: int, experts: int, rows: int, repeats: int) -> float:
    """Median microseconds of one grouped GateUp -> SiLU*up -> Down over `experts` experts."""
    g = torch.Generator(device="cuda").manual_seed(20261130)
    dev, dt = "cuda", torch.bfloat16
    w13 = [torch.randn(2 * inter, hidden, device=dev, dtype=dt, generator=g) * 0.02 for _ in range(experts)]
    w2 = [torch.randn(hidden, inter, device=dev, dtype=dt, generator=g) * 0.02 for _ in range(experts)]
    x = [torch.randn(rows, hidden, device=dev, dtype=dt, generator=g) for _ in range(experts)]

    def run() -> None:
        for e in range(experts):
            gu = x[e] @ w13[e].t()
            act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
            _ = act @ w2[e].t()

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    if sys.argv[1] == "profile":
        hidden, inter, experts, m_t, repeats = (int(a) for a in sys.argv[2:7])
        samples = []
        for rows in (1, 8, 32, 64, 128, 256, 512, 1024, 2048):
            us = time_grouped(hidden, inter, experts, rows, repeats)
            x = experts * -(-rows // m_t)
            samples.append({"component": "moe", "x": x, "s": 0, "t": us * 1e-6})
        print(json.dumps({"samples": samples}))
        return
    hidden, inter, experts, rows, repeats = (int(a) for a in sys.argv[1:6])
    us = time_grouped(hidden, inter, experts, rows, repeats)
    flops = experts * rows * (2.0 * hidden * 2 * inter + 2.0 * inter * hidden)
    print(json.dumps({"torch_us": us, "torch_tflops": flops / (us * 1e-6) / 1e12, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
