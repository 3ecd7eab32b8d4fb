#!/usr/bin/env bash
# The GPU check: one run that turns a GPU into a verdict on the emitted
# kernels and the cuda backend, with a JSON report.
#
#   scripts/gpu-check.sh --prepare     # here (needs cargo): the bundles and a
#                                      # stripped moeforge into gpu-bundles/
#   scripts/gpu-check.sh OUT_DIR       # on an NVIDIA GPU machine (nvcc, PyTorch)
#   scripts/gpu-check.sh --emu OUT_DIR # anywhere: the same steps that need no GPU,
#                                      # the model runs on the emulated device
#
# Steps (each under `timeout`, each one JSON line in OUT_DIR/steps.jsonl;
# nothing skips silently: a missing bundle or tool is a failed step, a step
# this build cannot run is listed under "missing" with the reason):
#   (a) build   apk_check (+ its static-tile baseline) around every bundle's
#               kernels/apk*.cu and copy_check with -Xptxas -v; a spill or
#               stack frame in a kernel fails the step.
#   (b) apk     numerics on every valid output row against an independent
#               reference (empty, 1-row, M_t-1, M_t+1 experts, routed counts,
#               a contended prefill+decode pair, re-instantiated operations;
#               outputs poisoned by host copies), then (h) prefill TFLOP/s,
#               decode/prefill slowdown under sharing, preemption delay, and
#               (i) the APK's measured latency profile (profile-*.json).
#   (h) static  the static-tile build: scheduling overhead = APK / static - 1.
#   (c) torch   torch._grouped_mm (bf16) and torch._scaled_grouped_mm (fp8) on
#               the same ragged counts, CUDA-graph replays.
#   (f) copy    the reshard's descriptors of one layer: the bundle's transfer
#               program (kernels/xfer_reshard.ptx, LLVM's PTX) and cuMemcpy2D
#               against a device-to-device copy of the same bytes.
#   (d) e2e     tiny Qwen3-MoE, Mixtral, DeepSeek-V3 (bf16 and fp8), MiniMax-M2
#               and GPT-OSS fixtures end to end with `moeforge run --backend
#               cuda`, live switches included; greedy tokens = transformers'.
#               Decode steps run as CUDA graphs (one per mode and batch bucket,
#               one GPU), a Zepp placement's too (Qwen3-MoE on 4 ranks with
#               replicas: its decode dispatch routes on the device and takes
#               fixed slots; slots swapped after every step, each swap held
#               20 ms on the side stream, which the graphs' event-wait nodes
#               must wait for); (d') the first case again with --eager beside it.
#   (e) sanitizer  compute-sanitizer memcheck on one end-to-end run and
#               racecheck on a small APK run.
#   (j) route   the replica routing (GLM-5's kernels/zepp_route.cu) on the
#               DeepSeek-V3 4 x 8 decode and prefill cases `cargo bench --bench
#               routing` writes: every entry's slot against the host routing,
#               and the slowest GPU's routing time per MoE layer over the
#               modeled layer (Zepp's budget: ~5% of an iteration).
# Exit status: 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."

# The bundles the check runs, tiny first: the issue's expert shapes (Qwen3-30B-A3B;
# MiniMax-M2, GLM-5 and DeepSeek-V3 with fp8 experts) and the portable path (Mixtral on A100 tiles).
EXAMPLES=(tiny-qwen3-cpu4 qwen3-30b-a3b-h200 minimax-m2-h800 glm-5-h800x24 deepseek-v3-h100x32 mixtral-8x7b-a100)
# The end-to-end runs (d): FIXTURE RANKS START SWITCH_AT TILES PLACEMENT ("-": none;
# PLACEMENT `zepp`: Zepp replicas, no switch, as e2e.py's deployment says).
# --prepare compiles their bundles here (the GPU machine's runner links no
# LLVM, so it compiles no plan); the GPU run serves them.
E2E_CASES=(
  "qwen3-moe 2 ep 3 - -"
  "qwen3-moe 4 ep - - zepp"
  "qwen3-moe 4 ep 2,4,6 - -"
  "mixtral 2 tp 2,5 - -"
  "deepseek-v3 2 ep 2,5 - -"
  "deepseek-v3-fp8 2 ep - - -"
  "minimax-m2 4 ep 2,5 - -"
  "gpt-oss 2 ep - - -"
  "qwen3-moe 2 tp 3 hopper-bf16 -"
)

