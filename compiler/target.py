"""Compile targets as the compiler's phases see them: `resolve_target` turns the user's
`--target`, `--dtype` and `--sm` into a `TargetSpec` carrying its backend.

Everything target-specific lives in the backend (`compiler/backends/`, one module per
target); `TargetSpec`, `BuildReport` and `DTYPES` are defined in `backends/base.py`.
"""

from __future__ import annotations

from .backends import DTYPES, BuildReport, TargetSpec, resolve_target

__all__ = ["DTYPES", "BuildReport", "TargetSpec", "resolve_target"]
