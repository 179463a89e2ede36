"""`tallow generate`: stream generated text to stdout, statistics to stderr."""

from __future__ import annotations

import sys
import time

from .detokenizer import IncrementalDetokenizer
from .errors import TallowError
from .generate import GenerationStats, generate_tokens
from .model_runner import KVCacheConfig, TVMModelRunner
from .sampling_params import SamplingParams, SamplingParamsError


def encode_prompt(runner: TVMModelRunner, prompt: str, chat: bool, system: str | None) -> list[int]:
    tok = runner.tokenizer
    if not chat:
        return tok.tokenizer.encode(prompt, add_special_tokens=True).ids
    if tok.chat_template is None:
        raise TallowError("--chat: this artifact's model has no chat template")
    from .chat_template import ChatTemplate

    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    text = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token).render(
        messages, add_generation_prompt=True
    )
    # The template writes BOS itself where the model wants it, as transformers assumes.
    return tok.tokenizer.encode(text, add_special_tokens=False).ids


def run_generate(args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    try:
        params.validate()
    except SamplingParamsError as e:
        raise TallowError(str(e)) from e
    t_load = time.perf_counter()
    runner = TVMModelRunner(
        args.artifact,
        device=args.device,
        kv=KVCacheConfig(max_batch_size=1, max_total_tokens=0),
        threads=args.threads,
    )
    load_seconds = time.perf_counter() - t_load
    prompt_ids = encode_prompt(runner, prompt, args.chat, args.system)
    detok = IncrementalDetokenizer(runner.tokenizer.tokenizer, prompt_ids)
    stats = GenerationStats()
    try:
        for token in generate_tokens(runner, prompt_ids, params, stats):
            sys.stdout.write(detok.push(token))
            sys.stdout.flush()
    except ValueError as e:
        raise TallowError(str(e)) from e
    sys.stdout.write(detok.flush() + "\n")
    sys.stdout.flush()
    print(
        f"load {load_seconds:.2f}s | prompt {stats.prompt_tokens} tokens, "
        f"{stats.prefill_tok_s:.1f} tok/s | generated {stats.generated_tokens} tokens, "
        f"{stats.decode_tok_s:.1f} tok/s | finish: {stats.finish_reason}",
        file=sys.stderr,
    )
    return 0