if [[ "${1:-}" == "--prepare" ]]; then
  set -e
  cargo build --release --quiet
  rm -rf gpu-bundles.tmp
  mkdir -p gpu-bundles.tmp/bin
  for ex in "${EXAMPLES[@]}"; do
    ./target/release/moeforge compile "examples/$ex.moe" -o "gpu-bundles.tmp/$ex" --nvcc off >/dev/null 2>&1
  done
  # The end-to-end bundles carry cubins (nvcc from MOEFORGE_NVCC, else setup.sh's, else the PATH).
  if [[ -z "${MOEFORGE_NVCC:-}" ]]; then
    for c in .toolchain/venv/lib/python3*/site-packages/nvidia/cu*/bin/nvcc; do
      [[ -x "$c" ]] && export MOEFORGE_NVCC="$PWD/$c"
    done
  fi
  for c in "${E2E_CASES[@]}"; do
    read -r fixture ranks _ _ tiles placement <<<"$c"
    [[ "$tiles" == - ]] && tiles=""
    [[ "$placement" == - ]] && placement=""
    python3 scripts/gpu/e2e.py --compile ./target/release/moeforge "tests/fixtures/models/$fixture" "$ranks" \
      "gpu-bundles.tmp/e2e/$fixture-$ranks${tiles:+-$tiles}${placement:+-$placement}" "$tiles" "$placement"
  done
  # The routing cases (j): the host routing's answers beside their inputs.
  MOEFORGE_ROUTING_CASES="$PWD/gpu-bundles.tmp/routing" cargo bench --quiet --bench routing
  # The runner the GPU machine gets links no LLVM (the bundles carry their
  # transfer programs compiled): the same moeforge without the `llvm` feature.
  CARGO_TARGET_DIR=target/runner cargo build --release --quiet --no-default-features --bin moeforge
  strip -o gpu-bundles.tmp/bin/moeforge target/runner/release/moeforge
  if ldd gpu-bundles.tmp/bin/moeforge | grep -q libLLVM; then
    echo "the runner links LLVM" >&2
    exit 1
  fi
  rm -rf gpu-bundles && mv gpu-bundles.tmp gpu-bundles
  echo "prepared: $(ls gpu-bundles | tr '\n' ' ')(carry gpu-bundles to the GPU machine)"
  exit 0
fi

EMU=0
if [[ "${1:-}" == "--emu" ]]; then
  EMU=1
  shift
fi
OUT_DIR="${1:?usage: scripts/gpu-check.sh [--emu] OUT_DIR | --prepare}"
mkdir -p "$OUT_DIR/profiles"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
STEPS="$OUT_DIR/steps.jsonl"
: >"$STEPS"
# Steps that would start after this many seconds are recorded as not run
# (so the report comes back inside a lease); each step also has its own timeout.
BUDGET="${GPU_CHECK_BUDGET_S:-420}"
START=$(date +%s)
BUILD="$(mktemp -d)"
trap 'rm -rf "$BUILD"' EXIT

find_nvcc() {
  local venv=.toolchain/venv/lib/python3.11/site-packages/nvidia/cu13/bin/nvcc
  for c in "${NVCC:-}" "$(command -v nvcc || true)" /usr/local/cuda/bin/nvcc "$venv"; do
    [[ -n "$c" && -x "$c" ]] && { echo "$c"; return; }
  done
}
NVCC="$(find_nvcc)"
MOEFORGE="${MOEFORGE:-}"
# The emulated run compiles bundles: it needs the moeforge built with LLVM.
[[ -z "$MOEFORGE" && "${1:-}" == --emu && -x target/release/moeforge ]] && MOEFORGE="$PWD/target/release/moeforge"
[[ -z "$MOEFORGE" && -x "${GPU_BUNDLES:-gpu-bundles}/bin/moeforge" ]] && MOEFORGE="$(realpath "${GPU_BUNDLES:-gpu-bundles}/bin/moeforge")"
[[ -z "$MOEFORGE" && -x target/release/moeforge ]] && MOEFORGE="$PWD/target/release/moeforge"

# record STEP NAME OK SECONDS JSON_OR_ERROR: one line of steps.jsonl.
record() {
  python3 - "$STEPS" "$@" <<'PY'
import json, sys
path, step, name, ok, secs, payload = sys.argv[1:7]
line = {"step": step, "name": name, "ok": ok == "1", "seconds": round(float(secs), 1)}
lines = payload.strip().splitlines()
try:
    last = [l for l in lines if l.strip().startswith("{")][-1]
    line["result"] = json.loads(last)
    # Whatever else the command printed (a sanitizer's report, say).
    rest = "\n".join(l for l in lines if l is not last).strip()
    if rest:
        line["output"] = rest[-3000:]
except (IndexError, ValueError):
    line["error" if ok != "1" else "output"] = payload.strip()[-3000:]
open(path, "a").write(json.dumps(line) + "\n")
PY
}

