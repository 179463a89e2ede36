"""Compile-time evidence of the GPU schedules, recorded per kernel in the manifest.

A tiny Qwen3 whose rows hold whole K-quant blocks (`qwen3_wide`, hidden 256), `--quant q4k`
(llama.cpp's q4k_m mix: q4k and q6k matrices) at f16, compiled once for `--sm 80 --sm 90`
(scheduled for sm_80, SASS and ptxas figures for both; slow: 50-80 s on 2 busy cores), and
for Metal. Checked: which rule scheduled every quantized matmul (none
on `Fallback`; decode on matrix-vector rules), wmma in the generated CUDA of every prefill
matmul, the static-row batch decode at 64 rows (`batch_decode_b64`: every quantized matmul on
`QuantDecodeGEMV`, none spilling), the CUDA-graph capture of the decode functions,
and `ptxas -v` resources, read back independently from the SASS with
`cuobjdump --dump-resource-usage` where it is installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tallow.runtime.manifest import Manifest

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
DECODE_RULES = {"QuantDecodeGEMV", "LowBatchGEMV", "GEMV"}


def _cuobjdump() -> str | None:
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for base in list(spec.submodule_search_locations if spec else []):
        for cand in Path(base).glob("cu*/bin/cuobjdump"):
            return str(cand)
    return shutil.which("cuobjdump")


def _sass_resources(library: Path, tmp_path: Path, tool: str) -> dict[tuple[str, str], dict]:
    """{(kernel, arch): {REG, STACK, SHARED, LOCAL}} read from the fatbin in `library`."""
    data = library.read_bytes()
    start = data.find(bytes.fromhex("50ed55ba"))  # fatbin magic
    size = int.from_bytes(data[start + 8 : start + 16], "little") + 16
    fatbin = tmp_path / "kernels.fatbin"
    fatbin.write_bytes(data[start : start + size])
    out = subprocess.run(
        [tool, "--dump-resource-usage", str(fatbin)], capture_output=True, text=True, check=True
    ).stdout
    found, name, arch = {}, None, None
    for line in out.splitlines():
        a = re.search(r"arch = (sm_\d+)", line)
        if a:
            arch = a.group(1)
            continue
        m = re.search(r"Function (\w+):", line)
        if m:
            name = m.group(1)
            continue
        if name and "REG:" in line:
            found[name, arch] = {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}
            name = None
    return found


@pytest.mark.slow
@needs_nvcc
def test_quantized_schedule_evidence(tiny_model_dir, tmp_path):
    from tallow.compiler.pipeline import CompileOptions, compile_model

    opts = CompileOptions(
        model=str(tiny_model_dir("qwen3_wide")),
        target="cuda",
        sms=[80, 90],
        dtype="f16",
        quant="q4k",
        output=tmp_path,
        # One of the seven bucket functions a CUDA build exports, the register-heaviest (each
        # set of decode kernels costs compile time: about 60 s on 2 busy cores).
        decode_buckets=(64,),
    )
    opts.quiet = True
    folder = compile_model(opts)
    (lib,) = Manifest.read(folder).libraries
    details = lib.details
    schedules = details["schedules"]
    quant = schedules["quant_matmuls"]
    kernels = schedules["kernels"]

    # Every quantized matmul is listed, with its rule; none fell back to one thread per output.
    names = {n for n in kernels if "quant_matmul" in n}
    assert names and set(quant) == names
    assert all(q["rule"] != "Fallback" for q in quant.values()), quant
    decode = {n: q["rule"] for n, q in quant.items() if q["role"] == "decode"}
    prefill = {n: q["rule"] for n, q in quant.items() if q["role"] == "prefill"}
    assert decode and set(decode.values()) <= DECODE_RULES, decode
    assert "QuantDecodeGEMV" in decode.values()  # the static-row `decode` kernels

    # The static-row batch decodes: every quantized matmul on the weights-once rule.
    static = schedules["static_decode"]
    assert set(static) == {"batch_decode_b64"}
    assert details["static_decode_functions"] == {"64": "batch_decode_b64"}
    for fn, rules in static.items():
        assert rules and set(rules.values()) == {"QuantDecodeGEMV"}, (fn, rules)
        assert all(quant[k]["role"] == "decode" for k in rules)
    evidence = details["static_decode_evidence"]
    assert {fn: e["quant_matmul_rules"] for fn, e in evidence.items()} == {
        fn: ["QuantDecodeGEMV"] for fn in static
    }
    assert all(not e["spilled"] for e in evidence.values()), evidence
    assert prefill and set(prefill.values()) == {"QuantPrefillMatmul"}, prefill

    # Prefill matmuls run on tensor cores: wmma calls in each one's generated CUDA kernel.
    tc_kernels = set(details["tensor_core_kernels"])
    assert {f"{n}_kernel" for n in prefill} <= tc_kernels
    assert not {f"{n}_kernel" for n in decode} & tc_kernels  # matrix-vector: no tensor cores

    # CUDA graphs: batch_decode's regions between attention calls are captured.
    graph = details["cuda_graph"]
    assert set(graph["captured_functions"]) == {"decode", "batch_decode", *static}, graph
    assert graph["captured_regions"]["batch_decode"] >= 1 and graph["max_batch_size"] == 64
    # static shapes: each bucket function is captured like `decode`, no symbolic bound needed
    regions = graph["captured_regions"]
    assert all(regions[fn] == regions["decode"] for fn in static), regions

    # ptxas resources for every kernel of the library, for each arch.
    resources = details["kernel_resources"]
    assert len(resources) == details["kernels_in_source"]
    archs = ["sm_80", "sm_90"]
    assert all("registers" in per_arch.get(a, {}) for per_arch in resources.values() for a in archs)
    # Zero spills in every kernel on every arch: ours, dlight's and TVM's own attention
    # kernels (those through the min-blocks repair, compiler/launch_bounds.py).
    spilled = {
        (k, a): (r.get("spill_stores"), r.get("spill_loads"))
        for k, per_arch in resources.items()
        for a, r in per_arch.items()
        if r.get("spill_stores") or r.get("spill_loads")
    }
    assert not spilled and not details["spills"], spilled
    repaired = details["spill_repair"]
    assert {f"{n}_kernel" for n in prefill}.isdisjoint(repaired)  # the schedule fits by itself
    assert any("attention" in k or "paged_kv" in k for k in repaired), repaired
    for kernel, fix in repaired.items():  # spilled before; ptxas kept the stated budget
        assert any(fix["spill_stores_before"].values()), fix
        regs = max(r["registers"] for r in resources[kernel].values())
        assert regs * fix["threads"] * fix["min_blocks_per_sm"] <= 65536, (kernel, fix)
    tool = _cuobjdump()
    if tool:  # the same figures read from the SASS itself
        sass = _sass_resources(folder / lib.file, tmp_path, tool)
        assert set(sass) == {(k, a) for k in resources for a in archs}
        for (kernel, arch), seen in sass.items():
            r = resources[kernel][arch]
            assert seen["REG"] == r["registers"], (kernel, arch)
            assert seen["STACK"] == r.get("stack_bytes", 0), (kernel, arch)


@pytest.mark.slow
def test_quantized_schedule_evidence_metal(tiny_model_dir, tmp_path):
    """The same rules for Metal: decode on the matrix-vector rules, no quantized matmul on
    `Fallback`, and every prefill matmul on simdgroup matrices with half operands and float
    accumulators (`schedules/gpu/simdgroup_f32.py`), read back from the generated Metal
    source. The numerics cannot be run here (no Metal; PoCL has no simdgroup matrices)."""
    from tallow.compiler.pipeline import CompileOptions, compile_model

    opts = CompileOptions(
        model=str(tiny_model_dir("qwen3_wide")),
        target="metal",
        dtype="f16",
        quant="q4k",
        output=tmp_path,
    )
    opts.quiet = True
    (lib,) = Manifest.read(compile_model(opts)).libraries
    schedules = lib.details["schedules"]
    quant = schedules["quant_matmuls"]
    assert quant and all(q["rule"] != "Fallback" for q in quant.values()), quant
    prefill = {n for n, q in quant.items() if q["role"] == "prefill"}
    decode = {n: q["rule"] for n, q in quant.items() if q["role"] == "decode"}
    assert set(decode.values()) <= DECODE_RULES, decode
    assert prefill and {quant[n]["rule"] for n in prefill} == {"QuantPrefillMatmul"}
    assert prefill <= set(schedules["tensor_core"]["tensorized_kernels"])
    without = {k["kernel"] for k in schedules["tensor_core"]["matmul_kernels_without_tensor_cores"]}
    assert not prefill & without
    simd = lib.details["simdgroup_matrices"]
    for name in prefill:
        assert simd[f"{name}_kernel"] == {"accumulators": ["float"], "operands": ["half"]}, name
    assert not {f"{n}_kernel" for n in decode} & set(simd)  # matrix-vector: no simdgroup mma


@needs_nvcc
def test_spill_repair_states_min_blocks(tmp_path):
    """`compiler/launch_bounds.py` on real ptxas output: the bound is written only on the
    kernels named (declaration and definition alike), ptxas accepts it and keeps the
    registers within 65536 / (threads x blocks), and a kernel that spilled in neither run
    is not touched. ~3 s."""
    from tallow.compiler import launch_bounds
    from tallow.compiler.cuda_build import nvcc_fatbin, ptxas_resources

    body = "{ int i = threadIdx.x; y[i] = x[i] * x[i] + 1.0f; }"
    source = "".join(
        f'extern "C" __global__ void __launch_bounds__(128) {n}(float* x, float* y);\n'
        f'extern "C" __global__ void __launch_bounds__(128) {n}(float* x, float* y) {body}\n'
        for n in ("a_kernel", "b_kernel")
    )
    fake = {"a_kernel": {"sm_80": {"registers": 72}, "sm_90": {"registers": 64}}}
    assert launch_bounds.min_blocks(source, fake, ["a_kernel"]) == {"a_kernel": (128, 7)}
    rewritten = launch_bounds.with_min_blocks(source, {"a_kernel": 7})
    assert rewritten.count("__launch_bounds__(128, 7) a_kernel(") == 2
    assert rewritten.count("__launch_bounds__(128) b_kernel(") == 2
    record: dict = {}
    assert nvcc_fatbin(rewritten, [80], record)
    resources = ptxas_resources(record["ptxas"])
    assert set(resources) == {"a_kernel", "b_kernel"}
    assert resources["a_kernel"]["sm_80"]["registers"] * 128 * 7 <= 65536
    assert "spill_repair" not in record  # nothing spilled: one nvcc run, source as given
    assert record["cuda_source"] == rewritten
