"""Every GPU-scheduled kernel the OpenCL tests run, run again on Oclgrind's simulated device
with its memory (on by default), data-race (`--data-races`) and uninitialised-value
(`--uninitialized`) checks: a test fails on any report, printing it, and on a wrong result.

PoCL runs a work-group's items in an order that hides shared-memory races and reads past a
buffer's end land in memory PoCL owns; Oclgrind checks every access of every work-item. The
cases are `opencl_cases.OCLGRIND_CASES` (the PoCL test's kernels at small shapes; the full
every-format sweep is benchmarks/oclgrind_sweep.py), each in a subprocess under `oclgrind`,
its report written to a log of its own. Planted bugs (a race, a read past the end, a read of
never-written local memory) show the harness reports what it should. Needs Debian `oclgrind`
and PyPI pyopencl; skips naming what is missing. About 3 minutes on 2 idle cores, 6 on a
loaded machine (docs/gpu-artifacts.md#oclgrind).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyopencl", reason="needs PyPI pyopencl (test extras)")
pytestmark = pytest.mark.skipif(
    shutil.which("oclgrind") is None, reason="needs Debian oclgrind (apt-get install oclgrind)"
)

pytest.importorskip("tvm")

import opencl_cases  # noqa: E402

HARNESS = Path(__file__).with_name("oclgrind_harness.py")
FLAGS = ("--data-races", "--uninitialized")
# The first line of each of Oclgrind's reports ("Read-write data race at local memory
# address ...", "Invalid read of size 4 at global memory address ...") starts unindented;
# its details (kernel, work-items, instruction, source line) follow indented.
_HEADLINE = re.compile(r"^\S.*$", re.M)


def findings(log: str) -> list[str]:
    """Oclgrind's reports in `log`, one string each (headline and details)."""
    starts = [m.start() for m in _HEADLINE.finditer(log)]
    ends = [*starts[1:], len(log)] if starts else []
    return [log[a:b].strip() for a, b in zip(starts, ends, strict=True)]


def under_oclgrind(case: str, log: Path, timeout: float = 300) -> tuple[list[str], str]:
    """(Oclgrind's reports, the harness's output) for one case run under `oclgrind`."""
    cmd = ["oclgrind", *FLAGS, "--log", str(log), sys.executable, str(HARNESS), case]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    reports = findings(log.read_text() if log.exists() else "")
    # a wrong result (the harness's numpy check) comes with the reports that may explain it
    seen = f"\n{_summary(reports)}" if reports else ""
    assert done.returncode == 0, f"{case} failed under oclgrind:\n{output[-3000:]}{seen}"
    assert "device: Oclgrind" in output, f"{case} ran on another device:\n{output}"
    return reports, output


def _summary(reports: list[str]) -> str:
    kinds: dict[str, int] = {}
    for r in reports:
        kind = re.sub(r" at .*| of size \d+.*", "", r.splitlines()[0])
        kinds[kind] = kinds.get(kind, 0) + 1
    head = ", ".join(f"{n} x {k}" for k, n in kinds.items())
    return f"{len(reports)} Oclgrind reports ({head}); the first:\n" + "\n\n".join(reports[:3])


# The sampler's and the merge's cases are the quick set's guards of the races Oclgrind found
# (sampling.py's tree_reduce barrier, TVM's merge_state_inplace replaced); the others run
# long in all (3 to 6 minutes), hence `slow`.
_QUICK = {"sampler", "merge_state"}


@pytest.mark.parametrize(
    "case",
    [
        c if c in _QUICK else pytest.param(c, marks=pytest.mark.slow)
        for c in opencl_cases.OCLGRIND_CASES
    ],
)
def test_kernels_under_oclgrind_report_nothing(case, tmp_path):
    reports, output = under_oclgrind(case, tmp_path / "oclgrind.log")
    assert not reports, f"{case}: {_summary(reports)}"
    assert f"case {case}: ok" in output


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("planted_shift_without_barrier", "Read-write data race at local memory"),
        ("planted_read_past_the_end", "Invalid read of size 4 at global memory"),
        ("planted_read_unwritten_local", "Uninitialized value"),
    ],
)
def test_planted_bugs_are_reported(case, expected, tmp_path):
    reports, _ = under_oclgrind(case, tmp_path / "oclgrind.log", timeout=60)
    assert any(r.startswith(expected) for r in reports), reports[:3]
    assert all("Kernel: " in r for r in reports), reports[:3]


@pytest.mark.parametrize("case", list(opencl_cases.KNOWN_FINDINGS))
def test_known_findings_in_tvm_kernels_are_still_there(case, tmp_path):
    """TVM's `merge_state_inplace` (paged-KV attention) reads and writes S[n, h] from every
    work-item of a head without a barrier (`opencl_paged_kv.check_merge_state`). GPU
    artifacts run tallow's kernel in its place (`schedules/gpu/merge_state.py`, the
    `merge_state` case); when a TVM upgrade fixes TVM's, this fails: say so there."""
    _, expected = opencl_cases.KNOWN_FINDINGS[case]
    reports, _ = under_oclgrind(case, tmp_path / "oclgrind.log")
    assert any(r.startswith(expected) for r in reports), _summary(reports) if reports else "none"
