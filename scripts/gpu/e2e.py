"""End-to-end check of one tiny Hugging Face fixture (tests/fixtures/models/NAME,
made by transformers through scripts/fixtures/models.py) on a moeforge backend,
the way a user runs it: import-hf writes the model block, a deployment puts it
on RANKS ranks, `moeforge compile` emits the bundle, `moeforge run --backend B`
serves the fixture's prompts greedily. The greedy tokens must be
transformers' (expected.json) exactly. Prints one JSON object (tokens, match,
median step milliseconds, the decode graphs the run reports); exits 1 on a mismatch or a failed
command. With E2E_EAGER=1 the run takes --eager (every decode step call by call, no graphs);
with E2E_EXPECT_GRAPHS=1 it fails unless decode graphs were recorded and replayed, none refused;
with E2E_CAPTURE=N the run records both modes' graphs for buckets up to N before serving
(--capture-graphs N; without it `run` records those its prompts can fill, its default), and
with E2E_EXPECT_GRAPHS=1 then fails if serving recorded any more.
The deployment's switch policy has t_high = auto, so a dual-mode run without SWITCH_AT first
measures TP and EP decode steps as it serves them (Moebius §4.5; graph replays on one GPU);
the JSON's "calibration" holds them and the T_h they gave.

Usage: python3 e2e.py MOEFORGE BACKEND FIXTURE_DIR RANKS START WORKDIR [SWITCH_AT [TILES [PLACEMENT]]]
       python3 e2e.py --compile MOEFORGE FIXTURE_DIR RANKS OUT_BUNDLE [TILES [PLACEMENT]]
TILES names a tile set of models/tiles.moe (default: 64×64 tiles sized for the tiny models).
PLACEMENT `zepp` gives the deployment Zepp's replicas (4 redundant experts) in place of its
switch policy (replicas and TP<->EP switching do not combine), and runs it with a one-step
drift window swapping on any imbalance (--swap-window 1 --swap-threshold 1), so slot swaps
run on the side stream beside the decode steps; with E2E_EXPECT_GRAPHS=1 some must.
The second form only compiles the bundle (scripts/gpu-check.sh --prepare, where moeforge
links LLVM), with nvcc when it finds one (MOEFORGE_NVCC or the PATH), so the bundle carries
the cubins the GPU run loads; with E2E_BUNDLE set to such a bundle, the first form serves it instead of
compiling (a runner built without LLVM compiles no plan).
"""
import json
import os
import re
import shutil
import statistics
import subprocess
import sys


def deployment(model_block: str, ranks: int, tiles: str = "", placement: str = "") -> str:
    # The tests' CPU cluster (tests/common/cpu_spec.rs): small "GPUs" whose
    # plan fits every rank's buffer on one real GPU; fp8 checkpoints take
    # 128-deep K blocks (their scale blocks) and more of the buffer.
    fp8 = "fp8_e4m3" in model_block
    k = 128 if fp8 else 64
    fraction = 0.6 if fp8 else 0.25
    tile = f"block_m = 64 block_n = 64 block_k = {k} stages = 2"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    using = f'use "{root}/models/tiles.moe"\n' if tiles else ""
    if placement not in ("", "zepp"):
        raise ValueError(f"unknown placement {placement!r} (zepp, or none)")
    policy = ("placement { policy = zepp redundant_experts = 4 }" if placement
              else "switch { t_high = auto t_low = 2 window = 2 cooldown = 0s }")
    return using + f"""{model_block}
cluster cpu {{ nodes = 1 gpus_per_node = {ranks}
  gpu cpu {{ arch = sm_90a sms = 4 hbm = 256MB hbm_bandwidth = 1TB/s bf16 = 100TFLOP/s smem_per_sm = 228KiB smem_per_block = 227KiB }}
  scale_up shm {{ bandwidth = 10GB/s latency = 1us }} }}
tiles t {{ prefill {{ gate_up {{ {tile} }} down {{ {tile} }} }}
  decode {{ gate_up {{ {tile} }} down {{ {tile} }} }} }}
deploy tiny {{ model = tiny cluster = cpu tiles = {tiles or "t"} slo {{ ttft = 1s tpot = 50ms }}
  workload {{ input = sharegpt output = sharegpt arrival poisson {{ rate = 1req/s }} }}
  {policy} memory_fraction = {fraction} }}
"""