# run_step STEP NAME SECONDS CMD...: runs CMD under `timeout`, records it.
run_step() {
  local step="$1" name="$2" limit="$3"
  shift 3
  if (( $(date +%s) - START >= BUDGET )); then
    record "$step" "$name" 0 0 "not run: the check's time budget (GPU_CHECK_BUDGET_S=$BUDGET s) was spent"
    return 1
  fi
  local t0 out rc err
  err="$(mktemp -p "$BUILD")"
  t0=$(date +%s.%N)
  out="$(timeout --kill-after=10 "$limit" "$@" 2>"$err")"
  rc=$?
  local secs
  secs=$(python3 -c "import time,sys; print(time.time()-float(sys.argv[1]))" "$t0")
  if [[ $rc -eq 0 ]]; then
    record "$step" "$name" 1 "$secs" "$out"
  else
    local why
    [[ $rc -eq 124 || $rc -eq 137 ]] && why="timed out after ${limit} s" || why="exit $rc"
    # Keep a JSON result when the command printed one (a numerics failure still reports its figures).
    if [[ "$out" == *"{"* ]]; then
      record "$step" "$name" 0 "$secs" "$out"
      python3 - "$STEPS" "$why: $(tail -c 1500 "$err")" <<'PY'
import json, sys
lines = open(sys.argv[1]).read().splitlines()
last = json.loads(lines[-1]); last["error"] = sys.argv[2]
lines[-1] = json.dumps(last); open(sys.argv[1], "w").write("\n".join(lines) + "\n")
PY
    else
      record "$step" "$name" 0 "$secs" "$why: $(tail -c 1500 "$err") $out"
    fi
  fi
  return $rc
}

# The environment.
env_json="$(python3 - "$NVCC" "$EMU" <<'PY'
import json, subprocess, sys
def sh(*c):
    try:
        return subprocess.run(c, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unavailable: {e}"
print(json.dumps({"nvcc": sys.argv[1] or None, "nvcc_version": sh(sys.argv[1], "--version").splitlines()[-1:] if sys.argv[1] else None,
                  "gpu": sh("nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"),
                  "emu": sys.argv[2] == "1"}))
PY
)"
record env environment 1 0 "$env_json"
[[ -n "$NVCC" ]] || record build nvcc 0 0 "no nvcc: install CUDA, or run scripts/setup.sh for the toolchain venv"
[[ -n "$MOEFORGE" ]] || record e2e moeforge 0 0 "no moeforge binary: run scripts/gpu-check.sh --prepare (or set MOEFORGE)"

# The bundles: gpu-bundles/ from --prepare; the emulated run compiles the tiny one itself.
if [[ $EMU -eq 1 ]]; then
  BUNDLES="$BUILD/bundles"
  mkdir -p "$BUNDLES"
  run_step prepare tiny-qwen3-cpu4 120 "$MOEFORGE" compile examples/tiny-qwen3-cpu4.moe -o "$BUNDLES/tiny-qwen3-cpu4" --nvcc off
  examples=(tiny-qwen3-cpu4)
else
  BUNDLES="${GPU_BUNDLES:-gpu-bundles}"
  examples=("${EXAMPLES[@]}")
fi
# The APKs the check runs: every form of the tiny bundle, one experts APK of each other.
kernels=()
static_kernels=(tiny-qwen3-cpu4/apk qwen3-30b-a3b-h200/apk minimax-m2-h800/apk)
for ex in "${examples[@]}"; do
  if [[ ! -f "$BUNDLES/$ex/plan.json" ]]; then
    record prepare "$ex" 0 0 "missing bundle $BUNDLES/$ex: run scripts/gpu-check.sh --prepare and carry gpu-bundles"
    continue
  fi
  for src in "$BUNDLES/$ex"/kernels/apk*.cu; do
    [[ -f "$src" ]] && kernels+=("$ex/$(basename "$src" .cu)")
    [[ "$ex" == tiny-* ]] || break
  done
done

