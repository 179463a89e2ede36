"""`tallow compile` onto a file system that fills up at a chosen phase (test_faults_compile.py).

Run inside a private mount namespace with a small tmpfs at MOUNT: the artifact goes to
MOUNT/out (which already holds keep.txt), and just before the phase titled PHASE starts, a
file beside that folder takes all the free space but FREE bytes. The compile then meets a
real ENOSPC from the kernel (in Python's writes, or in the linker TVM runs) while that phase
writes. The tmpfs vanishes with the namespace, so this prints what is left on it, as JSON on
stdout, after the CLI returns; the CLI's own stderr passes through.

usage: fill_disk_compile.py MOUNT MODEL PHASE FREE
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

from tallow.cli.main import main
from tallow.compiler import progress

FILLER = "filler"


def fill(mount: Path, free: int) -> None:
    st = os.statvfs(mount)
    room = st.f_bavail * st.f_frsize - free
    with open(mount / FILLER, "wb") as f:
        f.write(b"\0" * max(room, 0))


def run(mount: Path, model: str, phase: str, free: int) -> dict:
    out = mount / "out"
    out.mkdir()
    (out / "keep.txt").write_text("written before the compile\n")
    filled = []
    announce = progress.Progress.phase

    def phase_then_fill(self, index: int, total: int, title: str) -> None:
        if title == phase:
            fill(mount, free)
            filled.append(os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize)
        announce(self, index, total, title)

    progress.Progress.phase = phase_then_fill
    try:
        code = main(["compile", "--model", model, "--output", str(out)])
    except BaseException:  # what the real CLI would do: a traceback and exit status 1
        traceback.print_exc()
        code = 1
    left = sorted(str(p.relative_to(mount)) for p in mount.rglob("*"))
    return {"code": code, "free_when_filled": filled, "left": left}


if __name__ == "__main__":
    mount, model, phase, free = sys.argv[1:]
    print(json.dumps(run(Path(mount), model, phase, int(free))))
