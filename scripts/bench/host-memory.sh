#!/usr/bin/env bash
# Host memory of serving a checkpoint on the emulated device: a ~0.86 GB
# bf16 checkpoint (scripts/bench/mid-qwen3-cpu4.moe) on four ranks, one
# prompt. Prints the peak resident memory of the moeforge process (anonymous:
# what it allocated, sampled every 50 ms, so a lower bound; VmHWM: the true
# peak, with the mapped checkpoint's file pages, which are page cache) and
# the largest child's (the emulated device's process with the four rank
# buffers, what a GPU would hold; the kernel builds are smaller). Needs
# ~6 GB of RAM and a release build; give another build's binary to compare.
#   scripts/bench/host-memory.sh [MOEFORGE_BINARY]
set -euo pipefail
bin="$(realpath "${1:-$(dirname "$0")/../../target/release/moeforge}")"
cd "$(dirname "$0")/../.."
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$bin" init-weights scripts/bench/mid-qwen3-cpu4.moe --seed 7 -o "$work/w" >/dev/null
"$bin" compile scripts/bench/mid-qwen3-cpu4.moe -o "$work/b" --nvcc off >/dev/null
python3 - "$bin" "$work" <<'PY'
import os, subprocess, sys, time
bin, work = sys.argv[1:3]
err_path = f"{work}/run.err"
p = subprocess.Popen([bin, "run", f"{work}/b", "--backend", "emu", "--weights", f"{work}/w", "--prompt", "1 2 3",
                      "--max-new", "2"], stdout=subprocess.DEVNULL, stderr=open(err_path, "w"))
peak = {}
def field(pid, name):
    try:
        for l in open(f"/proc/{pid}/status"):
            if l.startswith(name + ":"):
                return int(l.split()[1])
    except OSError:
        return None
def children(pid):
    try:
        return [int(c) for t in os.listdir(f"/proc/{pid}/task")
                for c in open(f"/proc/{pid}/task/{t}/children").read().split()]
    except OSError:
        return []
while p.poll() is None:
    for pid in [p.pid] + children(p.pid):
        who = "moeforge" if pid == p.pid else "device"
        for name in ("RssAnon", "VmHWM"):
            v = field(pid, name)
            if v is not None:
                peak[(who, name)] = max(peak.get((who, name), 0), v)
    time.sleep(0.05)
err = open(err_path).read()
if p.returncode:
    sys.exit(f"run failed ({p.returncode}): {err[-2000:]}")
ckpt = os.path.getsize(f"{work}/w/model.safetensors") / 2**20
mib = lambda who, name: peak.get((who, name), 0) / 1024
print(f"checkpoint {ckpt:.0f} MiB; moeforge peak: {mib('moeforge', 'RssAnon'):.0f} MiB anonymous, "
      f"{mib('moeforge', 'VmHWM'):.0f} MiB resident with the mapped file; "
      f"emulated device peak: {mib('device', 'VmHWM'):.0f} MiB")
PY
