"""tallow's NCCL module for Disco (runtime/native/disco_nccl.cc, runtime/nccl_module.py).

No GPU here: what can be checked is that it builds from PyPI's wheels, that every NCCL and
CUDA symbol it uses resolves against the libraries it names, that loading it registers every
function TVM 0.27's Disco looks up for ccl "nccl", and that `init_ccl("nccl")` on a machine
without a GPU is a Python exception, not an abort. Whether the collectives move the right bytes
only a multi-GPU machine shows (docs/tensor-parallel.md).

The build (about 9 s) happens once per session, into a temporary cache."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tallow.runtime import nccl_module


@pytest.fixture(scope="session")
def nccl_cache(tmp_path_factory):
    try:
        nccl_module.toolchain()
    except nccl_module.NcclModuleError as e:
        pytest.skip(f"a build prerequisite is missing: {e}")
    cache = tmp_path_factory.mktemp("nccl-cache")
    old = os.environ.get("TALLOW_CACHE_DIR")
    os.environ["TALLOW_CACHE_DIR"] = str(cache)
    try:
        yield cache, nccl_module.build()
    finally:
        if old is None:
            del os.environ["TALLOW_CACHE_DIR"]
        else:
            os.environ["TALLOW_CACHE_DIR"] = old


def _run(code: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TALLOW_CACHE_DIR": str(cache)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def _dynamic_symbols(path: str, defined: bool) -> set[str]:
    flag = "--defined-only" if defined else "--undefined-only"
    out = subprocess.run(["nm", "-D", flag, path], capture_output=True, text=True, check=True)
    return {line.split()[-1].split("@")[0] for line in out.stdout.splitlines() if line.strip()}


def _pip_nccl_code() -> int:
    """NCCL's version code (major * 10000 + minor * 100 + patch) of the pip package."""
    major, minor, patch = importlib.metadata.version("nvidia-nccl-cu13").split(".")[:3]
    return int(major) * 10000 + int(minor) * 100 + int(patch)


def test_every_nccl_and_cuda_symbol_resolves_against_the_pypi_libraries(nccl_cache):
    _, lib = nccl_cache
    needed = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True).stdout
    assert "[libnccl.so.2]" in needed and "[libcudart.so.13]" in needed
    # ldd resolves each through the RUNPATH the build recorded: no LD_LIBRARY_PATH needed
    resolved = dict(re.findall(r"^\s*(\S+) => (\S+)", subprocess.getoutput(f"ldd {lib}"), re.M))
    tools = nccl_module.toolchain()
    assert Path(resolved["libnccl.so.2"]).parent in tools.lib_dirs
    assert Path(resolved["libcudart.so.13"]).parent in tools.lib_dirs
    undefined = _dynamic_symbols(str(lib), defined=False)
    for soname, prefix in (("libnccl.so.2", "nccl"), ("libcudart.so.13", "cuda")):
        used = {s for s in undefined if s.startswith(prefix)}
        assert used, f"no {prefix}* symbol used"
        missing = used - _dynamic_symbols(resolved[soname], defined=True)
        assert not missing, f"{sorted(missing)} not defined in {resolved[soname]}"
    assert {"ncclAllReduce", "ncclCommInitRank", "ncclGetUniqueId"} <= undefined


