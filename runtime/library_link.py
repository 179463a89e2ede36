"""Where a runner loads an artifact's library from: the file itself, or (a .tar of objects)
the library linked from it on this machine, once, into a cache."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ArtifactError
from .manifest import LibraryInfo


def library_path(folder: Path, library: LibraryInfo) -> Path:
    """The loadable library; a .tar of objects (Metal, cross-compiled CPU code) is linked
    once on this machine, then cached.

    The compiler cannot link a macOS or an arm64 library on an x86 Linux box without a cross
    linker (docs/metal.md), so the machine that runs it links it on first load with its
    system compiler, into ~/.cache/tallow/linked/<hash of the tar>/.
    """
    lib = folder / library.file
    if lib.suffix != ".tar":
        return lib
    import hashlib
    import shutil
    import subprocess
    import tarfile
    import tempfile

    from .cpu_features import host_os

    digest = hashlib.sha256(lib.read_bytes()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tallow" / "linked"
    mac = host_os() == "macos"
    out = cache / digest / ("model.dylib" if mac else "model.so")
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        with tarfile.open(lib) as tar:
            tar.extractall(tmp, filter="data")
        objects = sorted(str(p) for p in Path(tmp).iterdir() if p.suffix == ".o")
        cc = os.environ.get("CC") or shutil.which("clang") or shutil.which("cc") or "cc"
        # TVM runtime symbols resolve against the already loaded libtvm_runtime at load time.
        link = ["-dynamiclib", "-undefined", "dynamic_lookup"] if mac else ["-shared"]
        cmd = [cc, *link, "-o", f"{tmp}/{out.name}", *objects]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ArtifactError(f"linking {lib.name} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(f"{tmp}/{out.name}", out)
    return out
