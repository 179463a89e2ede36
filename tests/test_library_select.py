"""Which library a machine loads (`runtime/library_select.py`), driven with simulated machines,
and the CPU levels' features as LLVM reports them (issue 25, items 2 and 3). No compiles."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tallow.compiler.cpu_levels import LEVELS, required_features, resolve_level
from tallow.runtime.cpu_features import parse_cpuinfo
from tallow.runtime.errors import ArtifactError, TargetError
from tallow.runtime.library_select import choose_library
from tallow.runtime.manifest import LibraryInfo

# What a Zen 4 / Ice Lake class CPU reports, and one that stops at x86-64-v2 (Nehalem-class).
V2_FLAGS = ["fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "popcnt", "cx16", "lahf_lm"]
V3_FLAGS = [*V2_FLAGS, *["avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "xsave"]]
V4_FLAGS = [*V3_FLAGS, *["avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"]]
VNNI_FLAGS = [*V4_FLAGS, "avx512_vnni"]


def _lib(file, device, target, platform="linux-x86_64", **kw) -> LibraryInfo:
    return LibraryInfo(file, device, target, platform, tvm_target={}, **kw)


def _cpu_lib(level: str) -> LibraryInfo:
    lvl = LEVELS[level]
    return _lib(
        f"lib/cpu-{level}.so" if lvl.linked_here else f"lib/cpu-{level}.tar",
        "cpu",
        f"cpu {level}",
        lvl.platform,
        cpu_level=level,
        cpu_features=required_features(lvl.tvm_target, lvl.platform),
    )


@pytest.fixture(scope="module")
def artifact():
    """The issue's artifact: CUDA sm_80+sm_90, Metal, and CPU x86-64-v3 and v4-vnni."""
    libs = [
        _lib("lib/cuda-sm_80-sm_90.so", "cuda", "cuda sm_80 sm_90", cuda_archs=["sm_80", "sm_90"]),
        _lib("lib/metal-arm64.tar", "metal", "metal (Apple silicon)", "macos-arm64"),
        _cpu_lib("x86-64-v3"),
        _cpu_lib("x86-64-v4-vnni"),
        _cpu_lib("apple-m1"),
    ]
    return SimpleNamespace(libraries=libs)


def choose(artifact, device="auto", cpu=VNNI_FLAGS, gpus=(), mac=False, platform=None):
    platform = platform or ("macos-arm64" if mac else "linux-x86_64")
    return choose_library(
        artifact, device, cpu_features=cpu, cuda_archs=list(gpus), is_mac=mac, platform=platform
    )


# --- --device auto ----------------------------------------------------------------------
@pytest.mark.parametrize("gpu", ["sm_90", "sm_80", "sm_86", "sm_89"])
def test_auto_takes_cuda_when_the_sass_runs_on_the_gpu(artifact, gpu):
    choice = choose(artifact, gpus=[gpu])
    assert (choice.device, choice.path, choice.index) == ("cuda", "lib/cuda-sm_80-sm_90.so", 0)
    assert gpu in choice.why


@pytest.mark.parametrize("gpu", ["sm_75", "sm_100", "sm_120"])
def test_auto_passes_over_a_gpu_without_matching_sass(artifact, gpu):
    # SASS runs on its own major version only: sm_90 code does not run on sm_100 or sm_120.
    choice = choose(artifact, gpus=[gpu])
    assert choice.device == "cpu" and choice.path == "lib/cpu-x86-64-v4-vnni.so"
    with pytest.raises(ArtifactError) as err:
        choose(artifact, "cuda", gpus=[gpu])
    assert f"GPU 0 is {gpu}; the artifact's CUDA SASS is for sm_80, sm_90" in str(err.value)


def test_auto_takes_metal_on_a_mac_and_cpu_elsewhere(artifact):
    mac = choose(artifact, mac=True, cpu=["asimd", "asimdhp", "asimddp"])
    assert (mac.device, mac.path) == ("metal", "lib/metal-arm64.tar")
    linux = choose(artifact)
    assert linux.device == "cpu"


