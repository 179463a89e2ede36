"""Decode speed with speculative decoding (prompt lookup), tallow and llama.cpp side by side.

    .venv/bin/pip install llama-cpp-python==0.3.36      # builds llama.cpp (~10 min, 2 cores)
    .venv/bin/python benchmarks/speculative_decode.py [--shape smollm2-q4_1]
        [--shape gemma-3-270m-real] [--threads 2] [--rounds 3] [--max-tokens 200]
        [--artifact-dir DIR] [--no-llamacpp]
    .venv/bin/python benchmarks/speculative_decode.py --draft-for smollm2-1.7b

Four tasks, each a chat prompt applied with the model's own template and answered greedily
(temperature 0): three grounded in their input (a code file with one identifier renamed, a
JSON document with one field changed, a paragraph summarised with quotes) and one open-ended
chat. Per task and round, interleaved: tallow without speculation, tallow with
`--speculative ngram`, llama.cpp, llama.cpp with its prompt lookup
(`LlamaPromptLookupDecoding`, its defaults: 2-grams, 10 proposed tokens). Decode speed counts
the tokens after the first and the time after it, so prefill is out of it; the best of the
rounds is kept. Same GGUF file, same prompt token ids, same thread count on both sides.
"""

from __future__ import annotations

import argparse
import json
import time

import bench_files

CODE = """def compute_total(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def apply_discount(total, discount):
    if discount > total:
        return 0
    return total - discount


def format_receipt(items, tax_rate, discount):
    total = apply_discount(compute_total(items, tax_rate), discount)
    lines = [f"{item.name}: {item.price * item.quantity:.2f}" for item in items]
    lines.append(f"total: {total:.2f}")
    return "\\n".join(lines)
"""
DOC = {
    "id": 4182,
    "name": "Ada Lovelace",
    "email": "ada@example.com",
    "roles": ["admin", "editor"],
    "address": {"street": "12 St James's Square", "city": "London", "postcode": "SW1Y 4JH"},
    "active": True,
    "logins": 37,
}
PARAGRAPH = (
    "The committee met on Tuesday to review the bridge project. The engineer reported that "
    '"the steel frame is complete and the deck will be poured next month". The treasurer '
    'warned that "costs have risen by eleven percent since spring". The chair concluded '
    'that "the opening date of 1 June still stands, provided the weather holds".'
)
TASKS = {
    "code rename": "Rename the variable `subtotal` to `base_amount` in this code. Reply with "
    "the whole code and nothing else.\n\n" + CODE,
    "json edit": "Change the city to Paris in this JSON document. Reply with the whole "
    "document and nothing else.\n\n" + json.dumps(DOC, indent=2),
    "quote summary": "Summarise this paragraph in three sentences, quoting each speaker "
    "exactly.\n\n" + PARAGRAPH,
    "open chat": "Write a short story about a robot who learns to paint.",
}


def prompt_ids(model, text: str) -> list[int]:
    """The task as a chat turn, or as plain text where the model has no chat template (the
    base models of some GGUF files)."""
    from tallow.runtime.served_model import NoChatTemplateError

    try:
        return model.encode_chat([{"role": "user", "content": text}])
    except NoChatTemplateError:
        return model.encode_text(text + "\n\n")


def tallow_decode(engine, prompt_ids: list[int], max_tokens: int) -> tuple[float, int]:
    """(decode tok/s, tokens) of one greedy request through `engine`."""
    from tallow.runtime.generate import GenerationStats, generate_text_with_engine
    from tallow.runtime.sampling_params import SamplingParams

    stats = GenerationStats()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for _ in generate_text_with_engine(engine, prompt_ids, params, stats):
        pass
    return stats.decode_tok_s, stats.generated_tokens


def llamacpp_decode(llm, prompt_ids: list[int], max_tokens: int, eos: set[int]):
    """(decode tok/s, tokens) of one greedy generation by llama-cpp-python."""
    llm.reset()
    count, first = 0, None
    for token in llm.generate(prompt_ids, temp=0.0, top_k=1, reset=True):
        count += 1
        if first is None:
            first = time.perf_counter()
        if token in eos or count >= max_tokens:
            break
    rate = (count - 1) / (time.perf_counter() - first) if count > 1 else 0.0
    return rate, count


