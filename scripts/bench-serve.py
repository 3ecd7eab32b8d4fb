#!/usr/bin/env python3
"""Load benchmark of `moeforge serve` on the CPU backend.

Compiles the tiny Qwen3-shaped deployment (examples/tiny-qwen3-cpu4.moe) with the release
binary, writes seeded weights and the fixture tokenizer beside them, starts the server on a
free loopback port and drives it with closed-loop streaming clients (httpx, raw SSE) at 1, 16
and 64 concurrent clients. For each level it prints

  throughput      requests/s and generated tokens/s
  TTFT, TPOT      p50 and p99, measured by the clients
  server cost     per request, in µs: the CPU time of the server's HTTP threads (from
                  /proc/<pid>/task, so axum/hyper, JSON and SSE included) and, from
                  /metrics, the time the server itself counts outside engine steps;
                  and both as a share of the engine's step time at that level

    python3 scripts/bench-serve.py [--requests-per-client 4] [--max-tokens 32]

Needs httpx or httpx2 (the openai package's; the venv scripts/test.sh makes has it:
.toolchain/venv/bin/python) and cargo.
The machine is shared and noisy: compare the shares, not single latencies.
"""
import argparse
import asyncio
import json
import os
import pathlib
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

try:
    import httpx2 as httpx  # what the openai package ships with now
except ImportError:
    import httpx

ROOT = pathlib.Path(__file__).resolve().parents[1]


def pct(xs, p):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


def metrics(url):
    text = httpx.get(url + "/metrics").text
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(moeforge_[a-z_]+(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def http_cpu(pid):
    """CPU seconds of the server's HTTP threads (named moeforge-http)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            if not comm.startswith("moeforge-http"):
                continue
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except OSError:
            pass
    return total / tick


async def one(client, url, prompt, max_tokens, rows):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first = last = None
    n = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            got = len(chunk["choices"][0].get("token_ids", []))
            if got:
                now = time.perf_counter()
                first = first or now
                last = now
                n += got
    rows.append((first - t0, (last - first) / (n - 1) if n > 1 else None, n))


async def level(url, clients, per_client, max_tokens, rng):
    rows = []
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(16, 64))] for _ in range(clients * per_client)]
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker(i):
            for j in range(per_client):
                await one(client, url, prompts[i * per_client + j], max_tokens, rows)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(clients)))
        wall = time.perf_counter() - t0
    return rows, wall


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--levels", default="1,16,64")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    a = ap.parse_args()

    subprocess.run(["cargo", "build", "--release", "--quiet", "--bin", "moeforge"], cwd=ROOT, check=True)
    exe = ROOT / "target" / "release" / "moeforge"
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="moeforge-bench-"))
    spec = ROOT / "examples" / "tiny-qwen3-cpu4.moe"
    subprocess.run([exe, "init-weights", spec, "--seed", "7", "-o", tmp / "weights"], check=True, stdout=subprocess.DEVNULL)
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(ROOT / "tests" / "fixtures" / "tokenizer" / f, tmp / "weights" / f)
    subprocess.run([exe, "compile", spec, "-o", tmp / "bundle", "--nvcc", "off"], check=True, stdout=subprocess.DEVNULL)
    server = subprocess.Popen(
        [exe, "serve", tmp / "bundle", "--weights", tmp / "weights", "--port", "0", "--max-queue", "1024"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url = None
        for line in server.stdout:
            print("server:", line.rstrip())
            if line.startswith("listening on "):
                url = line.split()[-1]
                break
        rng = random.Random(1)
        print(f"\nmax_tokens {a.max_tokens}, {a.requests_per_client} requests per client, prompts of 16-63 tokens")
        print(
            f"{'clients':>7} {'req/s':>7} {'tok/s':>8} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'p99':>8}"
            f" {'http µs/req':>11} {'share':>6} {'counted µs/req':>14} {'share':>6}"
        )
        for clients in [int(x) for x in a.levels.split(",")]:
            m0, c0 = metrics(url), http_cpu(server.pid)
            rows, wall = asyncio.run(level(url, clients, a.requests_per_client, a.max_tokens, rng))
            m1, c1 = metrics(url), http_cpu(server.pid)
            n = len(rows)
            steps = m1["moeforge_step_seconds_total"] - m0["moeforge_step_seconds_total"]
            counted = m1["moeforge_server_seconds_total"] - m0["moeforge_server_seconds_total"]
            cpu = c1 - c0
            toks = sum(r[2] for r in rows)
            ttft = [r[0] for r in rows]
            tpot = [r[1] for r in rows if r[1] is not None]
            print(
                f"{clients:>7} {n / wall:>7.2f} {toks / wall:>8.1f} {pct(ttft, 50) * 1e3:>7.1f}ms {pct(ttft, 99) * 1e3:>6.1f}ms"
                f" {pct(tpot, 50) * 1e3:>7.2f}ms {pct(tpot, 99) * 1e3:>6.2f}ms"
                f" {cpu / n * 1e6:>11.0f} {cpu / steps:>6.1%} {counted / n * 1e6:>14.0f} {counted / steps:>6.1%}"
            )
        print(
            "\nhttp µs/req: CPU of the server's HTTP threads (axum/hyper, JSON, SSE, tokenization) per request;"
            "\ncounted: the server's own moeforge_server_seconds_total per request (handlers, dispatch, engine-thread"
            "\nbookkeeping); share: of moeforge_step_seconds_total, the engine's step time, over the same interval."
        )
    finally:
        server.terminate()
        server.wait(timeout=60)
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print("kept", tmp)


if __name__ == "__main__":
    sys.exit(main())
