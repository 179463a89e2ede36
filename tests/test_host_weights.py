"""CPU weights in one huge-page mapping (runtime/host_weights.py): the tensors TVM gets hold
exactly the weights, start on page boundaries, and are used by a compiled kernel as any
other tensor; dtypes numpy cannot export through DLPack take TVM's own allocation."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from tallow.compiler.target import resolve_target
from tallow.runtime.host_weights import ALIGN, host_weights

CPU = tvm.cpu(0)


def _arrays():
    rng = np.random.default_rng(3)
    return [
        rng.standard_normal((7, 33)).astype(np.float32),  # not a multiple of a page
        rng.integers(0, 256, (5000,), dtype=np.uint8),
        np.zeros((0, 4), np.float32),  # empty
        rng.standard_normal((3, 5)).astype(np.float16)[:, ::2],  # not contiguous
        np.float32(2.5).reshape(()),  # a scalar
        rng.integers(-9, 9, (4, 4), dtype=np.int64),
    ]


def test_tensors_hold_the_weights_on_page_boundaries():
    arrays = _arrays()
    tensors = host_weights(tvm, arrays, CPU)
    assert len(tensors) == len(arrays)
    for a, t in zip(arrays, tensors, strict=True):
        assert tuple(t.shape) == a.shape and str(t.dtype) == str(a.dtype)
        np.testing.assert_array_equal(t.numpy(), a)
        if a.size:
            assert t.data_ptr() % ALIGN == 0
    # one mapping: the weights sit one after another in it
    placed = [t.data_ptr() for a, t in zip(arrays, tensors, strict=True) if a.size]
    assert placed == sorted(placed)
    assert placed[-1] - placed[0] < 64 * ALIGN


def test_bfloat16_takes_tvms_own_allocation():
    a = np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16)
    b = np.ones((8,), np.float32)
    tb, tf = host_weights(tvm, [a, b], CPU)
    assert str(tb.dtype) == "bfloat16"
    np.testing.assert_array_equal(tb.numpy().astype(np.float32), a.astype(np.float32))
    np.testing.assert_array_equal(tf.numpy(), b)


def test_a_kernel_reads_them_like_any_tensor():
    @T.prim_func(s_tir=True)
    def scale(w: T.Buffer((64, 32), "float32"), out: T.Buffer((64,), "float32")):
        for i in T.parallel(64):
            out[i] = T.float32(0)
            for j in range(32):
                out[i] = out[i] + w[i, j] * T.float32(2)

    target = resolve_target("cpu", "f32").tvm()
    with target:
        lib = tvm.compile(tvm.IRModule({"main": scale}), target)
    w = np.random.default_rng(5).standard_normal((64, 32)).astype(np.float32)
    (tw,) = host_weights(tvm, [w], CPU)
    out = tvm.runtime.empty((64,), "float32")
    lib["main"](tw, out)
    np.testing.assert_allclose(out.numpy(), (w * 2).sum(axis=1), rtol=1e-5)


def test_huge_pages_asked_where_linux_allows_them():
    """With transparent huge pages on `madvise` or `always`, the mapping is advised (the
    kernel may still decline, so only the advice is checked, through smaps)."""
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        pytest.skip("no transparent huge pages here")
    if "[never]" in mode:
        pytest.skip("transparent huge pages are off")
    big = np.ones((4 * 1024 * 1024,), np.uint8)
    (t,) = host_weights(tvm, [big], CPU)
    address = t.data_ptr()
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and not line.startswith(" "):
            lo, hi = (int(v, 16) for v in head.split("-"))
            if lo <= address < hi:
                flags = next(x for x in lines[i + 1 :] if x.startswith("VmFlags:"))
                assert " hg" in flags, flags
                return
    pytest.fail("the weights' mapping is not in /proc/self/smaps")