# (a) Builds, in parallel; ptxas's report is parsed for spills and stack frames.
build_one() {  # build_one BUNDLE/KERNEL [static]
  local k="$1" variant="${2:-}" ex="${1%%/*}" name="${1##*/}"
  local arch gencode bin="$BUILD/${ex}-${name}${variant:+-static}"
  arch="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["cluster"]["arch"])' "$BUNDLES/$ex/plan.json")"
  case "$arch" in
    sm90a) gencode="-gencode=arch=compute_90a,code=sm_90a" ;;
    *) gencode="-gencode=arch=compute_80,code=[compute_80,sm_80]" ;;
  esac
  "$NVCC" $gencode -O3 -std=c++17 -Xptxas -v ${variant:+-DAPK_STATIC_TILES} \
    -DKERNEL_SOURCE="\"$(realpath "$BUNDLES/$ex/kernels/$name.cu")\"" -o "$bin" scripts/gpu/apk_check.cu \
    >"$bin.log" 2>&1 || { echo "nvcc failed: $(tail -c 1200 "$bin.log")"; return 1; }
  python3 - "$bin.log" "$k${variant:+ (static)}" <<'PY'
import json, re, sys
text = open(sys.argv[1]).read()
funcs = {}
for m in re.finditer(r"Function properties for (\S+)\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text):
    funcs[m.group(1)] = {"stack": int(m.group(2)), "spill_stores": int(m.group(3)), "spill_loads": int(m.group(4))}
regs = {m.group(1): int(m.group(2)) for m in re.finditer(r"Compiling entry function '(\S+)'.*?\n(?:.*\n)*?.*?Used (\d+) registers", text)}
bad = {f: v for f, v in funcs.items() if v["spill_stores"] or v["spill_loads"] or (v["stack"] and "reference" not in f)}
print(json.dumps({"kernel": sys.argv[2], "functions": funcs, "registers": regs, "spills": bad}))
sys.exit(1 if bad or not funcs else 0)
PY
}
export -f build_one
export NVCC BUILD BUNDLES
if [[ -n "$NVCC" ]]; then
  for k in "${kernels[@]}"; do
    run_step build "$k" 300 bash -c "build_one $k" &
    [[ $EMU -eq 0 && " ${static_kernels[*]} " == *" $k "* ]] && run_step build "$k (static)" 300 bash -c "build_one $k static" &
  done
  run_step build copy_check 300 "$NVCC" -O3 -std=c++17 -Xptxas -v -gencode=arch=compute_90a,code=sm_90a \
    -o "$BUILD/copy_check" scripts/gpu/copy_check.cu &
  route_src="$BUNDLES/glm-5-h800x24/kernels/zepp_route.cu"
  if [[ -f "$route_src" ]]; then
    run_step build route_check 300 "$NVCC" -O3 -std=c++17 -Werror all-warnings \
      -Xptxas -v,-warn-spills,-warn-lmem-usage -gencode=arch=compute_90a,code=sm_90a \
      -DKERNEL_SOURCE="\"$(realpath "$route_src")\"" -o "$BUILD/route_check" scripts/gpu/route_check.cu &
  elif [[ $EMU -eq 0 ]]; then
    record build route_check 0 0 "missing $route_src: run scripts/gpu-check.sh --prepare and carry gpu-bundles"
  fi
  wait
fi

have_gpu=0
[[ $EMU -eq 0 ]] && nvidia-smi >/dev/null 2>&1 && have_gpu=1
if [[ $EMU -eq 0 && $have_gpu -eq 0 ]]; then
  record apk gpu 0 0 "no GPU: nvidia-smi failed (run with --emu on a machine without one)"
fi

# (b)(h)(i) The APK on the GPU, its static-tile baseline, then (c) the torch baseline on the same counts.
apk_steps() {  # apk_steps BUNDLE/KERNEL
  local k="$1" ex="${1%%/*}" name="${1##*/}"
  local bin="$BUILD/${ex}-${name}"
  [[ -x "$bin" ]] || return 0  # its build step failed, and says so
  read -r top_k experts hidden inter x_star <<<"$(python3 - "$BUNDLES/$ex/plan.json" "$name" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
k = next(k for k in p["kernels"] if k["name"] == sys.argv[2])["params"]
print(p["model"]["top_k"], p["model"]["experts"], k["hidden"], k["inter"], k["x_star"])
PY
)"
  # ExpertPlex §7.3: 8192 prefill tokens and 128 decode tokens (the tiny model: 512 and 16).
  local tp=8192 td=128 limit=150
  [[ "$ex" == tiny-* ]] && { tp=512; td=16; limit=60; }
  run_step apk "$k" "$limit" "$bin" "$tp" "$td" "$top_k" "$experts" 20 "$BUILD/$ex-$name.counts" \
    "$OUT_DIR/profiles/$ex-$name.json" "$x_star"
  [[ -x "$bin-static" ]] && run_step static "$k" 90 "$bin-static" "$tp" "$td" "$top_k" "$experts" 20 \
    "$BUILD/$ex-$name.static-counts" /dev/null "$x_star"
  [[ -f "$BUILD/$ex-$name.counts" && "$ex" != tiny-* ]] && run_step torch "$k" 120 env PYTHONUNBUFFERED=1 python3 \
    scripts/gpu/torch_grouped.py "$hidden" "$inter" "$BUILD/$ex-$name.counts" 20
  return 0
}

