"""The Metal library linked at compile time into an arm64 macOS dylib by ld64.lld
(`compiler/macho_link.py`), checked with LLVM's Mach-O tools (no Mac here).

Oracles: `llvm-objdump --macho` / `llvm-nm -m` read the dylib; the symbols the dylib must
export are those TVM's own objects define (the same build exported as a .tar of objects);
every symbol left to load time must be defined by the TVM runtime libraries of this wheel
(the C API is the same on every platform) or come from libSystem.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from tallow.compiler.macho_link import find_ld64
from tallow.compiler.target import resolve_target

LLVM_TOOLS = ("llvm-objdump", "llvm-nm")
missing = [t for t in LLVM_TOOLS if shutil.which(t) is None]
if find_ld64() is None:
    missing.insert(0, "ld64.lld (Debian lld)")
needs_tools = pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}")


def _tool(*args) -> str:
    return subprocess.run(args, capture_output=True, text=True, check=True).stdout


def test_metal_library_is_a_dylib_when_ld64_is_here():
    spec = resolve_target("metal", "f16")
    if find_ld64() is None:
        pytest.skip("needs ld64.lld (Debian lld)")
    assert spec.library_name == "lib/metal-arm64.dylib"
    assert spec.details["linker"].startswith("LLD ")


def test_without_ld64_the_mac_links_at_load(monkeypatch):
    monkeypatch.setenv("TALLOW_LD64", "/nonexistent/ld64.lld")
    spec = resolve_target("metal", "f16")
    assert spec.library_name == "lib/metal-arm64.tar"
    assert spec.details["host_format"] == "tar of arm64 Mach-O objects, linked on the Mac at load"
    assert "ld64.lld (Debian lld) was not found" in spec.details["linker"]


def test_runtime_loads_a_dylib_as_it_is(tmp_path):
    from tallow.runtime.model_runner import _library_path

    class Lib:
        file = "lib/metal-arm64.dylib"

    assert _library_path(tmp_path, Lib()) == tmp_path / "lib/metal-arm64.dylib"


@pytest.fixture(scope="module")
def metal_build(tmp_path_factory):
    """A small f16 module (a matmul on simdgroup matrices, an RMSNorm) built for Metal twice:
    linked by ld64.lld, and as TVM's own .tar of objects."""
    from tvm.relax.frontend import nn

    from tallow.compiler.relax_pipeline import lower_module

    class Small(nn.Module):
        def __init__(self):
            self.proj = nn.Linear(128, 256, bias=False, dtype="float16")
            self.norm = nn.RMSNorm(256, -1, 1e-6, bias=False, dtype="float16")

        def forward(self, x):
            return self.norm(self.proj(x))

    mod, _ = Small().export_tvm({"forward": {"x": nn.spec.Tensor(["n", 128], "float16")}})
    out = tmp_path_factory.mktemp("metal")
    spec = resolve_target("metal", "f16")
    lowered = lower_module(mod, spec)
    dylib = out / "model.dylib"
    spec.backend.build(lowered, spec, dylib)
    spec.backend.build(lowered, spec, out / "model.tar")
    objects = out / "objects"
    with tarfile.open(out / "model.tar") as tar:
        tar.extractall(objects, filter="data")
    return dylib, sorted(objects.glob("*.o")), spec.report


@needs_tools
def test_dylib_headers(metal_build):
    dylib, _, report = metal_build
    headers = _tool("llvm-objdump", "--macho", "--private-headers", str(dylib))
    assert re.search(r"MH_MAGIC_64\s+ARM64\s+ALL\s+0x00\s+DYLIB", headers), headers[:400]
    commands = re.findall(r"cmd (LC_\w+)", headers)
    assert "LC_ID_DYLIB" in commands
    assert "LC_CODE_SIGNATURE" in commands  # ad-hoc signed: Apple silicon maps signed code only
    build = headers[headers.index("LC_BUILD_VERSION") :]
    assert re.search(r"platform macos\s+sdk 11\.0\s+minos 11\.0", build), build[:200]
    loads = re.findall(r"cmd LC_LOAD_DYLIB\n.*\n\s+name (\S+)", headers)
    assert loads == ["/usr/lib/libSystem.B.dylib"]  # as a clang link; nothing else
    assert report.shaders == 2 and report.tensor_core_in_source


@needs_tools
def test_dylib_exports_what_tvm_loads(metal_build):
    dylib, objects, _ = metal_build
    exports = set(
        re.findall(
            r"^0x[0-9A-F]+\s+(\S+)",
            _tool("llvm-objdump", "--macho", "--exports-trie", str(dylib)),
            re.M,
        )
    )
    # Every global the objects define (the kernels' host functions `__tvm_ffi_<name>`, the
    # packed device module `__tvm_ffi__library_bin`, the context slots TVM's loader fills).
    defined = set()
    for obj in objects:
        for line in _tool(
            "llvm-nm", "-m", "--defined-only", "--extern-only", str(obj)
        ).splitlines():
            defined.add(line.split()[-1])
    assert defined <= exports, defined - exports
    # The names tvm_ffi's loader looks up (tvm/ffi/extra/module.h; Mach-O adds a leading _).
    for name in (
        "___tvm_ffi__library_bin",
        "___tvm_ffi__library_ctx",
        "___tvm_ffi_rms_norm",
        "___TVMFFIFunctionCall",
        "___TVMFFIEnvModLookupFromImports",
    ):
        assert name in exports, name
    # the shaders travel inside the dylib
    blob = dylib.read_bytes()
    assert b"metal" in blob and b"kernel void" in blob and b"simdgroup_multiply_accumulate" in blob


@needs_tools
def test_undefined_symbols_come_from_tvm_runtime_or_libsystem(metal_build):
    import tvm

    dylib, _, _ = metal_build
    runtime = set()
    for lib in (Path(tvm.__file__).parent / "lib").glob("libtvm_runtime*.so"):
        runtime |= set(
            _tool("llvm-nm", "-D", "--defined-only", "--format=just-symbols", str(lib)).split()
        )
    import tvm_ffi

    for lib in Path(tvm_ffi.__file__).parent.glob("lib/libtvm_ffi*.so"):
        runtime |= set(
            _tool("llvm-nm", "-D", "--defined-only", "--format=just-symbols", str(lib)).split()
        )
    undefined = _tool("llvm-nm", "-m", "--undefined-only", str(dylib)).splitlines()
    assert undefined
    for line in undefined:
        symbol = line.split()[2]
        if "(from libSystem)" in line:
            continue
        assert "(dynamically looked up)" in line, line
        assert symbol.startswith("_") and symbol[1:] in runtime, line  # Mach-O's leading _
