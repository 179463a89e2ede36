"""Which of an artifact's libraries this machine runs (`--device auto|cpu|cuda|metal`).

`auto` takes CUDA when a driver is present and a CUDA library holds SASS this GPU runs,
else Metal on a Mac, else the best CPU library whose required features the running CPU has.
An explicit device the artifact cannot serve fails naming what the artifact has.

Only the standard library is used here (no TVM): `tallow pull` asks this module which one
library to download before anything is loaded. The machine facts (CPU features, CUDA archs,
whether it is a Mac) are detected unless the caller passes them, which is how tests simulate
other machines.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from . import cpu_features as cpu_features_module
from .errors import ArtifactError
from .manifest import LibraryInfo, Manifest

DEVICE_CHOICES = ("auto", "cpu", "cuda", "metal")
_AUTO_ORDER = ("cuda", "metal", "cpu")


@dataclass(frozen=True)
class LibraryChoice:
    library: LibraryInfo
    device: str  # the device kind: "cpu", "cuda", "metal"
    index: int  # the device number (cuda:N, metal:N)
    why: str  # one line: why this library

    @property
    def path(self) -> str:
        """The library's path inside the artifact."""
        return self.library.file


@dataclass(frozen=True)
class Machine:
    """What the choice looks at; `Machine.detect()` for this one, or built by tests."""

    platform: str  # e.g. linux-x86_64
    cpu_features: frozenset[str]
    cuda_archs: tuple[str, ...]  # per CUDA device index, e.g. ("sm_90",); () without a driver
    is_mac: bool

    @classmethod
    def detect(
        cls,
        cpu_features: Iterable[str] | None = None,
        cuda_archs: Sequence[str] | None = None,
        is_mac: bool | None = None,
        platform: str | None = None,
    ) -> Machine:
        cf = cpu_features_module
        return cls(
            platform=platform or cf.host_platform(),
            cpu_features=frozenset(
                cpu_features if cpu_features is not None else cf.host_features()
            ),
            cuda_archs=tuple(cuda_archs if cuda_archs is not None else detect_cuda_archs()),
            is_mac=(cf.host_os() == "macos") if is_mac is None else is_mac,
        )


def choose_library(
    manifest: Manifest,
    device: str | None = "auto",
    *,
    cpu_features: Iterable[str] | None = None,
    cuda_archs: Sequence[str] | None = None,
    is_mac: bool | None = None,
    platform: str | None = None,
) -> LibraryChoice:
    """The library to load for `device` (`auto`, `cpu`, `cuda[:N]`, `metal[:N]`; None is
    `auto`), or an `ArtifactError` saying why none fits and what the artifact has."""
    kind, _, index_text = (device or "auto").partition(":")
    if kind not in DEVICE_CHOICES or (index_text and not index_text.isdigit()):
        raise ArtifactError(f"bad device {device!r}; expected auto, cpu, cuda[:N] or metal[:N]")
    index = int(index_text or 0)
    machine = Machine.detect(cpu_features, cuda_archs, is_mac, platform)
    if kind != "auto":
        choice, problem = _CHOOSERS[kind](manifest.libraries, machine, index)
        if choice is None:
            raise ArtifactError(f"cannot run on {kind}: {problem}; {_has(manifest)}")
        return choice
    problems = []
    for kind in _AUTO_ORDER:
        choice, problem = _CHOOSERS[kind](manifest.libraries, machine, index)
        if choice is not None:
            return choice
        problems.append(f"{kind}: {problem}")
    raise ArtifactError(f"no library of this artifact runs here ({'; '.join(problems)})")


def files_for(manifest: Manifest, library: LibraryInfo) -> list[str]:
    """Every file a machine running `library` needs, besides `manifest.yaml`: the library,
    the shards of its weight set, the tokenizer files and chat template (what a download
    fetches; the other libraries and weight sets stay behind)."""
    info = manifest.tokenizer
    names = {library.file, *(p.shard for p in manifest.params_for(library)), *info.files}
    if info.chat_template:
        names.add(info.chat_template)
    return sorted(names)