# (d) End to end: the fixtures through `moeforge run`, tokens against transformers'.
backend=cuda
[[ $EMU -eq 1 ]] && backend=emu
export MOEFORGE_NVCC="$NVCC"
e2e() {  # e2e FIXTURE RANKS START [SWITCH_AT [TILES [PLACEMENT]]]
  [[ -n "$MOEFORGE" ]] || return 0
  # The bundle --prepare compiled for this case; the emulated run compiles its own.
  local prepared="" variant="${5:+-$5}${6:+-$6}"
  [[ $EMU -eq 0 ]] && prepared="$BUNDLES/e2e/$1-$2$variant"
  E2E_BUNDLE="$prepared" run_step e2e "$1 P=$2 $3${4:+ switch@$4}${5:+ $5}${6:+ $6}" 240 python3 scripts/gpu/e2e.py \
    "$MOEFORGE" "$backend" "tests/fixtures/models/$1" "$2" "$3" "$BUILD/e2e-$1-$2-$3$variant" "${4:-}" "${5:-}" \
    "${6:-}"
}

# Tiny first, then the model end to end, then the large shapes.
for k in "${kernels[@]}"; do
  [[ $have_gpu -eq 1 && "$k" == tiny-* ]] && apk_steps "$k"
done
# (j) The replica routing on the GPU: correctness and time per MoE layer (seconds;
# before the long steps, so the time budget never skips it).
if [[ $have_gpu -eq 1 && -x "$BUILD/route_check" ]]; then
  for case in decode prefill; do
    if [[ -f "$BUNDLES/routing/$case.txt" ]]; then
      run_step route "$case" 60 "$BUILD/route_check" "$BUNDLES/routing/$case.txt" 50
    else
      record route "$case" 0 0 "missing $BUNDLES/routing/$case.txt: run scripts/gpu-check.sh --prepare"
    fi
  done
fi

# The GPUs this process may use: CUDA_VISIBLE_DEVICES's, else every one nvidia-smi lists.
ngpu=0
if [[ $have_gpu -eq 1 ]]; then
  if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
    ngpu=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c . || true)
  else
    ngpu=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
  fi
fi
if [[ $have_gpu -eq 1 || $EMU -eq 1 ]]; then
  first=1
  for c in "${E2E_CASES[@]}"; do
    read -r fixture ranks start switch tiles placement <<<"$c"
    [[ "$switch" == - ]] && switch=""
    [[ "$tiles" == - ]] && tiles=""
    [[ "$placement" == - ]] && placement=""
    # The emulated run: the first case and the replicated one only.
    [[ $EMU -eq 1 && $first -eq 0 && -z "$placement" ]] && continue
    # The first case (EP over 2 ranks: its decode dispatch takes fixed slots) and the
    # replicated one (the same, routed on the device) must run their decode steps as graphs
    # where the device records them: emulated, or one GPU.
    expect=0
    [[ ( $first -eq 1 || -n "$placement" ) && ( $EMU -eq 1 || $ngpu -eq 1 ) ]] && expect=1
    # The replicated case swaps slots after every step (e2e.py); on the GPU each swap is held
    # 20 ms on the side stream, so a step (or a graph) that did not wait for its layer's swap
    # before the experts would compute with the old bytes and miss transformers' tokens (its
    # median step includes those holds).
    delay=0
    [[ -n "$placement" ]] && delay=20
    # The first case records both modes' graphs before serving (a weight-only warm-up switch
    # into TP and back, Moebius §4.4) and must then record none while serving.
    capture=""
    [[ $first -eq 1 ]] && capture=8
    MOEFORGE_CUDA_SIDE_DELAY_MS=$delay E2E_CAPTURE=$capture E2E_EXPECT_GRAPHS=$expect e2e "$fixture" "$ranks" "$start" \
      "$switch" "$tiles" "$placement"
    first=0
  done
