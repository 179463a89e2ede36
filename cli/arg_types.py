"""argparse types for options every runtime command shares, checked as the command line is
parsed: a mistake is reported before the model (or TVM, 4-10 s) is loaded."""

from __future__ import annotations

import argparse

from tallow.runtime.library_select import DEVICE_CHOICES

THREADS_HELP = (
    "CPU kernel threads (default: every usable CPU but one, so that a busy neighbour does not "
    "stall TVM's pinned, spinning pool; docs/cpu-kernels.md#threads)"
)


def positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {n})")
    return n


def device(value: str) -> str:
    """auto, cpu, cuda[:N] or metal[:N] (`library_select.choose_library` reads it)."""
    kind, _, index = value.partition(":")
    if kind not in DEVICE_CHOICES or (index and not index.isdigit()) or value.endswith(":"):
        raise argparse.ArgumentTypeError(
            f"bad device {value!r}; expected auto, cpu, cuda[:N] or metal[:N]"
        )
    return value


def add_device(p) -> None:
    p.add_argument(
        "--device",
        type=device,
        default="auto",
        help="auto (default: CUDA when a driver and a matching SASS arch exist, Metal on a Mac, "
        "else the best CPU library that fits), cpu, cuda[:N] or metal[:N]",
    )