def run_shape(shape: str, args) -> None:
    from tallow.runtime.engine_factory import EngineOptions, build_engine
    from tallow.runtime.speculative import SpeculativeConfig

    gguf = bench_files.shape_file(shape)
    art = bench_files.compiled(gguf, args.artifact_dir)
    plain = build_engine(art, EngineOptions(threads=args.threads, max_num_seqs=1))
    spec = build_engine(
        art,
        EngineOptions(
            threads=args.threads,
            max_num_seqs=1,
            speculative=SpeculativeConfig(num_speculative_tokens=args.k),
        ),
    )
    llm = lookup = None
    if not args.no_llamacpp:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        kw = dict(n_ctx=2048, n_threads=args.threads, n_batch=512, verbose=False)
        llm = Llama(str(gguf), **kw)
        lookup = Llama(str(gguf), draft_model=LlamaPromptLookupDecoding(), **kw)
    eos = set(plain.eos_token_ids)
    print(f"\n{shape} ({gguf.name}), {args.threads} threads; {bench_files.load_note()}")
    head = f"{'task':14} {'tallow':>8} {'+ngram':>8} {'x':>5} {'accept':>7}"
    if llm is not None:
        head += f" {'llama':>8} {'+lookup':>8} {'ours/its':>8}"
    print(head + "   (decode tok/s, best of rounds; tokens)")
    for task, text in TASKS.items():
        ids = prompt_ids(plain.model, text)
        best = {k: (0.0, 0) for k in ("plain", "spec", "llama", "lookup")}
        before = spec.scheduler.speculation.stats
        p0, a0 = before.proposed, before.accepted
        runs = {
            "plain": lambda ids=ids: tallow_decode(plain, ids, args.max_tokens),
            "spec": lambda ids=ids: tallow_decode(spec, ids, args.max_tokens),
        }
        if llm is not None:
            runs["llama"] = lambda ids=ids: llamacpp_decode(llm, ids, args.max_tokens, eos)
            runs["lookup"] = lambda ids=ids: llamacpp_decode(lookup, ids, args.max_tokens, eos)
        for _ in range(args.rounds):
            for name, run in runs.items():
                best[name] = max(best[name], run())
        s = spec.scheduler.speculation.stats
        accept = (s.accepted - a0) / max(1, s.proposed - p0)
        ratio = best["spec"][0] / best["plain"][0] if best["plain"][0] else 0.0
        line = f"{task:14} {best['plain'][0]:8.1f} {best['spec'][0]:8.1f} {ratio:5.2f}"
        line += f" {accept:7.0%}"
        if llm is not None:
            vs = best["spec"][0] / best["lookup"][0] if best["lookup"][0] else 0.0
            line += f" {best['llama'][0]:8.1f} {best['lookup'][0]:8.1f} {vs:8.2f}"
        tokens = "/".join(str(best[k][1]) for k in best if best[k][1])
        print(f"{line}   ({tokens})", flush=True)


def step_ms(runner, tokens: int, reps: int = 20) -> float:
    """Median ms of a forward feeding `tokens` tokens of one 200-token sequence, every row's
    logits (speculative verification; 1: a decode step)."""
    import statistics

    seq = 90_000
    runner.add_sequence(seq)
    runner.forward([(seq, list(range(100, 300)))])
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        runner.forward([(seq, [7] * tokens)], None if tokens == 1 else [tokens])
        times.append(time.perf_counter() - t)
        runner.popn(seq, tokens)
    runner.remove_sequence(seq)
    return 1000 * statistics.median(times)