fi
# first_case LABEL SUFFIX [VAR=VALUE...]: the first end-to-end case again on the cuda device,
# from its prepared bundle, with the variables set for that run.
first_case() {
  local label="$1" suffix="$2" fixture ranks start switch tiles placement
  shift 2
  read -r fixture ranks start switch tiles placement <<<"${E2E_CASES[0]}"
  [[ "$switch" == - ]] && switch=""
  [[ "$tiles" == - ]] && tiles=""
  run_step e2e "$fixture P=$ranks $start${switch:+ switch@$switch}${tiles:+ $tiles} $label" 240 \
    env "$@" E2E_BUNDLE="$BUNDLES/e2e/$fixture-$ranks${tiles:+-$tiles}" python3 scripts/gpu/e2e.py \
    "$MOEFORGE" cuda "tests/fixtures/models/$fixture" "$ranks" "$start" "$BUILD/e2e-$fixture-$ranks-$start-$suffix" \
    "$switch" "$tiles"
}
if [[ $have_gpu -eq 1 && -n "$MOEFORGE" ]]; then
  # (d, peers) With two or more GPUs the runs above spread the ranks over them (rank r on the
  # r-th GPU, mod their count), every transfer reaching the others through peer access; the
  # first case again with every rank on GPU 0 (where it records its decode graphs).
  (( ngpu >= 2 )) && first_case "one GPU" one-gpu E2E_EXPECT_GRAPHS=1 MOEFORGE_CUDA_DEVICES=0
  # (d') The first case again with --eager: every decode step call by call, no decode graphs.
  # The run on one GPU (every rank's buffer on it) recorded each (mode, batch bucket)'s decode
  # step as a CUDA graph and replayed it (its JSON's "graphs"; a recording the GPU refused is
  # listed under "graph_refusals" and that step ran call by call); its median step beside this
  # one's is what the graphs save, and both must give transformers' tokens.
  first_case eager eager E2E_EAGER=1
  # (g') The first case again with every launch waited for (MOEFORGE_CUDA_SYNC=1): its median
  # step beside the queued launches' (the run above), the cost of waiting per launch. It also
  # re-encodes every APK launch's templates and fails if they differ from the ones the cuda
  # device kept for the same arguments (the queued run reads them back only once per launch).
  first_case "launches waited" sync MOEFORGE_CUDA_SYNC=1
fi
# (e) compute-sanitizer memcheck: the first end-to-end run's bundle served again (a few tokens; a
# switch forced past its end, so the spec's t_high = auto does not calibrate under memcheck).
SAN="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
if [[ $have_gpu -eq 1 ]]; then
  b="$BUILD/e2e-qwen3-moe-2-ep/bundle"
  if [[ ! -x "$SAN" ]]; then
    record sanitizer compute-sanitizer 0 0 "compute-sanitizer not found"
  elif [[ -n "$MOEFORGE" && -f "$b/plan.json" ]]; then
    run_step sanitizer "memcheck e2e qwen3-moe P=2 ep" 240 env MOEFORGE_CUDA_WATCHDOG_S=200 "$SAN" --tool memcheck \
      --error-exitcode 9 --print-limit 20 "$MOEFORGE" run "$b" --backend cuda --weights tests/fixtures/models/qwen3-moe \
      --start ep --max-new 3 --prompt "3 17 42 99 5 64 7" --prompt "120 1" --switch-at 100
  fi
fi
for k in "${kernels[@]}"; do
  [[ $have_gpu -eq 1 && "$k" != tiny-* ]] && apk_steps "$k"
done

# (f) The reshard's descriptors of one layer (dual-mode bundles).
if [[ $have_gpu -eq 1 ]]; then
  for ex in qwen3-30b-a3b-h200 tiny-qwen3-cpu4; do
    [[ -f "$BUNDLES/$ex/plan.json" && -x "$BUILD/copy_check" ]] || continue
    python3 - "$BUNDLES/$ex/plan.json" "$BUILD/$ex.copies" "$BUILD/$ex.table" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))["memory"]
r = m["reshard"]["ep_to_tp"]
slot = m["slots"]["slot_bytes"]
with open(sys.argv[2], "w") as f:
    f.write(f'{m["group"]} {slot}\n')
    for c in r["per_layer"]:
        f.write(" ".join(str(v) for v in [c["src_rank"], c["dst_rank"], c["src_offset"], c["dst_offset"], c["run_bytes"],
                                          *c["counts"], *c["src_strides"], *c["dst_strides"]]) + "\n")
