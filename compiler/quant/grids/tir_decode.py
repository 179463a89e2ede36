"""TIR decoders of the lattice i-quants: `(byte, j, table) -> float32` weight j of a block.

The same decoders as numpy's (`decoders`), on TIR expressions; `table(i)` reads byte `i`
of the format's grid (`tables.grid_bytes`) as an int32 expression.

How the grid reaches the kernel: as a constant *parameter*. The fused dequantize-matmul
takes it as a third input (`model_defs.quant_ops`), a Relax constant bound at the call,
so the library carries it once per format (the VM's constant pool) and every schedule sees
an ordinary read-only uint8 buffer. Not `T.allocate_const` inside the kernel: these
decoders are expressions inside a `te.compute` (shared by the matmul, the embedding lookup
and the full dequantization), which cannot hold a statement-level allocation, and a
constant allocation added after `create_prim_func` would sit outside the blocks that the
s_tir schedules and dlight rewrite. Not arithmetic (as the 16-entry tables of iq4 and
MXFP4, `tir_bytes.small_table`): 256 to 2048 entries would take a select tree 8 to 11
deep per weight.
"""

from __future__ import annotations

from tvm import tirx

from . import decoders


class _Reader:
    def __init__(self, byte, table):
        self.byte, self.grid = byte, table

    @staticmethod
    def f16(bits):
        return tirx.reinterpret("float16", bits.astype("uint16")).astype("float32")

    @staticmethod
    def f32(x):
        return x.astype("float32")


def _decoder(name: str):
    decode = getattr(decoders, name)

    def tir_decode(byte, j, table):
        return decode(_Reader(byte, table), j)

    tir_decode.__name__ = name
    return tir_decode


iq2_xxs = _decoder("iq2_xxs")
iq2_xs = _decoder("iq2_xs")
iq2_s = _decoder("iq2_s")
iq3_xxs = _decoder("iq3_xxs")
iq3_s = _decoder("iq3_s")
iq1_s = _decoder("iq1_s")
iq1_m = _decoder("iq1_m")
