"""One artifact, several libraries (issue 25, items 1-3): a tiny model compiled for the CPU
(x86-64-v3) and Metal, then given a CUDA sm_80+sm_90 library with `--add-target`, built once
per session. The weights exist once; adding a target leaves their bytes and hashes alone; the
CPU library loads and generates here; the GPU libraries are chosen for simulated machines;
the portable CPU library holds no AVX-512 instruction; a CPU below its level is refused."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from tallow.cli.main import main
from tallow.compiler.macho_link import find_ld64
from tallow.runtime import cpu_features
from tallow.runtime.errors import ArtifactError
from tallow.runtime.library_select import choose_library
from tallow.runtime.manifest import Manifest

pytestmark = pytest.mark.slow  # compiles the tiny model for three targets

CPU_LIB = "lib/cpu-x86-64-v3.so"
CUDA_LIB = "lib/cuda-sm_80-sm_90.so"
# linked here into a dylib by ld64.lld (Debian lld); without it, objects the Mac links
METAL_LIB = "lib/metal-arm64.dylib" if find_ld64() else "lib/metal-arm64.tar"
PROMPT_IDS = [11, 12, 13, 200, 201, 66, 8, 9, 10, 120]
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def three(tiny_model_dir, tmp_path_factory):
    """(artifact, weight hashes and manifest checksums before --add-target)."""
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc for the CUDA library")
    model = str(tiny_model_dir("qwen3"))
    out = tmp_path_factory.mktemp("three")
    argv = ["compile", "--model", model, "--output", str(out), "--quiet", "--target", "cpu"]
    assert main([*argv, "--cpu", "x86-64-v3", "--target", "metal"]) == 0
    (art,) = out.iterdir()
    before = Manifest.read(art)
    shards = sorted({p.shard for p in before.params})
    hashes = {s: _sha256(art / s) for s in shards}
    checksums = {s: before.checksums[s] for s in [*shards, "tokenizer.json", CPU_LIB]}
    add = ["compile", "--add-target", str(art), "--target", "cuda", "-sm", "80", "-sm", "90"]
    assert main([*add, "--quiet"]) == 0
    return art, hashes, checksums


def test_weights_exist_once_for_three_libraries(three):
    art, hashes, _ = three
    m = Manifest.read(art)
    assert [lib.file for lib in m.libraries] == [CPU_LIB, METAL_LIB, CUDA_LIB]
    assert [lib.device for lib in m.libraries] == ["cpu", "metal", "cuda"]
    assert all(lib.weights == "main" for lib in m.libraries) and m.weight_sets == {}
    files = sorted(p.name for p in art.glob("*.safetensors"))
    assert files == sorted(hashes)  # one copy of the weights, nothing beside it
    assert sorted(p.name for p in (art / "lib").iterdir()) == sorted(
        Path(f).name for f in (CPU_LIB, METAL_LIB, CUDA_LIB)
    )
    assert not list(art.glob(".*partial"))  # the add-target work folder is gone
    cuda = m.library(CUDA_LIB)
    assert cuda.cuda_archs == ["sm_80", "sm_90"] and cuda.details["nvcc"]
    from tallow.compiler.cuda_build import fatbin_entries

    assert sorted(fatbin_entries(art / CUDA_LIB)) == [("sass", 80), ("sass", 90)]
    # Every file, the libraries included, is in the checksums, and `verify` passes.
    for lib in m.libraries:
        assert m.checksums[lib.file]["sha256"] == _sha256(art / lib.file)
    assert main(["verify", str(art)]) == 0


def test_add_target_leaves_the_weights_alone(three):
    art, hashes, checksums = three
    m = Manifest.read(art)
    assert {s: _sha256(art / s) for s in hashes} == hashes
    for name, entry in checksums.items():
        assert m.checksums[name] == entry, name


def test_cpu_library_loads_and_matches_the_native_build(three, tiny_artifact):
    """The x86-64-v3 library (chosen by `auto` on this GPU-less Linux box) computes what the
    native build of the same model computes."""
    from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner

    art, _, _ = three
    portable = TVMModelRunner(art, kv=KVCacheConfig(1, 256, 16))
    assert portable.library.file == CPU_LIB and portable.device_kind.name == "cpu"
    native = TVMModelRunner(tiny_artifact("qwen3", "f32"), kv=KVCacheConfig(1, 256, 16))
    assert native.library.cpu_level == "native"
    for runner in (portable, native):
        runner.add_sequence(0)
    a = np.asarray(portable.forward([(0, PROMPT_IDS)])[0])
    b = np.asarray(native.forward([(0, PROMPT_IDS)])[0])
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()


def test_generate_runs_the_cpu_library(three, capsys):
    art, _, _ = three
    code = main(["generate", str(art), "--prompt", "hello", "--max-tokens", "6", "--ignore-eos"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "generated 6 tokens" in captured.err


def test_devices_choose_among_the_libraries(three):
    art, _, _ = three
    m = Manifest.read(art)

    def pick(device="auto", gpus=(), mac=False):
        platform = "macos-arm64" if mac else "linux-x86_64"
        features = cpu_features.host_features()
        return choose_library(
            m, device, cpu_features=features, cuda_archs=list(gpus), is_mac=mac, platform=platform
        )

    assert pick(gpus=["sm_90"]).path == CUDA_LIB
    assert pick(gpus=["sm_86"]).path == CUDA_LIB  # sm_80 SASS runs on sm_86
    assert pick(gpus=["sm_120"]).path == CPU_LIB  # no SASS for it: the CPU
    assert pick(mac=True).path == METAL_LIB
    assert pick().path == CPU_LIB
    with pytest.raises(ArtifactError) as err:
        pick("metal")
    has = f"cpu x86-64-v3 ({CPU_LIB}), metal (Apple silicon) ({METAL_LIB}), "
    has += f"cuda sm_80 sm_90 ({CUDA_LIB})"
    assert str(err.value) == f"cannot run on metal: Metal needs a Mac; the artifact has: {has}"


def test_a_machine_needs_only_its_own_library(three, tmp_path):
    """What a download fetches (`files_for`), and an artifact holding only that loads."""
    from tallow.runtime.artifact import check_artifact_files
    from tallow.runtime.library_select import files_for

    art, hashes, _ = three
    m = Manifest.read(art)
    common = sorted([*hashes, "chat_template.jinja", "tokenizer.json", "tokenizer_config.json"])
    for lib in m.libraries:
        assert files_for(m, lib) == sorted([lib.file, *common])
    copy = Path(shutil.copytree(art, tmp_path / "cpu-only"))
    for gone in (CUDA_LIB, METAL_LIB):
        (copy / gone).unlink()
    check_artifact_files(copy, m, m.library(CPU_LIB))  # the others' checksums are not asked
    with pytest.raises(ArtifactError, match=f"compiled library {CUDA_LIB} is missing"):
        check_artifact_files(copy, m, m.library(CUDA_LIB))


def test_a_cpu_below_the_level_is_refused_with_one_line(three, capsys, monkeypatch):
    art, _, _ = three
    avx_less = cpu_features.host_features() - {"avx", "avx2", "fma"}
    monkeypatch.setattr(cpu_features, "host_features", lambda: avx_less)
    code = main(["generate", str(art), "--device", "cpu", "--prompt", "hello"])
    err = capsys.readouterr().err
    assert code == 2
    assert err == (
        f"error: cannot run on cpu: {CPU_LIB} needs CPU features this CPU lacks: avx, avx2, fma; "
        f"the artifact has: cpu x86-64-v3 ({CPU_LIB}), metal (Apple silicon) ({METAL_LIB}), "
        f"cuda sm_80 sm_90 ({CUDA_LIB})\n"
    )


def _disassembly(path: Path) -> str:
    tool = shutil.which("llvm-objdump") or shutil.which("objdump")
    if tool is None:
        pytest.skip("needs objdump or llvm-objdump")
    out = subprocess.run([tool, "-d", "--no-show-raw-insn", str(path)], capture_output=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.decode()


def test_x86_64_v3_library_has_no_avx512(three, tiny_artifact):
    art, _, _ = three
    text = _disassembly(art / CPU_LIB)
    assert "vfmadd" in text and "ymm" in text  # AVX2/FMA code, disassembled
    # AVX-512 is EVEX-encoded: 512-bit zmm registers, opmask k-registers and their moves.
    assert "zmm" not in text and "{%k" not in text
    assert not re.search(r"\skmov[bwdq]\s", text)
    if "avx512f" in cpu_features.host_features():  # the check can fail: native code has it
        native = Manifest.read(tiny_artifact("qwen3", "f32")).libraries[0].file
        assert "zmm" in _disassembly(tiny_artifact("qwen3", "f32") / native)


def test_add_target_refuses_without_changing_anything(three, tiny_model_dir, capsys):
    art, _, _ = three
    before = (art / "manifest.yaml").read_bytes()
    again = ["compile", "--add-target", str(art), "--target", "metal", "--quiet"]
    assert main(again) == 2
    assert f"already has {METAL_LIB}; pass --overwrite" in capsys.readouterr().err
    other = ["--model", str(tiny_model_dir("llama")), "--target", "cpu", "--cpu", "x86-64-v2"]
    assert main(["compile", "--add-target", str(art), *other, "--quiet"]) == 2
    assert "is not the model this artifact was compiled from" in capsys.readouterr().err
    assert (art / "manifest.yaml").read_bytes() == before
    assert not list(art.glob(".*partial")) and not (art / "lib/cpu-x86-64-v2.so").exists()


def test_format_1_artifacts_still_load(tiny_artifact, tmp_path):
    """A folder written before several libraries (`target`, `library: model.so`) loads as a
    one-library artifact."""
    from tallow.runtime.generate import generate_tokens
    from tallow.runtime.model_runner import TVMModelRunner
    from tallow.runtime.sampling_params import SamplingParams

    art = Path(shutil.copytree(tiny_artifact("qwen3", "f32"), tmp_path / "old"))
    raw = yaml.safe_load((art / "manifest.yaml").read_text())
    (lib,) = raw.pop("libraries")
    (art / lib["file"]).rename(art / "model.so")
    shutil.rmtree(art / "lib")
    raw["checksums"].pop(lib["file"])
    raw.update(format_version=1, library="model.so")
    raw["target"] = {"kind": "cpu", "tvm_target": lib["tvm_target"], "details": lib["details"]}
    (art / "manifest.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    m = Manifest.read(art)
    assert [(x.file, x.device, x.cpu_level) for x in m.libraries] == [("model.so", "cpu", "native")]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = list(generate_tokens(TVMModelRunner(art), PROMPT_IDS, params))
    reference = TVMModelRunner(tiny_artifact("qwen3", "f32"))
    assert tokens == list(generate_tokens(reference, PROMPT_IDS, params))