# This layer's batch of the bundle's transfer program (moeforge_xfer::Batch::words):
# the program's shapes are both directions' distinct (run, counts, strides) in
# order of first appearance; each rank's source slot at 0 of its region and
# its destination slot at SLOT (copy_check's layout).
key = lambda c: (c["run_bytes"], *c["counts"], *c["src_strides"], *c["dst_strides"])
live = lambda c: c["run_bytes"] and c["counts"][0] and c["counts"][1]
shapes = []
for c in m["reshard"]["ep_to_tp"]["per_layer"] + m["reshard"]["tp_to_ep"]["per_layer"]:
    if live(c) and key(c) not in shapes:
        shapes.append(key(c))
per = [[c for c in r["per_layer"] if live(c) and key(c) == k] for k in shapes]
words = [len(v) for v in per]
for v in per:
    for c in v:
        words += [c["src_rank"], c["dst_rank"], c["src_offset"], slot + c["dst_offset"]]
open(sys.argv[3], "w").write(" ".join(map(str, words)) + "\n")
PY
    run_step copy "$ex ep_to_tp" 90 "$BUILD/copy_check" "$BUILD/$ex.copies" "$BUNDLES/$ex/kernels/xfer_reshard.ptx" \
      "$BUILD/$ex.table" 20
  done
fi

# (e) racecheck on a small APK run (memcheck ran after the end-to-end runs).
if [[ $have_gpu -eq 1 && -x "$SAN" ]]; then
  tiny="$BUILD/tiny-qwen3-cpu4-apk"
  [[ -x "$tiny" ]] && run_step sanitizer "racecheck apk tiny" 180 "$SAN" --tool racecheck --error-exitcode 9 \
    --print-limit 20 "$tiny" 64 8 4 16 1 "$BUILD/san.counts" /dev/null 4
fi

python3 - "$STEPS" "$OUT_DIR/gpu-check.json" "$EMU" <<'PY'
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
emu = sys.argv[3] == "1"
res = lambda s: s.get("result", {})
missing = {
    "graphs": "decode graphs are recorded only when the cuda device drives one GPU (with several, each step runs call by call), and only for decode steps whose dispatch takes fixed slots (replicated ones included, not relayed ones or --verify-routing runs); prefill is never a graph",
    "multi_gpu": "one process drives the machine's GPUs with peer access (rank r on the r-th GPU, mod their count), exercised only with two or more GPUs (on one, every rank's buffer is on it); no NCCL or NVSHMEM path across nodes yet",
    "transfer_programs": "every communication op (reshard, dispatch, combine, TP all-reduce) is an inkwell-generated transfer program; only the reshard's is timed here (copy_check), the others run inside the model steps untimed",
    "profile_components": "the profile measures the APK (`moe`) only: attention, dense GEMMs and communication are not measured",
}
if emu:
    missing["gpu_steps"] = "(b)(c)(e)(f)(h)(i)(j) need a GPU: this run built every APK with nvcc and ran the model on the emulated device (the routing step's driver build is tests/nvcc.rs's)"
report = {"emu": emu, "steps": steps, "missing": missing}
apk = {s["name"]: res(s) for s in steps if s["step"] == "apk"}
static = {s["name"]: res(s) for s in steps if s["step"] == "static"}
torch = {s["name"]: res(s) for s in steps if s["step"] == "torch"}
rows = []
for k, a in apk.items():
    r = dict(a)
    if "static_prefill_us" in static.get(k, {}) and "prefill_alone_us" in a:
        r["scheduling_overhead"] = a["prefill_alone_us"] / static[k]["static_prefill_us"] - 1.0
    t = torch.get(k, {})
    base = t.get("torch_fp8_us") if a.get("fp8") else t.get("torch_bf16_us")
    if base and "prefill_alone_us" in a:
        r["prefill_vs_torch"] = base / a["prefill_alone_us"]
    r.update({f"torch_{x}": v for x, v in t.items() if not x.startswith("torch")})
    r.update({x: v for x, v in t.items() if x.startswith("torch")})
    rows.append((k, r))
report["apk"] = dict(rows)
goals = {}
q = report["apk"].get("qwen3-30b-a3b-h200/apk")
if q and "prefill_vs_torch" in q:
    goals["apk_prefill_vs_torch_bf16 (Qwen3-30B-A3B, >= 0.9)"] = round(q["prefill_vs_torch"], 3)
for k in ("glm-5-h800x24/apk_e10", "minimax-m2-h800/apk"):
    a = report["apk"].get(k)
    if a and "decode_slowdown" in a:
        goals[f"{k}: decode slowdown (<= 1.05)"] = a["decode_slowdown"]
        if "decode_slowdown_xstar" in a:
            goals[f"{k}: decode slowdown at the plan's x* = {a['x_star']} (<= 1.05)"] = a["decode_slowdown_xstar"]
        goals[f"{k}: prefill slowdown (<= 1.10)"] = a["prefill_slowdown"]
        goals[f"{k}: preemption delay us (<= one tile, {a.get('mean_tile_us')} us)"] = a["preemption_delay_us"]
