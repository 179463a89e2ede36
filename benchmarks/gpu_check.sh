#!/usr/bin/env bash
# CUDA artifacts on a real GPU, through tallow's own runtime (TVMModelRunner and the engine):
# logits parity against the CPU build, decode and prefill speed next to the roofline bound.
#
#   benchmarks/gpu_check.sh prepare   # here (no GPU): build benchmarks/gpu_bundle
#   benchmarks/gpu_check.sh run       # on the GPU machine (Python 3.12, no TVM, no network)
#
# The bundle (under the device tool's 64 MiB carry limit) holds:
#   tvm/          the tvm Python package without libtvm_compiler.so (runtime-only mode:
#                 TVM_USE_RUNTIME_LIB=1 loads libtvm_runtime*.so only)
#   wheels/, deps/  cp312 wheels of the pinned apache-tvm-ffi and of the runtime's small
#                 dependencies the GPU image may lack (ml_dtypes, PyYAML, Jinja2), llguidance
#   small-cuda/, small-cpu/   one tiny random Qwen3 (hidden 256, q4k_m) compiled by
#                 `tallow compile` for sm_90 (f16) and for the CPU (f32): whole artifacts
#   q8b/          a Qwen3-8B-shaped uniform-q4k f16 artifact for sm_90 without its weights
#                 (compile_shape.py --artifact); `gpu_check_run.py fill` writes random ones
# The tallow sources travel with the working tree; `run` imports them from there.
# prepare: about 8 minutes on 2 shared cores (docs/gpu-artifacts.md#the-gpu-check), 36 MiB.
# Carry it with: run(carry=["benchmarks/gpu_bundle"], command="benchmarks/gpu_check.sh run")
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
bundle="$here/gpu_bundle"
py="${PYTHON:-$root/.venv/bin/python}"
# The pinned tvm-ffi, and the runtime's dependencies at the versions of the build machine
# (llguidance is copied from it: an abi3 build, and no manylinux wheel of it in our index).
DEPS="ml_dtypes PyYAML Jinja2 MarkupSafe"

prepare() {
  local t0=$SECONDS
  rm -rf "$bundle" && mkdir -p "$bundle/wheels"
  site="$("$py" -c 'import tvm, pathlib; print(pathlib.Path(tvm.__file__).parent.parent)')"
  # The Python package minus the compiler library, vendored sources and caches.
  tar -C "$site" --exclude='tvm/lib/libtvm_compiler.so' --exclude='tvm/3rdparty' \
      --exclude='tvm/src' --exclude='tvm/include' --exclude='__pycache__' -cf - tvm \
      | tar -C "$bundle" -xf -
  local pins
  pins="apache-tvm-ffi==0.1.14.post1 $("$py" -c 'import importlib.metadata as m, sys
print(" ".join(f"{p}=={m.version(p)}" for p in sys.argv[1:]))' $DEPS)"
  # shellcheck disable=SC2086
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux_2_17_x86_64 -d "$bundle/wheels" $pins
  mkdir -p "$bundle/deps"
  cp -r "$site/llguidance" "$bundle/deps/"
  local src; src="$(mktemp -d)"
  "$py" - "$src/qwen3_wide" <<'EOF'
import sys
sys.path.insert(0, "tests")
from pathlib import Path
from tiny_models import make_model
make_model(Path(sys.argv[1]), "qwen3_wide")
EOF
  "$py" -m tallow.cli.main compile --model "$src/qwen3_wide" --target cuda --sm 90 \
      --dtype f16 --quant q4k --output "$bundle" --name small-cuda
  "$py" -m tallow.cli.main compile --model "$src/qwen3_wide" --target cpu --cpu x86-64-v2 \
      --dtype f32 --quant q4k --output "$bundle" --name small-cpu
  rm -rf "$src"
  echo "small artifacts: $((SECONDS - t0)) s"
  local t1=$SECONDS
  "$py" "$here/compile_shape.py" --preset qwen3-8b --target cuda --sm 90 --dtype f16 \
      --quant q4k --artifact --out "$bundle/q8b"
  echo "Qwen3-8B-shaped q4k library: $((SECONDS - t1)) s; prepare: $((SECONDS - t0)) s"
  du -sh "$bundle"
}

run() {
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv
  deps="$(mktemp -d)"
  python3 -m pip install -q --no-deps --target "$deps" "$bundle"/wheels/*.whl
  mkdir -p "$deps/tallow"  # the working tree's runtime, as an installed tallow maps it
  ln -s "$root/runtime" "$deps/tallow/runtime"
  export PYTHONPATH="$bundle:$deps:$bundle/deps" TVM_USE_RUNTIME_LIB=1
  check="$here/gpu_check_run.py"
  echo "== parity: small q4k model, CUDA (f16, sm_90) vs CPU (f32), same weights"
  python3 "$check" parity "$bundle/small-cuda" "$bundle/small-cpu" || true
  echo "== Qwen3-8B shape, q4k, f16: random weights, then TVMModelRunner"
  python3 "$check" fill "$bundle/q8b"
  python3 "$check" speed "$bundle/q8b" --gpu H200
  echo "== the engine: 64 requests at once"
  python3 "$check" engine "$bundle/q8b"
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: $0 prepare|run" >&2; exit 2 ;;
esac