def draft_costs(target_shape: str, args) -> None:
    """SmolLM2-135M drafting for a bigger model of its vocabulary (random weights: only the
    costs are real). Measured: the target's decode step, its verification of k proposals,
    the draft's decode step; from them, the speed-up at a given acceptance rate alpha,
    E[tokens] / (verify + k drafts) relative to decode, at the best k. Then end to end: the
    random target rejects nearly every guess, and the policy must stop drafting."""
    from tallow.runtime.engine_factory import EngineOptions, build_engine
    from tallow.runtime.speculative import SpeculativeConfig

    target = bench_files.compiled(bench_files.shape_file(target_shape), args.artifact_dir)
    draft = bench_files.compiled(bench_files.shape_file(bench_files.SMOLLM2), args.artifact_dir)
    spec = SpeculativeConfig(kind="draft", draft=str(draft), num_speculative_tokens=args.k)
    fast = build_engine(target, EngineOptions(threads=args.threads, speculative=spec))
    plain = build_engine(target, EngineOptions(threads=args.threads))
    decode = step_ms(fast.runner, 1)
    draft_step = step_ms(fast.scheduler.speculation.proposer.runner, 1)
    verify = {k: step_ms(fast.runner, k + 1) for k in range(1, args.k + 1)}
    print(
        f"\n{target_shape} drafted by SmolLM2-135M, {args.threads} threads; "
        f"{bench_files.load_note()}"
    )
    print(
        f"decode {decode:.1f} ms, draft decode {draft_step:.1f} ms, verify k=1..{args.k}: "
        + ", ".join(f"{v:.1f}" for v in verify.values())
        + " ms"
    )
    for alpha in (0.5, 0.7, 0.8, 0.9):
        gains = {
            k: (1 - alpha ** (k + 1)) / (1 - alpha) * decode / (verify[k] + k * draft_step)
            for k in verify
        }
        k = max(gains, key=gains.get)
        print(f"  alpha {alpha:.1f}: best k {k}, speed-up {gains[k]:.2f}x")
    ids = prompt_ids(plain.model, TASKS["open chat"])
    a, _ = tallow_decode(plain, ids, args.max_tokens)
    b, _ = tallow_decode(fast, ids, args.max_tokens)
    s = fast.scheduler.speculation.stats
    print(
        f"  end to end on random weights: {a:.1f} -> {b:.1f} tok/s ({b / a:.2f}x), "
        f"{s.accepted} of {s.proposed} proposed tokens accepted"
    )


def concurrent_chat(shape: str, args, users: int = 16) -> None:
    """Aggregate tok/s of `users` open-chat requests at once (different seeds, temperature
    0.7), without and with prompt lookup, interleaved: batches must not get slower."""
    from tallow.runtime.engine_factory import EngineOptions, build_engine
    from tallow.runtime.sampling_params import SamplingParams
    from tallow.runtime.speculative import SpeculativeConfig

    art = bench_files.compiled(bench_files.shape_file(shape), args.artifact_dir)
    opts = dict(threads=args.threads, max_num_seqs=users)
    engines = {
        "plain": build_engine(art, EngineOptions(**opts)),
        "ngram": build_engine(art, EngineOptions(**opts, speculative=SpeculativeConfig())),
    }
    ids = prompt_ids(engines["plain"].model, TASKS["open chat"])
    params = [
        SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=i) for i in range(users)
    ]
    best = dict.fromkeys(engines, 0.0)
    for _ in range(args.rounds):
        for name, engine in engines.items():
            t = time.perf_counter()
            outs = engine.generate([ids] * users, params)
            n = sum(len(d.token_ids) for out in outs for o in out for d in o.outputs)
            best[name] = max(best[name], n / (time.perf_counter() - t))
    s = engines["ngram"].scheduler.speculation.stats
    print(
        f"\n{shape}: {users} concurrent open chats, {args.threads} threads; "
        f"{bench_files.load_note()}"
    )
    print(
        f"  aggregate tok/s: {best['plain']:.1f} without, {best['ngram']:.1f} with prompt "
        f"lookup ({best['ngram'] / best['plain']:.2f}x); {s.accepted} of {s.proposed} "
        "proposed tokens accepted"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", help="bench_files.SHAPE_NAMES (repeatable)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--artifact-dir", type=lambda p: __import__("pathlib").Path(p))
    ap.add_argument("--k", type=int, default=5, help="--num-speculative-tokens")
    ap.add_argument("--no-llamacpp", action="store_true", help="tallow alone")
    ap.add_argument(
        "--draft-for", metavar="SHAPE", help="only the draft-model costs, for SHAPE (smollm2-1.7b)"
    )
    ap.add_argument("--concurrent", action="store_true", help="16 open chats at once, too")
    args = ap.parse_args()
    if args.draft_for:
        draft_costs(args.draft_for, args)
        return
    for shape in bench_files.expand(args.shape or [bench_files.SMOLLM2]):
        run_shape(shape, args)
        if args.concurrent:
            concurrent_chat(shape, args)


if __name__ == "__main__":
    main()
