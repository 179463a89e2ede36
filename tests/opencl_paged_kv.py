"""TVM's paged KV-cache attention kernels (`tvm.relax.frontend.nn.llm`, the ones a GPU
artifact's `TIRPagedKVCache` is built with) lowered for OpenCL and run against numpy: decode
over pages, prefill over pages (causal, a chunk after cached tokens), prefill over ragged
q/k/v, and the merge of two attention states (`check_merge_state`: TVM's kernel races;
tallow's, `schedules/gpu/merge_state.py`, takes its place in GPU artifacts).
Shared by the PoCL and Oclgrind tests (`opencl_cases.OCLGRIND_CASES`).

Only float32: an f16 model's cache computes in f16, which neither PoCL 3.1 nor Oclgrind
(no cl_khr_fp16) can run. The kernels are scheduled by TVM already (thread bindings inside);
the cache's two unscheduled helpers (`kv_cache_transpose_append`, `tir_split_rotary`) get
the backend's dlight schedule in an artifact and are not run here. Rotary mode 0: tallow's
cache rotates q/k before appending (RopeMode.NORMAL), not inside attention.
"""

from __future__ import annotations

import numpy as np
import tvm
from opencl_runner import OPENCL_TARGET, OpenCLKernels

PAGE = 16  # the page size the kernels are built for (tallow's cache uses it)
_SCALARS = {"rotary_mode": 0, "rope_scale": 1.0, "rope_theta": 10000.0, "causal": 1}


def _kernels(h_kv: int, h_q: int, d: int, names=("decode", "prefill", "ragged")):
    from tvm.relax.frontend.nn.llm import _decode_kernels as dec
    from tvm.relax.frontend.nn.llm import _prefill_kernels as pre

    from tallow.schedules.gpu.merge_state import merge_state_kernel

    target = tvm.target.Target(OPENCL_TARGET, host="llvm")
    with target:
        funcs = {
            "decode": dec._attention_decode(h_kv, h_q, d, "float32", False, {}, target),
            "prefill": pre._attention_prefill(h_kv, h_q, d, "float32", False, {}, target),
            "ragged": pre._attention_prefill_ragged(h_kv, h_q, d, d, "float32", {}, target),
            "merge": dec._merge_state_inplace(h_q, d, "float32", target),
            "tallow_merge": merge_state_kernel("float32"),
        }
    return OpenCLKernels({name: funcs[name] for name in names})


def _attend(q, k, v, scale):
    """Causal attention of the last len(q) of len(k) positions; (output, lse in log2)."""
    s = np.einsum("qhd,khd->hqk", q, k) * scale
    qn, kn = len(q), len(k)
    s[:, np.arange(kn)[None, :] > (kn - qn + np.arange(qn))[:, None]] = -np.inf
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    out = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v)
    lse = (m[..., 0] + np.log(p.sum(-1))) / np.log(2)
    return out, lse.T


