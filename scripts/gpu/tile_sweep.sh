#!/usr/bin/env bash
# Tile sweep of one model's MoE APK on a GPU: the same deployment compiled
# with several tile sets (prefill block_n, CTA cluster, pipeline stages), each
# APK built around scripts/gpu/apk_check.cu and run on ExpertPlex §7.3's
# shapes (8192 prefill tokens, 128 decode tokens). Prints one JSON line per
# variant (numerics must pass) and a table of prefill TFLOP/s.
#
#   scripts/gpu/tile_sweep.sh --prepare EXAMPLE   # here: gpu-bundles/sweep/<variant>/
#   scripts/gpu/tile_sweep.sh                     # on the GPU machine
set -uo pipefail
cd "$(dirname "$0")/../.."
# variant: gate_up block_n, down block_n, cluster, stages (block_k 64 for bf16
# experts; 128, one scale block, for fp8, whose down tile must lie in one
# 128-row scale block).
BF16_VARIANTS=("n128-c2-s4 128 128 2 4" "n256-c2-s3 256 256 2 3" "n128-c1-s4 128 128 1 4" "n128-c2-s6 128 128 2 6"
  "n256-c1-s3 256 256 1 3" "n64-c2-s8 64 64 2 8")
FP8_VARIANTS=("n128-c2-s5 128 128 2 5" "n128-c1-s5 128 128 1 5" "n256x128-c1-s3 256 128 1 3" "n256x128-c2-s3 256 128 2 3")
if [[ "${1:-}" == "--prepare" ]]; then
  ex="${2:?usage: tile_sweep.sh --prepare EXAMPLE}"
  rm -rf gpu-bundles/sweep && mkdir -p gpu-bundles/sweep
  set_name="$(sed -n 's/^ *tiles = \(hopper-[a-z0-9]*\).*/\1/p' "examples/$ex.moe" | head -1)"
  case "$set_name" in
    hopper-bf16) variants=("${BF16_VARIANTS[@]}"); k=64 ;;
    hopper-fp8) variants=("${FP8_VARIANTS[@]}"); k=128 ;;
    *) echo "examples/$ex.moe uses tiles \`$set_name\`; the sweep knows hopper-bf16 and hopper-fp8" >&2; exit 1 ;;
  esac
  for v in "${variants[@]}"; do
    read -r name ngu nd c s <<<"$v"
    spec="gpu-bundles/sweep/$name.moe"
    sed -e "s|\"../models/|\"$PWD/models/|g" -e "s|tiles = $set_name|tiles = sweep|" "examples/$ex.moe" >"$spec"
    cat >>"$spec" <<MOE
tiles sweep {
  prefill {
    gate_up { block_m = 128  block_n = $ngu  block_k = $k  cluster = [$c, 1]  stages = $s }
    down    { block_m = 128  block_n = $nd  block_k = $k  cluster = [$c, 1]  stages = $s }
  }
  decode {
    gate_up { block_m = 64  block_n = $ngu  block_k = $k  cluster = [$c, 1]  stages = $s }
    down    { block_m = 64  block_n = $nd  block_k = $k  cluster = [$c, 1]  stages = $s }
  }
}
MOE
    ./target/release/moeforge compile "$spec" -o "gpu-bundles/sweep/$name" --nvcc off >/dev/null 2>&1 ||
      echo "variant $name does not compile: $(./target/release/moeforge compile "$spec" -o /tmp/x --nvcc off 2>&1 | head -3)"
  done
  ls gpu-bundles/sweep
  exit 0
fi
NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
BUILD="$(mktemp -d)"
trap 'rm -rf "$BUILD"' EXIT
for d in gpu-bundles/sweep/*/; do
  name="$(basename "$d")"
  timeout 300 "$NVCC" -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
    -DKERNEL_SOURCE="\"$(realpath "$d/kernels/apk.cu")\"" -o "$BUILD/$name" scripts/gpu/apk_check.cu &
done
wait
REPORT="${OUT:-.}/tile-sweep.jsonl"
: >"$REPORT"
for d in gpu-bundles/sweep/*/; do
  name="$(basename "$d")"
  read -r top_k experts x_star <<<"$(python3 -c 'import json,sys; p=json.load(open(sys.argv[1])); k=next(k for k in p["kernels"] if k["name"] == "apk")["params"]; print(p["model"]["top_k"], p["model"]["experts"], k["x_star"])' "$d/plan.json")"
  line="$(timeout 120 "$BUILD/$name" 8192 128 "$top_k" "$experts" 20 "$BUILD/$name.counts" /dev/null "$x_star" 2>&1 | tail -1)"
  python3 - "$name" "$line" >>"$REPORT" <<'PY'
import json, sys
try:
    r = json.loads(sys.argv[2])
except ValueError:
    r = {"error": sys.argv[2][-300:]}
r["variant"] = sys.argv[1]
print(json.dumps(r))
PY
done
python3 - "$REPORT" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    if "error" in r:
        print(f"{r['variant']:<14} {r['error']}")
        continue
    print(f"{r['variant']:<14} ok={r['numerics_ok']} err={r['worst_rel_err']:.1e} prefill {r['prefill_alone_us']:8.1f} us "
          f"{r['prefill_tflops']:6.1f} TFLOP/s  decode {r['decode_alone_us']:6.1f} us  dec x{r['decode_slowdown']:.2f} "
          f"pre x{r['prefill_slowdown']:.2f} clusters {r['clusters']} tile {r['mean_tile_us']} us")
PY