def test_cpu_takes_the_best_library_that_fits(artifact):
    assert choose(artifact, "cpu", cpu=VNNI_FLAGS).path == "lib/cpu-x86-64-v4-vnni.so"
    assert choose(artifact, "cpu", cpu=V4_FLAGS).path == "lib/cpu-x86-64-v3.so"  # no VNNI
    assert choose(artifact, "cpu", cpu=V3_FLAGS).path == "lib/cpu-x86-64-v3.so"
    mac_cpu = choose(artifact, "cpu", mac=True, cpu=["asimd", "asimdhp", "asimddp"])
    assert mac_cpu.path == "lib/cpu-apple-m1.tar"


def test_a_cpu_below_every_level_is_refused_naming_the_missing_features(artifact):
    with pytest.raises(ArtifactError) as err:
        choose(artifact, "cpu", cpu=V2_FLAGS)
    message = str(err.value)
    assert "\n" not in message  # one line
    assert "lib/cpu-x86-64-v3.so needs CPU features this CPU lacks: avx, avx2, fma" in message
    assert "lib/cpu-x86-64-v4-vnni.so needs CPU features this CPU lacks:" in message
    assert "avx512_vnni" in message


def test_an_explicit_device_the_artifact_lacks_names_what_it_has():
    cpu_only = SimpleNamespace(libraries=[_cpu_lib("x86-64-v3")])
    for device, reason in [
        ("cuda", "the artifact has no CUDA library"),
        ("metal:0", "the artifact has no Metal library"),
    ]:
        with pytest.raises(ArtifactError) as err:
            choose(cpu_only, device, gpus=["sm_90"], mac=True)
        assert str(err.value) == (
            f"cannot run on {device.split(':')[0]}: {reason}; "
            "the artifact has: cpu x86-64-v3 (lib/cpu-x86-64-v3.so)"
        )


def test_gpu_devices_need_their_machine(artifact):
    with pytest.raises(ArtifactError, match="cannot run on metal: Metal needs a Mac"):
        choose(artifact, "metal")
    with pytest.raises(ArtifactError, match="cannot run on cuda: no CUDA driver or GPU found"):
        choose(artifact, "cuda")
    with pytest.raises(ArtifactError, match=r"no CUDA device 1 \(found 1\)"):
        choose(artifact, "cuda:1", gpus=["sm_90"])
    assert choose(artifact, "cuda:1", gpus=["sm_80", "sm_90"]).index == 1
    with pytest.raises(ArtifactError, match="bad device 'gpu'"):
        choose(artifact, "gpu")


def test_cpu_libraries_of_another_machine_are_refused():
    arm_only = SimpleNamespace(libraries=[_cpu_lib("arm64")])
    with pytest.raises(ArtifactError) as err:
        choose(arm_only, "cpu")
    assert "CPU libraries are for linux-arm64; this machine is linux-x86_64" in str(err.value)
    assert choose(arm_only, "cpu", cpu=["asimd"], platform="linux-arm64").device == "cpu"


# --- CPU features and levels ------------------------------------------------------------
def test_cpuinfo_flags_are_read_on_x86_and_arm():
    x86 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\nbugs\t\t: spectre\n"
    arm = "processor\t: 0\nFeatures\t: fp asimd evtstrm asimddp i8mm\nCPU implementer\t: 0x41\n"
    assert parse_cpuinfo(x86) == {"fpu", "sse2", "avx2", "avx512f"}
    assert parse_cpuinfo(arm) == {"fp", "asimd", "evtstrm", "asimddp", "i8mm"}