def run(cmd: list, what: str) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{what} failed ({p.returncode}): {(p.stderr or p.stdout).strip()[-1500:]}")
    return p.stdout


def compile_bundle(moeforge: str, fixture: str, ranks: int, bundle: str, tiles: str, work: str,
                   nvcc: str = "off", placement: str = "") -> None:
    """import-hf, the deployment on RANKS ranks, `moeforge compile --nvcc NVCC` into BUNDLE."""
    model = os.path.join(work, "model.moe")
    run([moeforge, "import-hf", fixture, "-o", model, "--name", "tiny"], "import-hf")
    spec = os.path.join(work, "tiny.moe")
    with open(spec, "w") as f:
        f.write(deployment(open(model).read(), ranks, tiles, placement))
    run([moeforge, "compile", spec, "-o", bundle, "--nvcc", nvcc], "compile")


def main() -> int:
    if sys.argv[1:2] == ["--compile"]:
        moeforge, fixture, ranks, out_bundle = sys.argv[2:6]
        tiles = sys.argv[6] if len(sys.argv) > 6 else ""
        placement = sys.argv[7] if len(sys.argv) > 7 else ""
        work = out_bundle + ".work"
        os.makedirs(work, exist_ok=True)
        # With nvcc where --prepare runs: the bundle carries cubins, which the
        # GPU machine's run loads without building (its device line says so).
        compile_bundle(moeforge, fixture, int(ranks), out_bundle, tiles, work, nvcc="auto", placement=placement)
        shutil.rmtree(work, ignore_errors=True)
        return 0
    moeforge, backend, fixture, ranks, start, work = sys.argv[1:7]
    switch_at = sys.argv[7] if len(sys.argv) > 7 else ""
    tiles = sys.argv[8] if len(sys.argv) > 8 else ""
    placement = sys.argv[9] if len(sys.argv) > 9 else ""
    os.makedirs(work, exist_ok=True)
    name = os.path.basename(os.path.normpath(fixture))
    out = {"fixture": name, "backend": backend, "ranks": int(ranks), "start": start, "switch_at": switch_at,
           "tiles": tiles or "t", "placement": placement or "none"}
    try:
        expected = json.load(open(os.path.join(fixture, "expected.json")))
        reqs = expected["requests"]
        bundle = os.path.join(work, "bundle")
        prepared = os.environ.get("E2E_BUNDLE", "")
        if prepared:
            if not os.path.isfile(os.path.join(prepared, "plan.json")):
                raise RuntimeError(f"no prepared bundle at {prepared}: run scripts/gpu-check.sh --prepare")
            shutil.rmtree(bundle, ignore_errors=True)
            shutil.copytree(prepared, bundle)
        else:
            compile_bundle(moeforge, fixture, int(ranks), bundle, tiles, work, placement=placement)
        cmd = [moeforge, "run", bundle, "--backend", backend, "--weights", fixture, "--start", start,
               "--max-new", str(max(len(r["tokens"]) for r in reqs))]
        for r in reqs:
            cmd += ["--prompt", " ".join(map(str, r["prompt"]))]
        if switch_at:
            cmd += ["--switch-at", switch_at]
        if placement:
            cmd += ["--swap-window", "1", "--swap-threshold", "1"]
        if os.environ.get("E2E_EAGER") == "1":
            cmd += ["--eager"]
            out["eager"] = True
        capture = os.environ.get("E2E_CAPTURE", "")
        if capture:
            cmd += ["--capture-graphs", capture]
        text = run(cmd, f"run --backend {backend}")
        got = {int(m.group(1)): [int(t) for t in m.group(2).split()]
               for m in re.finditer(r"^request (\d+): ([\d ]*)$", text, re.M)}
        want = {i: r["tokens"] for i, r in enumerate(reqs)}
        steps = [float(m.group(1)) for m in re.finditer(r"^\s*\d+\s+\S+\s+\d+\s+\d+\s+([\d.]+)$", text, re.M)]
        out.update(tokens=[got.get(i, []) for i in range(len(reqs))], expected=[want[i] for i in range(len(reqs))],
                   match=all(got.get(i, [])[: len(w)] == w for i, w in want.items()),
                   switches=len(re.findall(r"^switch before step", text, re.M)),
                   median_step_ms=statistics.median(steps) if steps else None, steps=len(steps))
        device = re.search(r"^device: (.*)$", text, re.M)
        if device:
            out["device"] = device.group(1)
        # The decode graphs (recorded, replayed, warm-up and call-by-call
        # steps, padding rows) and any recording the device refused.
        graphs = re.search(r"^decode graphs: (\d+) recorded.*?, (\d+) decode steps replayed one, (\d+) ran as a "
                           r"bucket's warm-up, (\d+) ran call by call.*?, (\d+) padding rows(;.*)?$", text, re.M)
        if graphs:
            out["graphs"] = dict(zip(["recorded", "replayed", "warmups", "eager", "padding_rows"],
                                     map(int, graphs.groups()[:5])))
            early = re.search(r"^decode graphs: \d+ recorded \([^)]*?, (\d+) before serving\)", text, re.M)
            out["graphs"]["before_serving"] = int(early.group(1)) if early else 0
            after = re.search(r"before a later slot swap: (\d+) \((\d+) issued while a swap was still queued",
                              graphs.group(6) or "")
            if after:
                out["graphs"].update(after_swap=int(after.group(1)), beside_swap=int(after.group(2)))
        # t_high = auto (a dual-mode run without --switch-at): the TP and EP
        # decode costs the run measured on its own steps (or modeled).
        cal = re.search(r"^calibration, (measured|modeled)[^(]*\([^)]*\): (.*)$", text, re.M)
        if cal:
            costs = [[int(b), float(tp), float(ep)] for b, tp, ep in
                     re.findall(r"B=(\d+): tp ([\d.]+) ms, ep ([\d.]+) ms", cal.group(2))]
            th = re.search(r"^policy: T_h = (\d+|never)", text, re.M)
            unfit = re.search(r"B=(\d+) does not fit one (tp|ep) step", cal.group(2))
            context = re.search(r"with (\d+) cached tokens each", cal.group(0))
            out["calibration"] = {"measured": cal.group(1) == "measured", "batch_tp_ep_ms": costs,
                                  "cached_tokens": int(context.group(1)) if context else None,
                                  "unfit": [int(unfit.group(1)), unfit.group(2)] if unfit else None,
                                  "t_high": th.group(1) if th else None}
        swaps = re.search(r"^slot swaps: (\d+)", text, re.M)
        out["swaps"] = int(swaps.group(1)) if swaps else 0
        before = re.search(r"^decode graphs recorded before serving: (.*?) \(", text, re.M)
        if before:
            out["recorded_before_serving"] = before.group(1)
        refused = re.findall(r"^decode graph not recorded: (.*)$", text, re.M)
        if refused:
            out["graph_refusals"] = refused
        # E2E_EXPECT_GRAPHS=1: the run must have recorded and replayed decode
        # graphs, none refused (a device that fell back to call-by-call steps
        # would still give the tokens, and prove nothing about the graphs).
        if os.environ.get("E2E_EXPECT_GRAPHS") == "1":
            g = out.get("graphs", {})
            if not (g.get("recorded", 0) > 0 and g.get("replayed", 0) > 0) or refused:
                out.update(match=False, error=f"no decode graph recorded and replayed without refusal: {g} {refused}")
            # Recorded before serving: every recording was one of those, and no
            # serving step was a bucket's warm-up (one first met while serving is).
            elif capture and not (g.get("before_serving", 0) == g.get("recorded") and g.get("warmups") == 0):
                out.update(match=False, error=f"graphs recorded while serving after --capture-graphs: {g}")
            # With replicas, graphs replayed across the slot swaps, some issued
            # while a swap was still queued (the graph's event-wait node held
            # that layer's experts until it finished), so the tokens above also
            # say each graph waited for the bytes its swap moved.
            elif placement and not (out["swaps"] > 0 and g.get("after_swap", 0) > 0 and g.get("beside_swap", 0) > 0):
                out.update(match=False, error=f"no graph replayed beside a slot swap: {out['swaps']} swaps, {g}")
    except (RuntimeError, OSError, KeyError, ValueError) as e:
        out.update(match=False, error=str(e))
    print(json.dumps(out))
    return 0 if out.get("match") else 1


if __name__ == "__main__":
    sys.exit(main())
