"""Where llguidance fails on large grammars, shape by shape: the measurements behind the
server's grammar limits (`tallow.runtime.grammar_limits`).

    .venv/bin/python benchmarks/grammar_limits.py [--tokenizer tokenizer.json] [--stack-mb 8 256]

llguidance compiles grammars recursively; a deep enough grammar overflows the stack of the
thread that compiles it, and that is a segfault of the whole process (seen: about 3,000
chained Lark rules, or 3,000 chained JSON-schema `$ref`s, on an 8 MiB stack). Each trial here
builds one grammar of one shape and size and compiles it against a real tokenizer in a fresh
subprocess, on a thread with the given stack size; for each shape and stack the script doubles
the size, then bisects, to find the largest size that compiles without crashing (an error
message from llguidance counts as survived: the server turns it into a 400). A size that
compiles but takes over `--timeout` seconds counts as failed too.

The server compiles on threads with a 256 MiB stack and refuses grammars past limits set at
most a quarter of what an 8 MiB stack survives, so a grammar that passes the limits is far
from the crash on either.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

# -- the shapes ------------------------------------------------------------------------------


def lark_chain(n: int) -> tuple[str, str]:
    rules = ["start: r0"] + [f'r{i}: "a" r{i + 1}' for i in range(n)] + [f'r{n}: "b"']
    return "lark", "\n".join(rules)


def lark_parens(n: int) -> tuple[str, str]:
    return "lark", "start: " + "(" * n + '"a"' + ")" * n


def lark_alternatives(n: int) -> tuple[str, str]:
    return "lark", "start: " + " | ".join(f'"option {i}"' for i in range(n))


def regex_nesting(n: int) -> tuple[str, str]:
    return "regex", "(" * n + "a" + ")" * n


def schema_ref_chain(n: int) -> tuple[str, str]:
    defs: dict = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return "schema", json.dumps({"$ref": "#/$defs/d0", "$defs": defs})


def schema_nesting(n: int) -> tuple[str, str]:
    schema: dict = {"type": "string"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return "schema", json.dumps(schema)


def schema_anyof(n: int) -> tuple[str, str]:
    schema: dict = {"type": "string"}
    for _ in range(n):
        schema = {"anyOf": [schema, {"type": "integer"}]}
    return "schema", json.dumps(schema)


def choice(n: int) -> tuple[str, str]:
    return "choice", json.dumps([f"option number {i}" for i in range(n)])


SHAPES: dict[str, Callable[[int], tuple[str, str]]] = {
    f.__name__: f
    for f in (
        lark_chain,
        lark_parens,
        lark_alternatives,
        regex_nesting,
        schema_ref_chain,
        schema_nesting,
        schema_anyof,
        choice,
    )
}

# -- one trial (in a subprocess) -------------------------------------------------------------


def trial(shape: str, n: int, stack_mb: int, tokenizer_path: str) -> None:
    """Compile one grammar on a thread with `stack_mb` MiB of stack, then compute masks and
    walk a few tokens; prints "ok", or "error: ..." for a grammar llguidance refuses."""
    import llguidance as llg
    import numpy as np
    from tokenizers import Tokenizer

    from tallow.runtime import constraint

    tok = Tokenizer.from_file(tokenizer_path)
    eos = 0  # any id: the walk below never picks it
    ll = llg.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=[eos])
    kind, text = SHAPES[shape](n)

    def compile_it() -> None:
        if kind == "lark":
            grammar = constraint.lark_grammar(text)
        elif kind == "regex":
            grammar = constraint.regex_grammar(text)
        elif kind == "choice":
            grammar = constraint.choice_grammar(json.loads(text))
        else:
            grammar = constraint.json_schema_grammar(json.loads(text))
        matchers.append(llg.LLMatcher(ll, grammar, log_level=0))

    matchers: list = []
    threading.stack_size(stack_mb * 2**20)
    t = threading.Thread(target=compile_it)
    t.start()
    t.join()
    threading.stack_size(0)
    if not matchers:
        print("error: raised")
        return
    m = matchers[0]
    if m.is_error():
        print("error: " + m.get_error().splitlines()[0][:120])
        return
    # Masks run where the engine runs them: on an ordinary thread (this one), and for
    # several sequences at once on llguidance's own pool.
    words = (ll.vocab_size + 31) // 32
    both = np.zeros((2, words), dtype=np.int32)
    llg.LLExecutor().unsafe_compute_mask_ptr(
        [(m, 0), (m.deep_copy(), 1)], both.ctypes.data, words * 4, 2
    )
    mask = both[0]
    for _ in range(8):  # a few steps: some limits bite only after the first token
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        allowed = allowed[allowed != eos]
        if not len(allowed) or not m.consume_token(int(allowed[0])):
            break
    print("error: " + m.get_error()[:120] if m.is_error() else "ok")


def run_trial(shape: str, n: int, stack_mb: int, tokenizer: str, timeout: float) -> str:
    cmd = [sys.executable, __file__, "--trial", shape, str(n), str(stack_mb), tokenizer]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout"
    if p.returncode < 0:
        return f"crash (signal {-p.returncode})"
    if p.returncode != 0:
        return "crash (" + (p.stderr.strip().splitlines() or ["exit"])[-1][:80] + ")"
    out = p.stdout.strip().splitlines()[-1]
    return out if out.startswith("error") else f"ok ({time.perf_counter() - t0:.1f} s)"


def survives(outcome: str) -> bool:
    return outcome.startswith(("ok", "error"))


def largest_surviving(shape: str, stack_mb: int, tok: str, timeout: float, top: int) -> str:
    """Double from 64, then bisect: the largest size that survives, and the first that not."""
    lo, hi, n = 0, None, 64
    last_fail = ""
    while n <= top:
        outcome = run_trial(shape, n, stack_mb, tok, timeout)
        if not survives(outcome):
            hi, last_fail = n, outcome
            break
        lo, n = n, n * 2
    if hi is None:
        return f"survives {lo:,} (the largest tried)"
    while hi - lo > max(1, lo // 20):  # within 5%
        mid = (lo + hi) // 2
        outcome = run_trial(shape, mid, stack_mb, tok, timeout)
        if survives(outcome):
            lo = mid
        else:
            hi, last_fail = mid, outcome
    return f"survives {lo:,}; fails at {hi:,}: {last_fail}"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--trial":
        shape, n, stack, tok = sys.argv[2:6]
        trial(shape, int(n), int(stack), tok)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_tok = Path("artifacts/smollm2-135m-instruct-q4_1-cpu/tokenizer.json")
    ap.add_argument("--tokenizer", default=str(default_tok))
    ap.add_argument("--stack-mb", type=int, nargs="+", default=[8, 256])
    ap.add_argument("--shape", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--top", type=int, default=1 << 17, help="largest size tried")
    args = ap.parse_args()
    print(f"| shape | {' | '.join(f'{s} MiB stack' for s in args.stack_mb)} |")
    print("|---|" + "---|" * len(args.stack_mb))
    for shape in args.shape:
        cells = [
            largest_surviving(shape, s, args.tokenizer, args.timeout, args.top)
            for s in args.stack_mb
        ]
        print(f"| {shape} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
