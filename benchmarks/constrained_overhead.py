"""What a JSON-schema constraint costs per decode step, at batch 1 and 16, on one artifact.

    .venv/bin/python benchmarks/constrained_overhead.py artifacts/smollm2-135m-instruct-q4_1-cpu

Three modes run interleaved, round by round (this machine's shared cores make single runs vary):
`plain` (no constraint: the compiled sampler), `json` (every request constrained by a typical
schema, masks computed in the worker thread during the forward) and `json-seq` (the same, with
the masks computed after the forward on the step thread). Only full decode steps count: no
prefill in the step and every request still running. The table shows each mode's median step
time and its overhead over `plain`; then the time to compile the schema (uncached) and to wrap
the tokenizer for llguidance (once per model), and llguidance's own mask time per step.
"mask wait" is the step thread's time on masks after the forward returned: all of the mask
computation in `json-seq`, only what the forward did not hide in `json`.
"""

from __future__ import annotations

import argparse
import statistics
import time

from tallow.runtime import constraint
from tallow.runtime.engine_factory import EngineOptions, build_engine
from tallow.runtime.sampling_params import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
            "required": ["street", "city"],
        },
        "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    },
    "required": ["name", "age", "address", "hobbies"],
}
PROMPT = "Describe a fictional person as a JSON object with a long list of details."


def run_mode(engine, prompt, batch: int, mode: str, max_tokens: int) -> tuple[list[float], float]:
    grammar = None if mode == "plain" else constraint.json_schema_grammar(SCHEMA)
    engine.overlap_masks = mode != "json-seq"
    for i in range(batch):
        p = SamplingParams(
            max_tokens=max_tokens, temperature=0.7, seed=i, ignore_eos=True, grammar=grammar
        )
        engine.submit(prompt, p, lambda _: None)
    times = []
    wait0 = engine.mask_wait_s
    sched = engine.scheduler
    while engine._has_work():
        engine._drain_inbox()
        full = len(sched.running) == batch and not sched.waiting
        decoding = full and all(s.num_pending_tokens == 1 for s in sched.running)
        t = time.perf_counter()
        engine.run_step()
        if decoding:
            times.append(time.perf_counter() - t)
    return times, engine.mask_wait_s - wait0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()

    engine = build_engine(args.artifact, EngineOptions(max_num_seqs=16, prefix_cache=False))
    model = engine.model
    prompt = model.encode_chat([{"role": "user", "content": PROMPT}])

    t = time.perf_counter()
    gtok = constraint.GrammarTokenizer(model.tokenizer, model.vocab_size, model.eos_token_ids)
    wrap_s = time.perf_counter() - t
    compiles = []
    for _ in range(5):
        t = time.perf_counter()
        m = gtok.matcher(constraint.json_schema_grammar(SCHEMA))
        compiles.append(time.perf_counter() - t)
        gtok._templates.clear()  # uncached each time
    # llguidance's mask time alone, over a typical output's prefix
    text = '{"name": "Ada Lovelace", "age": 36, "address": {"street": "1 Main St", "city": "Lo'
    ids = model.tokenizer.encode(text, add_special_tokens=False).ids
    mask_us = {}
    for batch in (1, 16):
        ms = [m.clone() for _ in range(batch)]
        per = []
        for tok in ids:
            t = time.perf_counter()
            constraint.compute_masks(ms)
            per.append(time.perf_counter() - t)
            for x in ms:
                x.accept(tok)
        mask_us[batch] = statistics.median(per) * 1e6
    engine.grammar_tokenizer  # noqa: B018 - built before timing

    modes = ["plain", "json", "json-seq"]
    results: dict[tuple[int, str], list[float]] = {}
    waits: dict[tuple[int, str], float] = {}
    for _ in range(args.rounds):
        for batch in (1, 16):
            for mode in modes:
                times, wait = run_mode(engine, prompt, batch, mode, args.max_tokens)
                results.setdefault((batch, mode), []).extend(times)
                waits[(batch, mode)] = waits.get((batch, mode), 0.0) + wait

    print(f"artifact: {args.artifact}")
    head = f"{'batch':>5} {'mode':>9} {'steps':>6} {'median ms':>10} {'overhead':>9}"
    print(f"{head} {'mask wait us/step':>18}")
    for batch in (1, 16):
        base = statistics.median(results[(batch, "plain")])
        for mode in modes:
            ts = results[(batch, mode)]
            med = statistics.median(ts)
            wait_us = waits[(batch, mode)] / (len(ts) + args.rounds) * 1e6  # + prefill steps
            row = f"{batch:>5} {mode:>9} {len(ts):>6} {med * 1e3:>10.2f} {med / base - 1:>+9.1%}"
            print(f"{row} {wait_us:>18.0f}")
    print(f"llguidance tokenizer wrap: {wrap_s * 1e3:.0f} ms (once per model)")
    print(f"schema compile (uncached): median {statistics.median(compiles) * 1e3:.2f} ms")
    for batch, us in mask_us.items():
        print(f"mask computation alone, batch {batch}: median {us:.0f} us per step")


if __name__ == "__main__":
    main()
