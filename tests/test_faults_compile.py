"""Injected fault: the disk fills up during a compile (issue 33).

A real ENOSPC, not a mocked exception: the compile runs in a user + mount namespace over a
small tmpfs (`unshare --user --map-root-user --mount`, no privileges needed), and
tests/fill_disk_compile.py takes the free space away just before one phase. Whichever phase
meets the full disk, the CLI must print one `error:` line saying the disk is full, naming
the folder and the phase, exit 2, and leave the output folder as it found it (no partial
folder, no half-written file). Skipped where user namespaces are not allowed.
"""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tallow.runtime.errors import disk_full_reason

HARNESS = Path(__file__).parent / "fill_disk_compile.py"
TMPFS = 'mount -t tmpfs -o size=8m tmpfs "$0" && exec "$@"'  # then run the command given

# phase title (compiler/pipeline.py) -> bytes left free when it starts
PHASES = {
    # the partial folder's owner record is the first file written
    "read model config": 0,
    # the linker writes part of the ~1 MB library, then fails (ld: "final link failed")
    "build the library": 64 * 1024,
    # the 0.5 MB weight shard is cut short
    "convert weights": 64 * 1024,
    # one page left: the manifest (about 6 KB) is the last file written
    "write manifest": 4096,
}


def _in_namespace(mount: Path, *command: str) -> list[str]:
    return [
        "unshare",
        "--user",
        "--map-root-user",
        "--mount",
        "sh",
        "-c",
        TMPFS,
        str(mount),
        *command,
    ]


@pytest.fixture(scope="module")
def private_tmpfs(tmp_path_factory) -> None:
    """Skips unless this machine lets an unprivileged process mount a tmpfs of its own."""
    probe = tmp_path_factory.mktemp("probe")
    try:
        proc = subprocess.run(
            _in_namespace(probe, "true"), capture_output=True, text=True, timeout=60
        )
    except FileNotFoundError:
        pytest.skip("no `unshare` command (util-linux)")
    if proc.returncode != 0:
        pytest.skip(f"no private tmpfs here (user namespaces not allowed?): {proc.stderr.strip()}")


@pytest.mark.parametrize(
    "phase",
    [p if p == "read model config" else pytest.param(p, marks=pytest.mark.slow) for p in PHASES],
)
def test_disk_full_is_one_error_line_and_leaves_nothing(
    private_tmpfs, tiny_model_dir, tmp_path, phase
):
    mount = tmp_path / "disk"
    mount.mkdir()
    model = str(tiny_model_dir("qwen3"))
    argv = [sys.executable, str(HARNESS), str(mount), model, phase, str(PHASES[phase])]
    proc = subprocess.run(_in_namespace(mount, *argv), capture_output=True, text=True, timeout=900)
    assert proc.stdout.strip(), proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # The disk was filled when the phase began (so the failure is this phase's)...
    assert report["free_when_filled"] and report["free_when_filled"][0] <= PHASES[phase]
    # ...and the CLI says so on one line: disk full, the folder, the phase.
    assert report["code"] == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert "disk full" in errors[0] and "No space left on device" in errors[0], errors[0]
    assert str(mount / "out") in errors[0] and f"({phase}:" in errors[0], errors[0]
    # Nothing left behind: no .partial folder, no half-written file; the earlier file stays.
    assert report["left"] == ["filler", "out", "out/keep.txt"]


def test_disk_full_reason_reads_errnos_causes_and_tool_output():
    """What the compile recognises as a full disk: the errno on an OSError anywhere in the
    chain of causes, or the words a subprocess printed (ld's, when a full disk stopped it)."""
    assert disk_full_reason(OSError(errno.ENOSPC, "No space left on device")) is not None
    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError as quota:
            raise RuntimeError("writing a shard failed") from quota
    except RuntimeError as wrapped:
        assert disk_full_reason(wrapped) == "Disk quota exceeded"
    linker = RuntimeError(
        "Compilation error:\n/usr/bin/ld: final link failed: No space left on device\n"
        "collect2: error: ld returned 1 exit status"
    )
    assert disk_full_reason(linker) == "/usr/bin/ld: final link failed: No space left on device"
    assert disk_full_reason(OSError(errno.EACCES, "Permission denied")) is None
    assert disk_full_reason(RuntimeError("Compilation error: undefined symbol")) is None
