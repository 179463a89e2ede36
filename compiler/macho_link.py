"""Link arm64 macOS dylibs on Linux with LLVM's Mach-O linker, `ld64.lld` (Debian `lld`).

TVM writes a Metal (or arm64 macOS CPU) library as arm64 Mach-O objects: `lib0.o`, the host
code, and `devc.o`, which embeds the serialized device module (the Metal shaders and their
launch parameters). `export_library` would link them with the system compiler, which on a Mac
means the Xcode command line tools. Linking them here instead lets a Mac run the artifact with
only `pip install`.

What the link needs (checked with `llvm-objdump --macho` / `llvm-nm -m`, tests/test_metal_dylib.py):

* `-dylib -arch arm64 -platform_version macos 11.0 11.0`: macOS 11 is the first release on
  Apple silicon, so every arm64 Mac loads it.
* `-undefined dynamic_lookup`: the objects call into the TVM FFI runtime
  (`TVMFFIErrorSetRaisedFromCStrParts`); those bind at load time against the
  `libtvm_runtime.dylib` the Python process has already loaded, as a clang link with the same
  flag would leave them.
* libSystem: the lazy-binding stubs need `dyld_stub_binder`, and a macOS image links
  `/usr/lib/libSystem.B.dylib`. The macOS SDK's `libSystem.tbd` is not here, so we write a
  minimal text stub of our own (TAPI v4) naming the install path and the symbols LLVM's host
  code may call; the dylib then records the same `LC_LOAD_DYLIB` a clang link would.
* ld64.lld signs arm64 output ad hoc by default (`LC_CODE_SIGNATURE`), which Apple silicon
  requires before it maps any code.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

MACOS_MIN = "11.0"  # the first macOS on Apple silicon

# The libSystem symbols LLVM's arm64 host code may reference: the stub binder, and the
# memory builtins and libm calls it lowers intrinsics to.
_LIBSYSTEM_SYMBOLS = [
    "dyld_stub_binder",
    "_memcpy",
    "_memmove",
    "_memset",
    "_bzero",
    "___bzero",
    "___stack_chk_fail",
    "___stack_chk_guard",
    *(
        f"_{f}{s}"
        for f in ("exp", "exp2", "log", "log2", "pow", "sqrt", "tanh", "erf", "sin", "cos", "fmod")
        for s in ("", "f")
    ),
]
_LIBSYSTEM_TBD = f"""--- !tapi-tbd
tbd-version:     4
targets:         [ arm64-macos ]
install-name:    '/usr/lib/libSystem.B.dylib'
current-version: 1311
exports:
  - targets:         [ arm64-macos ]
    symbols:         [ {", ".join(_LIBSYSTEM_SYMBOLS)} ]
...
"""


class LinkError(RuntimeError):
    """ld64.lld failed; the message carries its stderr."""


def find_ld64() -> str | None:
    """Path of an `ld64.lld` (`$TALLOW_LD64`, else `ld64.lld`, else the newest `ld64.lld-N`
    on PATH: Debian installs the versioned name only), or None."""
    explicit = os.environ.get("TALLOW_LD64")
    if explicit:
        return shutil.which(explicit)
    found = shutil.which("ld64.lld")
    if found:
        return found
    versioned = []
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        for path in Path(folder or ".").glob("ld64.lld-*"):
            m = re.fullmatch(r"ld64\.lld-(\d+)", path.name)
            if m and os.access(path, os.X_OK):
                versioned.append((int(m[1]), str(path)))
    return max(versioned)[1] if versioned else None


def ld64_version(ld64: str) -> str:
    """`LLD 14.0.6` from `ld64.lld --version` (the manifest records which linker built it)."""
    out = subprocess.run([ld64, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"LLD [\d.]+", out)
    return m[0] if m else out.strip()[:60]


def link_dylib(ld64: str, output: str | Path, objects: list[str]) -> None:
    """Link arm64 Mach-O `objects` into the dylib `output`."""
    output = Path(output)
    with tempfile.TemporaryDirectory() as tmp:
        tbd = Path(tmp) / "libSystem.tbd"
        tbd.write_text(_LIBSYSTEM_TBD)
        cmd = [
            ld64,
            "-dylib",
            "-arch",
            "arm64",
            "-platform_version",
            "macos",
            MACOS_MIN,
            MACOS_MIN,
            "-undefined",
            "dynamic_lookup",
            "-install_name",
            f"@rpath/{output.name}",
            "-o",
            str(output),
            *objects,
            str(tbd),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise LinkError(f"{Path(ld64).name} failed: {proc.stderr.strip()[-2000:]}")


def export_fcompile(ld64: str):
    """A `fcompile` for TVM's `export_library` that links with `ld64` (objects as `.o`)."""

    def fcompile(output, objects, **_kwargs):
        link_dylib(ld64, output, list(objects))

    fcompile.object_format = "o"
    return fcompile
