"""CPU (LLVM) schedules."""

from __future__ import annotations


def schedule_module(mod):
    return mod
