"""benchmarks/bandwidth.py: the weight bytes a decode step reads, and the numpy stream.

The oracle for the byte count is the shape's own arithmetic on an f16 file (2 bytes a
weight, 4 a norm scale or bias), not the GGUF reader the function itself uses.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bandwidth  # noqa: E402
import gguf_shapes  # noqa: E402
from test_gguf_shapes import byte_vocabulary  # noqa: E402


def _expected(s: gguf_shapes.Shape) -> int:
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    per_layer = 2 * (s.hidden * (q + 2 * kv) + q * s.hidden + 3 * s.hidden * s.ffn)
    per_layer += 4 * 2 * s.hidden  # attn_norm, ffn_norm
    per_layer += 4 * (q + 2 * kv) if s.qkv_bias else 0
    per_layer += 4 * 2 * s.head_dim if s.qk_norm else 0
    embd = 2 * s.vocab * s.hidden
    # tied: the head reads the whole table; untied: one embedding row plus the whole head
    head = embd if s.tied else 2 * s.hidden + embd
    return s.layers * per_layer + 4 * s.hidden + head


def test_weight_bytes_per_token_counts_one_embedding_row_unless_tied(tmp_path):
    for tied in (False, True):
        shape = gguf_shapes.Shape(
            "qwen2", 256, 2, 4, 2, 64, 512, 1024, tied=tied, qkv_bias=True, rope_theta=1e6
        )
        path = tmp_path / f"tied{tied}.gguf"
        gguf_shapes.write_f16(path, "t", shape, byte_vocabulary())
        assert bandwidth.weight_bytes_per_token(path) == _expected(shape)


def test_stream_reads_at_a_plausible_rate():
    s = bandwidth.Stream(threads=2, mib=64)
    assert len(s.parts) == 2 and sum(p.size for p in s.parts) == 64 << 17
    # any machine reads 64 MiB in well under 10 s and no memory reaches 10 TB/s
    assert 0.0064 < s.best(2) < 10_000