def check_paged_kv_attention(kv_lens=(1, 17, 40), q_lens=(1, 5, 16), h_kv=2, h_q=4, d=64):
    """Each sequence s holds kv_lens[s] tokens in pages (shuffled page ids, one spare page);
    decode attends from one new query per sequence, prefill from the last q_lens[s] of them."""
    kernels = _kernels(h_kv, h_q, d)
    rng = np.random.default_rng(7)
    group, b = h_q // h_kv, len(kv_lens)
    counts = [-(-n // PAGE) for n in kv_lens]
    ids = rng.permutation(sum(counts) + 1).astype(np.int32)[: sum(counts)]
    pages = rng.standard_normal((sum(counts) + 1, 2, h_kv, PAGE, d)).astype(np.float32)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    last = np.array([n - (c - 1) * PAGE for n, c in zip(kv_lens, counts, strict=True)], np.int32)
    scale = 1 / np.sqrt(d)

    def kv(s):
        mine = pages[ids[indptr[s] : indptr[s + 1]]]  # [pages, 2, h_kv, PAGE, d]
        flat = mine.transpose(1, 0, 3, 2, 4).reshape(2, -1, h_kv, d)[:, : kv_lens[s]]
        return np.repeat(flat[0], group, 1), np.repeat(flat[1], group, 1)  # per query head

    common = {
        "pages": pages,
        "length_info": last,
        "k_rope_pos_offset": np.zeros(b, np.int32),
    }
    offsets = {
        f"{n}_elem_offset": 0
        for n in ("pages", "length_info", "k_rope_pos_offset", "q_rope_position", "q_indptr")
    }
    offsets |= {"page_indptr_elem_offset": 0, "page_values_elem_offset": 0}
    offsets |= {"kv_indptr_elem_offset": 0, **_SCALARS, "sm_scale": scale}

    q = rng.standard_normal((b, h_q, d)).astype(np.float32)
    out, lse = np.full_like(q, np.nan), np.full((b, h_q), np.nan, np.float32)
    arrays = {**common, "Q": q, "output": out, "lse": lse, "q_rope_position": np.zeros(b, np.int32)}
    arrays |= {"page_table_indptr": indptr, "page_table_values": ids}
    kernels.run("decode", arrays, {"B": b, **offsets})
    for s in range(b):
        ref, ref_lse = _attend(q[s : s + 1], *kv(s), scale)
        np.testing.assert_allclose(out[s], ref[0], rtol=1e-4, atol=1e-5, err_msg=f"decode {s}")
        np.testing.assert_allclose(lse[s], ref_lse[0], rtol=1e-4, atol=1e-4)

    q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    total = int(q_indptr[-1])
    q = rng.standard_normal((total, h_q, d)).astype(np.float32)
    out, lse = np.full_like(q, np.nan), np.full((total, h_q), np.nan, np.float32)
    arrays = {**common, "q": q, "q_indptr": q_indptr, "output": out, "lse": lse}
    arrays |= {"q_rope_position": np.zeros(total, np.int32), "page_indptr": indptr}
    kernels.run("prefill", {**arrays, "page_values": ids}, {"batch_size": b, **offsets})
    k_rag, v_rag, refs = [], [], []
    for s in range(b):
        k_s, v_s = kv(s)
        refs.append(_attend(q[q_indptr[s] : q_indptr[s + 1]], k_s, v_s, scale))
        k_rag.append(k_s[:, ::group])
        v_rag.append(v_s[:, ::group])
    ref = np.concatenate([r[0] for r in refs])
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5, err_msg="prefill over pages")
    np.testing.assert_allclose(lse, np.concatenate([r[1] for r in refs]), rtol=1e-4, atol=1e-4)

    out[:] = np.nan
    arrays = {"q": q, "q_indptr": q_indptr, "output": out, "lse": lse}
    arrays |= {"k": np.concatenate(k_rag), "v": np.concatenate(v_rag)}
    arrays |= {"kv_indptr": np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)}
    arrays |= {
        "q_rope_position": np.zeros(total, np.int32),
        "k_rope_pos_offset": common["k_rope_pos_offset"],
    }
    kernels.run("ragged", arrays, {"batch_size": b, **offsets})
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5, err_msg="prefill, ragged kv")


def check_merge_state(
    n: int = 3, h_q: int = 4, d: int = 64, compare: bool = True, kernel: str = "tallow_merge"
):
    """The merge of two attention states (V, S in log2) into V, S in place: what the cache
    runs after attending to a chunk's own tokens (ragged) and to its cached ones (pages).

    `kernel` "merge" is TVM's: each of a head's d / 4 work-items reads S[n, h], then writes
    it, with no barrier between: a work-item that finishes before another starts (PoCL,
    Oclgrind) rescales with an S already merged. Lanes of one converged warp load before any
    stores, so a GPU gets the right answer as long as a head's work-items share a warp;
    Oclgrind reports the race (test_oclgrind.py expects it, docs/gpu-artifacts.md#oclgrind).
    "tallow_merge" is the kernel GPU artifacts run in its place."""
    kernels = _kernels(max(h_q // 2, 1), h_q, d, [kernel])
    rng = np.random.default_rng(8)
    v1, v2 = (rng.standard_normal((n, h_q, d)).astype(np.float32) for _ in range(2))
    s1, s2 = (rng.standard_normal((n, h_q)).astype(np.float32) * 3 for _ in range(2))
    w1 = 1 / (1 + np.exp2(s2 - s1))
    ref_v = w1[..., None] * v1 + (1 - w1[..., None]) * v2
    ref_s = np.logaddexp2(s1, s2)
    arrays = {"V": v1.copy(), "S": s1.copy(), "V_other": v2, "S_other": s2}
    kernels.run(kernel, arrays, {"N": n, "H": h_q, "D": d})
    if not compare:  # run only, for Oclgrind's report of the race
        return
    np.testing.assert_allclose(arrays["V"], ref_v, rtol=1e-5, atol=1e-6, err_msg="merge V")
    np.testing.assert_allclose(arrays["S"], ref_s, rtol=1e-5, atol=1e-5, err_msg="merge S")
