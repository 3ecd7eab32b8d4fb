#!/usr/bin/env bash
# GPU check of the emitted Adaptive Persistent Kernels (issue 4).
#
#   scripts/gpu-check.sh --prepare     # here (needs cargo): compile the examples into gpu-bundles/
#   scripts/gpu-check.sh [BUNDLE...]   # on a machine with an NVIDIA GPU, nvcc and PyTorch
#
# For each bundle's kernels/apk*.cu: builds scripts/gpu/apk_check.cu around it
# (sm_90a, or PTX for compute_80 for sm_80 bundles), runs it (numerics of both
# layouts against a float64 reference, prefill TFLOP/s, scheduling overhead
# against the same kernel built with -DAPK_STATIC_TILES (tiles dealt
# round-robin, no claims or reallocation), decode latency alone
# and with a prefill posted 10 µs before it, preemption delay), runs the
# PyTorch/cuBLAS baseline on the same shapes, and writes one JSON line per
# kernel to $OUT/gpu-check.jsonl (./gpu-check.jsonl without $OUT), then a table.
# It also writes $OUT/profile-BUNDLE.json: the `moe` component measured
# through cuBLAS over a sweep of x_moe, a latency profile for
# `moeforge compile --profile` and `moeforge simulate --profile`.
# Numerics fail the run (exit 1) above a relative error of 1e-2.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--prepare" ]]; then
  rm -rf gpu-bundles
  # The issue's expert shapes (Qwen3-30B-A3B, MiniMax-M2 and DeepSeek-V3, the
  # last two fp8), the portable path (Mixtral, A100 tiles) and small shapes.
  for ex in qwen3-30b-a3b-h200 minimax-m2-h800 deepseek-v3-h100x32 mixtral-8x7b-a100 tiny-qwen3-cpu4; do
    cargo run --release --quiet -- compile "examples/$ex.moe" -o "gpu-bundles/$ex" --nvcc off >/dev/null
  done
  echo "prepared: $(ls gpu-bundles | tr '\n' ' ')(carry gpu-bundles to the GPU machine)"
  exit 0
fi

NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
OUT_DIR="${OUT:-.}"
REPORT="$OUT_DIR/gpu-check.jsonl"
BUILD="$(mktemp -d)"
trap 'rm -rf "$BUILD"' EXIT
mkdir -p "$OUT_DIR"
: >"$REPORT"
bundles=("$@")
[[ ${#bundles[@]} -gt 0 ]] || bundles=(gpu-bundles/*)
status=0
for b in "${bundles[@]}"; do
  [[ -f "$b/plan.json" ]] || { echo "skip $b: no plan.json"; continue; }
  read -r arch top_k experts <<<"$(python3 -c '
import json, sys
p = json.load(open(sys.argv[1]))
print(p["cluster"]["arch"], p["model"]["top_k"], p["model"]["experts"])' "$b/plan.json")"
  case "$arch" in
    sm90a) gencode="-gencode=arch=compute_90a,code=sm_90a" ;;
    *) gencode="-gencode=arch=compute_80,code=compute_80" ;;
  esac
  for src in "$b"/kernels/apk*.cu; do
    [[ -f "$src" ]] || continue
    name="$(basename "$b")-$(basename "$src" .cu)"
    bin="$BUILD/$name"
    "$NVCC" $gencode -O3 -std=c++17 -DKERNEL_SOURCE="\"$(realpath "$src")\"" -o "$bin" scripts/gpu/apk_check.cu
    "$NVCC" $gencode -O3 -std=c++17 -DAPK_STATIC_TILES -DKERNEL_SOURCE="\"$(realpath "$src")\"" -o "$bin-static" \
      scripts/gpu/apk_check.cu
    read -r hidden inter local <<<"$(python3 -c '
import json, sys
p = json.load(open(sys.argv[1]))
k = next(k for k in p["kernels"] if k["name"] == sys.argv[2])["params"]
print(k["hidden"], k["inter"], k["local_experts"])' "$b/plan.json" "$(basename "$src" .cu)")"
    # ExpertPlex §7.3: 8192 prefill tokens and 128 decode tokens, routed top-k over all experts.
    if ! line="$("$bin" 8192 128 "$top_k" "$experts" 20 2>&1)"; then
      echo "FAILED $name: $line"
      status=1
    fi
    if ! static="$("$bin-static" 8192 128 "$top_k" "$experts" 20 2>&1)"; then
      echo "FAILED $name (static tiles): $static"
      status=1
    fi
    rows=$(( 8192 * top_k / experts ))
    torch="$(python3 scripts/gpu/torch_grouped.py "$hidden" "$inter" "$local" "$rows" 20 || echo '{}')"
    m_t="$(python3 -c '
import json, sys
p = json.load(open(sys.argv[1]))
print(next(k for k in p["kernels"] if k["name"] == sys.argv[2])["params"]["m_t_prefill"])' "$b/plan.json" "$(basename "$src" .cu)")"
    python3 scripts/gpu/torch_grouped.py profile "$hidden" "$inter" "$local" "$m_t" 10 \
      >"$OUT_DIR/profile-$name.json" || rm -f "$OUT_DIR/profile-$name.json"
    python3 -c '
import json, sys
a = json.loads(sys.argv[1]) if sys.argv[1].startswith("{") else {"error": sys.argv[1]}
t = json.loads(sys.argv[2])
a.update(t)
a.update(json.loads(sys.argv[4]) if sys.argv[4].startswith("{") else {"static_error": sys.argv[4]})
a["kernel"] = sys.argv[3]
if "static_prefill_us" in a and "prefill_alone_us" in a:
    a["scheduling_overhead"] = a["prefill_alone_us"] / a["static_prefill_us"] - 1.0
if "torch_tflops" in t and "prefill_tflops" in a:
    a["prefill_vs_cublas"] = a["prefill_tflops"] / t["torch_tflops"]
print(json.dumps(a))' "$line" "$torch" "$name" "$static" >>"$REPORT"
  done
done
python3 - "$REPORT" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(f"{'kernel':<40} {'err p/d':>17} {'TFLOP/s':>8} {'vs cuBLAS':>9} {'sched ovh':>9} {'dec slow':>8} {'pre slow':>8} {'preempt us':>10}")
for r in rows:
    if "error" in r:
        print(f"{r['kernel']:<40} {r['error']}")
        continue
    print(f"{r['kernel']:<40} {r['rel_err_prefill']:8.1e}/{r['rel_err_decode']:8.1e} {r['prefill_tflops']:8.2f} "
          f"{r.get('prefill_vs_cublas', float('nan')):9.3f} {r.get('scheduling_overhead', float('nan')):9.3f} {r['decode_slowdown']:8.3f} "
          f"{r['prefill_slowdown']:8.3f} {r['preemption_delay_us']:10.2f}")
PY
exit "$status"