for s in steps:
    if s["step"] == "copy" and "kernel_vs_d2d" in res(s):
        goals[f"reshard transfer / D2D copy ({s['name']}, >= 0.9)"] = res(s)["kernel_vs_d2d"]
for s in steps:
    if s["step"] == "route" and "routing_over_layer" in res(s):
        ok = res(s).get("mismatches") == 0
        goals[f"zepp routing / modeled MoE layer ({s['name']}, Zepp's budget ~0.05)"] = (
            res(s)["routing_over_layer"] if ok else f"FAIL: {res(s).get('mismatches')} entries routed wrongly")
e2e = [s for s in steps if s["step"] == "e2e"]
waited = [s for s in e2e if s["name"].endswith(" launches waited") and res(s).get("median_step_ms")]
if waited:
    queued = [s for s in e2e if s["name"] == waited[0]["name"][: -len(" launches waited")]]
    if queued and res(queued[0]).get("median_step_ms"):
        q, w = res(queued[0])["median_step_ms"], res(waited[0])["median_step_ms"]
        goals[f"median step, launches queued / waited ({queued[0]['name']})"] = f"{q} / {w} ms = {q / w:.2f}"
for s in e2e:
    c = res(s).get("calibration")
    if c:
        goals[f"t_high = auto ({s['name']}): T_h, (batch, TP ms, EP ms) at {c.get('cached_tokens')} cached tokens"
              + ("" if c["measured"] else " MODELED, not measured")] = f"{c['t_high']}; {c['batch_tp_ep_ms']}"
goals["end-to-end tokens = transformers'"] = f"{sum(1 for s in e2e if s['ok'])}/{len(e2e)} runs"
report["goals"] = goals
report["ok"] = all(s["ok"] for s in steps)
json.dump(report, open(sys.argv[2], "w"), indent=1)
print(f"{'step':<10} {'name':<44} {'ok':<4} {'s':>6}  detail")
for s in steps:
    r = res(s)
    if s["step"] == "apk" and r:
        d = (f"err {r.get('worst_rel_err', float('nan')):.1e} on {r.get('rows_checked')} rows, {r.get('prefill_tflops', 0):.1f} TFLOP/s, "
             f"dec x{r.get('decode_slowdown', 0):.3f} pre x{r.get('prefill_slowdown', 0):.3f}, preempt {r.get('preemption_delay_us', 0):.1f} us")
    elif s["step"] == "e2e" and r:
        d = f"match={r.get('match')} switches={r.get('switches')} step {r.get('median_step_ms')} ms" + (f" {r['error'][:150]}" if "error" in r else "")
    elif s["step"] == "torch" and r:
        d = f"bf16 {r.get('torch_bf16_tflops', r.get('torch_bf16_error', '?'))} TFLOP/s, fp8 {r.get('torch_fp8_tflops', r.get('torch_fp8_error', '?'))}"
    elif s["step"] == "copy" and r:
        d = f"kernel {r.get('kernel_gbs')} GB/s, memcpy2d {r.get('memcpy2d_gbs')}, d2d {r.get('d2d_gbs')}"
    elif s["step"] == "route" and r:
        d = f"{r.get('mismatches')} mismatches in {r.get('entries')} entries, {r.get('routing_us')} us per layer ({r.get('routing_over_layer')} of {r.get('modeled_layer_us')} us)"
    elif s["step"] == "static" and r:
        d = f"static prefill {r.get('static_prefill_us')} us"
    elif s["step"] == "build" and r:
        d = f"regs {r.get('registers', {}).get('moe_apk', '-')}, spills {r.get('spills') or 'none'}"
    else:
        d = (s.get("error") or json.dumps(r))[:160].replace("\n", " ")
    if s.get("error") and r:
        d += " | " + s["error"][:200].replace("\n", " ")
    print(f"{s['step']:<10} {s['name'][:44]:<44} {'ok' if s['ok'] else 'FAIL':<4} {s['seconds']:>6}  {d}")
print("goals:")
for k, v in goals.items():
    print(f"  {k}: {v}")
print("missing:")
for k, v in missing.items():
    print(f"  {k}: {v}")
print(f"report: {sys.argv[2]}")
sys.exit(0 if report["ok"] else 1)
PY