def test_levels_require_what_llvm_generates_for_them():
    def needs(level):
        return set(required_features(LEVELS[level].tvm_target, LEVELS[level].platform))

    v2, v3, v4, vnni = (needs(n) for n in ("x86-64-v2", "x86-64-v3", "x86-64-v4", "x86-64-v4-vnni"))
    assert {"sse4_2", "popcnt"} <= v2 and "avx" not in v2
    assert v2 < v3 and {"avx", "avx2", "fma", "bmi2"} <= v3 and "avx512f" not in v3
    assert v3 < v4 and {"avx512f", "avx512bw", "avx512vl"} <= v4 and "avx512_vnni" not in v4
    assert vnni == v4 | {"avx512_vnni"}
    assert needs("x86-64-v4-amx") == vnni | {"avx512_bf16", "amx_tile", "amx_bf16"}
    assert {"asimd", "asimddp"} <= needs("apple-m1") and needs("arm64") == {"asimd"}


def test_named_levels_do_not_read_the_build_host():
    from tvm.target import Target

    from tallow.schedules.cpu import amx_prefill, int8_vnni
    from tallow.schedules.tir_common import register_bits

    v3 = Target(resolve_level("x86-64-v3").tvm_target)
    assert register_bits(v3) == 256  # TVM alone says 512 for this AVX2 level
    assert not int8_vnni.supported(v3)
    assert int8_vnni.supported(Target(resolve_level("x86-64-v4-vnni").tvm_target))
    assert amx_prefill.supported(Target(resolve_level("x86-64-v4-amx").tvm_target))
    assert not amx_prefill.supported(Target(resolve_level("x86-64-v4-vnni").tvm_target))
    assert resolve_level(None).name == "native"
    with pytest.raises(TargetError, match="--cpu 'x86-64-v5' is not a CPU level; choose from"):
        resolve_level("x86-64-v5")


# --- the compile options ----------------------------------------------------------------
def test_cli_takes_several_targets_and_levels():
    from tallow.cli.main import build_parser

    args = build_parser().parse_args(
        ["compile", "--model", "m", "--target", "cuda", "-sm", "80", "-sm", "90", "--target",
         "metal", "--target", "cpu", "--cpu", "x86-64-v3", "--cpu", "x86-64-v4-vnni"]
    )  # fmt: skip
    assert args.target == ["cuda", "metal", "cpu"] and args.sms == [80, 90]
    assert args.cpu == ["x86-64-v3", "x86-64-v4-vnni"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["compile", "--model", "m", "--cpu", "pentium"])


def test_targets_resolve_to_one_library_each():
    from tallow.compiler.libraries import artifact_suffix, resolve_targets
    from tallow.compiler.macho_link import find_ld64
    from tallow.compiler.pipeline import CompileOptions

    opts = CompileOptions(
        model="m", target=["cuda", "metal", "cpu"], sms=[90, 80], cpu=["x86-64-v3", "arm64"]
    )
    specs = resolve_targets(opts)
    assert [s.library_name for s in specs] == [
        "lib/cuda-sm_80-sm_90.so",
        # linked here by ld64.lld when it is installed, else on the Mac
        "lib/metal-arm64.dylib" if find_ld64() else "lib/metal-arm64.tar",
        "lib/cpu-x86-64-v3.so",
        "lib/cpu-arm64.tar",  # no arm64 linker here: linked on the machine that runs it
    ]
    assert artifact_suffix(specs) == "cuda-sm_80-sm_90-metal-cpu-x86-64-v3-cpu-arm64"
    for bad, message in [
        (dict(target=["cpu", "cpu"]), "--target cpu given twice"),
        (dict(target=["cuda"], cpu=["x86-64-v3"]), "--cpu applies to --target cpu only"),
        (dict(target=["cpu"], sms=[90]), "--sm applies to --target cuda only"),
        (dict(target=["cpu"], cpu=["x86-64-v3", "x86-64-v3"]), "build the same library"),
    ]:
        with pytest.raises(TargetError, match=message):
            resolve_targets(CompileOptions(model="m", **bad))