def test_loading_registers_the_disco_functions_and_init_without_a_gpu_is_an_exception(
    nccl_cache,
):
    cache, _ = nccl_cache
    proc = _run(
        """
        from tallow.runtime import nccl_module
        from tallow.runtime.disco_runtime import disco
        d = disco(ccl="nccl")
        import tvm
        missing = [n for n in nccl_module.FUNCTIONS
                   if tvm.get_global_func(nccl_module.PREFIX + n, allow_missing=True) is None]
        print("missing", missing)
        print("version", tvm.get_global_func("tallow.nccl.version")())
        sess = d.ThreadedSession(2)
        try:
            sess.init_ccl("nccl", 0, 1)
        except Exception as e:
            print("refused", type(e).__name__, str(e).splitlines()[0])
        sess.shutdown()
        """,
        cache,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert lines["missing"] == "[]"
    # NCCL's version code (major * 10000 + minor * 100 + patch) is the pip package's version
    major, minor, patch = (
        int(v) for v in importlib.metadata.version("nvidia-nccl-cu13").split(".")
    )
    assert int(lines["version"]) == major * 10000 + minor * 100 + patch
    assert lines["refused"].startswith("RuntimeError NCCL tensor parallelism needs CUDA GPUs")


def test_loading_the_module_loads_tvms_cuda_device_api(nccl_cache):
    """Disco allocates each worker's tensors through TVM's CUDA device API, which runtime-only
    TVM keeps in `libtvm_runtime_cuda.so`; on an H100 the module loaded without it and the
    first allocation after `init_ccl` aborted the process. With a driver present (here the
    build-time stand-in for `libcuda.so.1`), loading the module loads the device API too."""
    from tallow.compiler.cuda_build import _build_stub

    cache, _ = nccl_cache
    proc = _run(
        f"""
        import ctypes, os
        os.environ["TVM_USE_RUNTIME_LIB"] = "1"  # as `tallow serve` runs: no CUDA loaded
        ctypes.CDLL({str(_build_stub())!r}, mode=ctypes.RTLD_GLOBAL)
        from tallow.runtime.disco_runtime import disco, preload
        preload()
        import tvm
        print("before", tvm.get_global_func("device_api.cuda", allow_missing=True) is not None)
        disco(ccl="nccl")
        print("after", tvm.get_global_func("device_api.cuda", allow_missing=True) is not None)
        """,
        cache,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["before", "False", "after", "True"]


def test_an_absent_module_is_refused_in_one_line_naming_the_command(tmp_path):
    proc = _run(
        """
        from tallow.runtime.disco_runtime import disco
        from tallow.runtime.nccl_module import NcclModuleError
        try:
            disco(ccl="nccl")
        except NcclModuleError as e:
            print(e)
        """,
        tmp_path,  # an empty cache: nothing is built there
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tallow build-nccl" in proc.stdout and proc.stdout.count("\n") == 1


def test_a_build_is_reused_and_a_failed_build_leaves_nothing(nccl_cache, monkeypatch, capsys):
    from tallow.cli.main import main

    _, lib = nccl_cache
    stamp = lib.stat().st_mtime_ns
    assert main(["build-nccl"]) == 0
    assert capsys.readouterr().out.strip() == str(lib)
    assert lib.stat().st_mtime_ns == stamp  # found, not rebuilt
    monkeypatch.setenv("CXX", "false")  # a compiler that always fails
    target = nccl_module.library_path(nccl_module.toolchain())
    assert target != lib  # the compiler is part of the key
    says = r"compiling disco_nccl.cc with false failed \(exit 1\)"
    with pytest.raises(nccl_module.NcclModuleError, match=says):
        nccl_module.build()
    assert not target.exists() and list(target.parent.iterdir()) == []


def test_process_session_workers_load_the_module_and_init_without_a_gpu_is_an_exception(
    nccl_cache,
):
    """The CUDA runner's session (`tp_runner.start_workers`): worker 1, a separate process
    running tallow's entrypoint, has the module loaded; init_ccl is refused on the controller
    in a Python exception, and the workers shut down cleanly."""
    cache, _ = nccl_cache
    proc = _run(
        """
        from tallow.runtime.disco_runtime import disco
        d = disco(ccl="nccl")
        from tallow.runtime.tp_runner import start_workers
        sess = start_workers(d, 2)
        version = sess.get_global_func("tallow.nccl.version")()
        print("worker1", int(version.debug_get_from_remote(1)))
        try:
            sess.init_ccl("nccl", 0, 1)
        except RuntimeError as e:
            print("refused", str(e).splitlines()[0])
        sess.shutdown()
        """,
        cache,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert int(lines["worker1"]) == _pip_nccl_code()
    assert lines["refused"].startswith("NCCL tensor parallelism needs CUDA GPUs")
