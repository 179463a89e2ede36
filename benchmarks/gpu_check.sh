#!/usr/bin/env bash
# CUDA artifacts on a real GPU: logits parity against the CPU build, then decode speed.
#
#   benchmarks/gpu_check.sh prepare   # here (no GPU): build the bundle under benchmarks/gpu_bundle
#   benchmarks/gpu_check.sh run       # on the GPU machine (Python 3.12, no TVM, no network)
#
# The bundle (about 20 MiB, under the device tool's 64 MiB carry limit) holds:
#   tvm/         the tvm Python package without libtvm_compiler.so (runtime-only mode:
#                TVM_USE_RUNTIME_LIB=1 loads libtvm_runtime*.so only)
#   wheels/      the apache-tvm-ffi cp312 wheel of the pinned version
#   small-cuda/, small-cpu/   a small Qwen3-shaped config built for sm_90 and for llvm
#   q8b-cuda/    a Qwen3-8B-shaped f16 config for sm_90 (library only; weights are random)
# Carry it with: run(carry=["benchmarks/gpu_bundle"], command="benchmarks/gpu_check.sh run")
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
bundle="$here/gpu_bundle"
py="${PYTHON:-$root/.venv/bin/python}"
FFI_PIN="apache-tvm-ffi==0.1.14.post1"

prepare() {
  rm -rf "$bundle" && mkdir -p "$bundle/wheels"
  site="$("$py" -c 'import tvm, pathlib; print(pathlib.Path(tvm.__file__).parent.parent)')"
  # The Python package minus the compiler library, vendored sources and caches.
  tar -C "$site" --exclude='tvm/lib/libtvm_compiler.so' --exclude='tvm/3rdparty' \
      --exclude='tvm/src' --exclude='tvm/include' --exclude='__pycache__' -cf - tvm \
      | tar -C "$bundle" -xf -
  "$py" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
      --platform manylinux_2_28_x86_64 -d "$bundle/wheels" "$FFI_PIN"
  cp "$here/gpu_check_run.py" "$bundle/"
  "$py" "$here/compile_shape.py" --preset qwen3-small --target cuda --sm 90 --dtype f16 \
      --out "$bundle/small-cuda"
  "$py" "$here/compile_shape.py" --preset qwen3-small --target cpu --dtype f32 \
      --out "$bundle/small-cpu"
  "$py" "$here/compile_shape.py" --preset qwen3-8b --target cuda --sm 90 --dtype f16 \
      --out "$bundle/q8b-cuda"
  du -sh "$bundle"
}

run() {
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv
  deps="$(mktemp -d)"
  python3 -m pip install -q --no-deps --target "$deps" "$bundle"/wheels/apache_tvm_ffi-*.whl
  export PYTHONPATH="$bundle:$deps" TVM_USE_RUNTIME_LIB=1
  cd "$bundle"
  echo "== parity: CUDA (f16, sm_90) vs CPU (f32) on the same random weights"
  python3 gpu_check_run.py parity small-cuda small-cpu
  echo "== decode speed: Qwen3-8B shape, f16, random weights"
  python3 gpu_check_run.py speed q8b-cuda
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: $0 prepare|run" >&2; exit 2 ;;
esac
