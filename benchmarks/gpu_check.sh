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
#   gemv/         gpu_gemv.py's q4k decode-matmul kernels (sm_90), schedule against schedule
#   nccl/         tallow's NCCL module, built here (pip install 'tallow[cuda]'), run on one rank
# The tallow sources travel with the working tree; `run` imports them from there.
# prepare: about 4 minutes on 2 quiet cores (docs/gpu-artifacts.md#the-gpu-check), 42 MiB.
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
  cp -r "$site/llguidance" "$site"/llguidance-*.dist-info "$bundle/deps/"
  cp -r "$site/gguf" "$bundle/deps/"  # pure Python: gpu_gemv.py's q4k oracle
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
  echo "Qwen3-8B-shaped q4k library: $((SECONDS - t1)) s"
  "$py" "$here/gpu_gemv.py" build "$bundle/gemv"
  # tallow's NCCL module (pip install 'tallow[cuda]'), built here: the GPU image has NCCL's
  # library but not TVM's headers. Skipped, with a line, where the wheels are not installed.
  mkdir -p "$bundle/nccl"
  "$py" -c 'import shutil, sys; from tallow.runtime import nccl_module
shutil.copy(nccl_module.build(), sys.argv[1])' "$bundle/nccl/" || echo "no NCCL module"
  echo "prepare: $((SECONDS - t0)) s"
  du -sh "$bundle"
}

run() {
  # Logs go to $OUT (the device tool brings that folder back), else next to the bundle.
  local out="${OUT:-$bundle/out}"
  mkdir -p "$out"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
  local name gpu
  name="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)"
  case "$name" in  # the roofline's name for it (runtime/roofline.py)
    *H200*) gpu=H200 ;; *H100*) gpu=H100 ;; *A100*) gpu=A100 ;; *) gpu="${GPU:-H200}" ;;
  esac
  echo "== copy ceiling (the image's PyTorch): device-to-device, bytes read + written"
  timeout 90 python3 "$here/gpu_copy_ceiling.py" 2>&1 | tee "$out/copy.log" || true
  # libtvm_runtime_cuda.so links libcudart.so.13, the NCCL module libnccl.so.2: the image
  # has both (CUDA toolkit, PyTorch's wheels), at paths the build machine cannot know.
  local dirs="" lib found
  for lib in libcudart.so.13 libnccl.so.2; do
    found="$(find /usr/local /opt /usr/lib -name "$lib" 2>/dev/null | head -1 || true)"
    [ -n "$found" ] && dirs="$dirs:$(dirname "$found")"
  done
  export LD_LIBRARY_PATH="${dirs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  deps="$(mktemp -d)"
  python3 -m pip install -q --no-deps --target "$deps" "$bundle"/wheels/*.whl
  mkdir -p "$deps/tallow"  # the working tree's runtime, as an installed tallow maps it
  ln -s "$root/runtime" "$deps/tallow/runtime"
  export PYTHONPATH="$bundle:$deps:$bundle/deps" TVM_USE_RUNTIME_LIB=1 PYTHONUNBUFFERED=1
  check="$here/gpu_check_run.py"
  step() {  # name, time limit (s), command...: one step's failure does not stop the next
    local label="$1" limit="$2"
    shift 2
    echo "== $label" | tee -a "$out/check.log"
    timeout "$limit" "$@" > >(tee -a "$out/check.log") 2>&1 || echo "== $label: exit $?"
  }
  step parity 120 python3 "$check" parity "$bundle/small-cuda" "$bundle/small-cpu"
  step gemv 150 python3 "$here/gpu_gemv.py" run "$bundle/gemv"
  # q8b, and any other 8B-shaped build beside it (q8b-before: a schedule to compare with)
  local art
  for art in "$bundle"/q8b*; do
    step "fill-${art##*/}" 120 python3 "$check" fill "$art"
    step "speed-${art##*/}" 200 python3 "$check" speed "$art" --gpu "$gpu"
  done
  step profile 150 python3 "$check" profile "$bundle/q8b" --out "$out"
  step engine 120 python3 "$check" engine "$bundle/q8b"
  step nccl 60 python3 "$check" nccl "$bundle/nccl/libtallow_disco_nccl.so"
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: $0 prepare|run" >&2; exit 2 ;;
esac