def _has(manifest: Manifest) -> str:
    listed = ", ".join(f"{lib.target} ({lib.file})" for lib in manifest.libraries)
    return f"the artifact has: {listed}"


def _of(libraries: list[LibraryInfo], kind: str) -> list[LibraryInfo]:
    return [lib for lib in libraries if lib.device == kind]


def _choose_cuda(libraries, machine: Machine, index: int):
    libs = _of(libraries, "cuda")
    if not libs:
        return None, "the artifact has no CUDA library"
    if not machine.cuda_archs:
        return None, "no CUDA driver or GPU found"
    if index >= len(machine.cuda_archs):
        return None, f"no CUDA device {index} (found {len(machine.cuda_archs)})"
    gpu = machine.cuda_archs[index]
    libs = [lib for lib in libs if lib.platform == machine.platform] or libs
    ranked = sorted(
        ((rank, lib) for lib in libs if (rank := _sass_rank(lib.cuda_archs, gpu)) is not None),
        key=lambda pair: pair[0],
    )
    if not ranked:
        held = ", ".join(sorted({a for lib in libs for a in lib.cuda_archs}))
        return None, f"GPU {index} is {gpu}; the artifact's CUDA SASS is for {held}"
    lib = ranked[0][1]
    return LibraryChoice(lib, "cuda", index, f"CUDA GPU {index} is {gpu}: {lib.file}"), None


def _sass_rank(archs: Sequence[str], gpu: str) -> int | None:
    """How well SASS for `archs` fits a `gpu` (0: an exact arch; n: n minor versions below),
    or None. SASS runs on GPUs of the same major version and an equal or higher minor one."""
    major, minor = divmod(_sm(gpu), 10)
    fits = [
        minor - m for a in archs if (mj := divmod(_sm(a), 10))[0] == major and (m := mj[1]) <= minor
    ]
    return min(fits) if fits else None


def _sm(arch: str) -> int:
    digits = "".join(ch for ch in arch.removeprefix("sm_") if ch.isdigit())
    return int(digits or 0)


def _choose_metal(libraries, machine: Machine, index: int):
    libs = _of(libraries, "metal")
    if not libs:
        return None, "the artifact has no Metal library"
    if not machine.is_mac:
        return None, "Metal needs a Mac"
    lib = libs[0]
    return LibraryChoice(lib, "metal", index, f"a Mac: {lib.file}"), None


def _choose_cpu(libraries, machine: Machine, index: int):
    libs = _of(libraries, "cpu")
    if not libs:
        return None, "the artifact has no CPU library"
    here = [lib for lib in libs if lib.platform == machine.platform]
    if not here:
        built = ", ".join(sorted({lib.platform for lib in libs}))
        return None, f"its CPU libraries are for {built}; this machine is {machine.platform}"
    fitting, refused = [], []
    for lib in here:
        missing = [f for f in lib.cpu_features if f not in machine.cpu_features]
        (refused if missing else fitting).append((lib, missing))
    if not fitting:
        reasons = "; ".join(
            f"{lib.file} needs CPU features this CPU lacks: {', '.join(missing)}"
            for lib, missing in refused
        )
        return None, reasons
    # The best library that fits: the one using the most features (the most specialised).
    lib = max(fitting, key=lambda pair: len(pair[0].cpu_features))[0]
    level = lib.cpu_level or "cpu"
    why = f"CPU ({level}; {len(fitting)} of {len(here)} CPU libraries fit): {lib.file}"
    return LibraryChoice(lib, "cpu", 0, why), None


_CHOOSERS = {"cuda": _choose_cuda, "metal": _choose_metal, "cpu": _choose_cpu}


def detect_cuda_archs() -> list[str]:
    """The SM architecture of each CUDA device (`sm_90`), asked of the driver library
    (`libcuda`); empty when there is no driver or no device. Loads nothing of TVM."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return []
    count = ctypes.c_int(0)
    try:
        if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return []
    except AttributeError:  # not a real driver (the compiler's build-time stub)
        return []
    archs = []
    for ordinal in range(count.value):
        dev, major, minor = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
        if cuda.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
            break
        # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75, _MINOR = 76
        cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)
        cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)
        archs.append(f"sm_{major.value}{minor.value}")
    return archs
