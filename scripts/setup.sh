#!/usr/bin/env bash
# Installs what building and the real-toolchain tier need. Idempotent: every
# step is skipped when what it installs is already there.
#
#   LLVM 19                  Debian's llvm-19-dev (apt; sudo when not root): the transfer programs
#                            (xfer/, inkwell) link its shared library; .cargo/config.toml points
#                            LLVM_SYS_191_PREFIX at /usr/lib/llvm-19
#   .toolchain/venv          Python venv holding NVIDIA's nvcc/ptxas/cuobjdump/nvdisasm wheels (no GPU needed)
#                            and CUTLASS's headers (`nvidia-cutlass`, without its Python dependencies:
#                            tests/ptx_layout.rs holds the PTX emulation to CuTe's layouts)
#
# Prints the path of nvcc on its last line, for `export MOEFORGE_NVCC=...`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.toolchain/venv"
wheels=(nvidia-cuda-nvcc nvidia-cuda-crt nvidia-nvvm nvidia-cuda-runtime nvidia-cuda-cccl nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)

llvm_prefix="${LLVM_SYS_191_PREFIX:-/usr/lib/llvm-19}"
if [ ! -x "$llvm_prefix/bin/llvm-config" ]; then
  echo "setup: installing llvm-19-dev (apt)" >&2
  as_root=()
  [ "$(id -u)" -eq 0 ] || as_root=(sudo)
  "${as_root[@]}" apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq llvm-19-dev >&2
  [ -x "$llvm_prefix/bin/llvm-config" ] || { echo "setup: no llvm-config under $llvm_prefix after installing llvm-19-dev" >&2; exit 1; }
fi

find_nvcc() {
  local f
  for f in "$venv"/lib/python3*/site-packages/nvidia/cu*/bin/nvcc; do
    [ -x "$f" ] && { echo "$f"; return 0; }
  done
  return 1
}

# cuobjdump and nvdisasm (for the SASS facts in report.md) sit next to nvcc.
complete() {
  local n
  n=$(find_nvcc) || return 1
  [ -x "$(dirname "$n")/cuobjdump" ] && [ -x "$(dirname "$n")/nvdisasm" ]
}

if ! complete; then
  echo "setup: installing nvcc wheels into $venv" >&2
  [ -x "$venv/bin/pip" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "${wheels[@]}" >&2
  complete || { echo "setup: nvcc, cuobjdump or nvdisasm missing after install" >&2; exit 1; }
fi
# CuTe's headers (the wheel's C++ sources; its Python package is not used).
cutlass_version=4.2.0.0
if ! ls "$venv"/lib/python3*/site-packages/cutlass_library/source/include/cute/tensor.hpp >/dev/null 2>&1; then
  echo "setup: installing CUTLASS headers (nvidia-cutlass $cutlass_version) into $venv" >&2
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps "nvidia-cutlass==$cutlass_version" >&2
fi
nvcc=$(find_nvcc)
"$nvcc" --version >/dev/null || { echo "setup: $nvcc does not run" >&2; exit 1; }
echo "$nvcc"
