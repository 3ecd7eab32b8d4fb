"""PyTorch baseline for the APK GPU check: the same grouped expert
computation (GateUp -> SiLU(gate)*up -> Down per local expert) on the same
ragged row counts the APK ran (apk_check's COUNTS file), through
`torch._grouped_mm` (bf16) and `torch._scaled_grouped_mm` (fp8 e4m3 with
row-wise scales), each captured in a CUDA graph and timed with CUDA events
(median of replays after warm-up). FLOPs count valid rows only, as the APK's do.

Usage: python3 torch_grouped.py HIDDEN INTER COUNTS_FILE REPEATS
Prints one JSON object; a variant that fails records its error instead of a time.
"""
import json
import sys

import torch


def timed(fn, repeats: int) -> float:
    """Median microseconds of a graph replay of `fn`."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    hidden, inter = int(sys.argv[1]), int(sys.argv[2])
    counts = [int(c) for c in open(sys.argv[3]).read().split()]
    repeats = int(sys.argv[4])
    experts, rows = len(counts), sum(counts)
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(20261204)
    x = torch.randn(rows, hidden, device=dev, dtype=bf, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=bf, generator=g) * 0.02
    w2 = torch.randn(experts, hidden, inter, device=dev, dtype=bf, generator=g) * 0.02
    offs = torch.tensor(counts, device=dev, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    flops = rows * (2.0 * hidden * 2 * inter + 2.0 * inter * hidden)
    out = {"torch": torch.__version__, "torch_rows": rows}

    def bf16_run():
        gu = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs)
        act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        return torch._grouped_mm(act, w2.transpose(-2, -1), offs=offs)

    try:
        us = timed(bf16_run, repeats)
        out.update(torch_bf16_us=us, torch_bf16_tflops=flops / (us * 1e-6) / 1e12)
    except Exception as e:  # noqa: BLE001 - recorded in the report, never skipped silently
        out["torch_bf16_error"] = f"{type(e).__name__}: {e}"[:300]

    try:
        f8 = torch.float8_e4m3fn
        xq = x.to(f8)
        xs = torch.ones(rows, device=dev, dtype=torch.float32)
        w13q = w13.to(f8)  # [E, 2I, H]: transposed, it is column-major as the kernel wants
        w2q = w2.to(f8)
        s13 = torch.ones(experts, 2 * inter, device=dev, dtype=torch.float32)
        s2 = torch.ones(experts, hidden, device=dev, dtype=torch.float32)
        ones_act = torch.ones(rows, device=dev, dtype=torch.float32)

        def fp8_run():
            gu = torch._scaled_grouped_mm(xq, w13q.transpose(-2, -1), xs, s13, offs=offs, out_dtype=bf)
            act = (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]).to(f8)
            return torch._scaled_grouped_mm(act, w2q.transpose(-2, -1), ones_act, s2, offs=offs, out_dtype=bf)

        us = timed(fp8_run, repeats)
        out.update(torch_fp8_us=us, torch_fp8_tflops=flops / (us * 1e-6) / 1e12)
    except Exception as e:  # noqa: BLE001
        out["torch_fp8_error"] = f"{type(e).__name__}: {e}"[:300]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
