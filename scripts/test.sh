#!/usr/bin/env bash
# The whole test suite, as CI runs it. Installs what is missing (idempotent),
# then: rustfmt check, clippy -D warnings, every test (snapshots must match:
# INSTA_UPDATE=no), the real-toolchain tier (nvcc required) and the server's
# client tier (the openai package and curl required).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

step() { printf '\n== %s\n' "$*"; }

step "toolchain"
command -v cargo >/dev/null || { echo "cargo is required (https://rustup.rs)"; exit 1; }
for comp in rustfmt clippy; do
  if ! cargo "${comp/rustfmt/fmt}" --version >/dev/null 2>&1; then
    rustup component add "$comp"
  fi
done
if ! command -v g++ >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq g++
fi
nvcc=$(bash scripts/setup.sh)
export MOEFORGE_NVCC="$nvcc"
export MOEFORGE_REQUIRE_NVCC=1
echo "nvcc: $MOEFORGE_NVCC"
echo "llvm: $("${LLVM_SYS_191_PREFIX:-/usr/lib/llvm-19}/bin/llvm-config" --version) (the transfer programs, xfer/)"
# The server's client tier: the official openai package (in the same venv)
# and curl.
venv="$root/.toolchain/venv"
if ! "$venv/bin/python" -c "import openai" >/dev/null 2>&1; then
  "$venv/bin/pip" install --quiet --disable-pip-version-check openai
fi
if ! command -v curl >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq curl
fi
export MOEFORGE_PYTHON="$venv/bin/python"
export MOEFORGE_REQUIRE_CLIENTS=1
echo "clients: openai $("$MOEFORGE_PYTHON" -c 'import openai; print(openai.__version__)'), $(curl --version | head -1 | cut -d' ' -f1-2)"

step "rustfmt"
cargo fmt --all -- --check

step "clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "packaging (the compiler crates build from their own packages, templates included)"
# Its own target directory, without the crates of an earlier run: cargo
# treats packaged crates like registry crates (extracted once, never rebuilt
# while their version stays), so old ones would stand in for these.
pkg_target="$root/target/package-check"
rm -rf "$pkg_target/package" "$pkg_target"/debug/.fingerprint/moeforge-* "$pkg_target"/debug/deps/*moeforge* \
  "${CARGO_HOME:-$HOME/.cargo}"/registry/src/-*/moeforge-*
CARGO_TARGET_DIR="$pkg_target" cargo package --locked -p moeforge-dsl -p moeforge-xfer -p moeforge-plan -p moeforge-codegen --allow-dirty >/dev/null

step "tests (snapshots must match, nvcc tier required)"
INSTA_UPDATE=no cargo test --workspace --locked

echo
echo "scripts/test.sh: all checks passed"
