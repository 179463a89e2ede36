"""`tallow generate`: stream generated text to stdout, statistics to stderr.

The prompt is encoded by the model's `ServedModel` bundle, the same code the server's chat
and completions routes use, so a conversation gets the same token ids here and over HTTP.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tallow.cli.sampling_flags import sampling_defaults
from tallow.cli.speculative_flags import speculative_config
from tallow.runtime.detokenizer import IncrementalDetokenizer
from tallow.runtime.errors import TallowError
from tallow.runtime.generate import GenerationStats, generate_tokens
from tallow.runtime.manifest import Manifest
from tallow.runtime.model_runner import KVCacheConfig
from tallow.runtime.sampling_params import SamplingParams, SamplingParamsError
from tallow.runtime.served_model import ChatTemplateError, NoChatTemplateError, ServedModel
from tallow.runtime.tp_runner import runner_class


def chat_messages(prompt: str, system: str | None) -> list[dict[str, str]]:
    """The conversation `--chat` sends: an optional system message, then the prompt."""
    head = [{"role": "system", "content": system}] if system else []
    return [*head, {"role": "user", "content": prompt}]


def encode_prompt(model: ServedModel, prompt: str, chat: bool, system: str | None) -> list[int]:
    """Prompt ids: the plain text with BOS, or (`chat`) the rendered chat template."""
    if not chat:
        return model.encode_text(prompt)
    try:
        return model.encode_chat(chat_messages(prompt, system))
    except NoChatTemplateError:
        raise TallowError("--chat: this artifact's model has no chat template") from None
    except ChatTemplateError as e:
        raise TallowError(f"--chat: the chat template rejected the messages: {e}") from e


def sampling_params(args, model: ServedModel) -> SamplingParams:
    """The flags given, and the model's defaults (or OpenAI's) for the rest."""
    defaults = sampling_defaults(args, model.sampling_defaults)
    top_k = defaults.value("top_k")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=defaults.value("temperature"),
        top_p=defaults.value("top_p"),
        top_k=0 if top_k >= model.vocab_size else top_k,
        min_p=defaults.value("min_p"),
        repetition_penalty=defaults.value("repetition_penalty"),
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    try:
        params.validate()
    except SamplingParamsError as e:
        raise TallowError(str(e)) from e
    return params


def run_generate(args) -> int:
    try:  # what can be checked before the (slow) load; the sampling flags are checked
        SamplingParams(max_tokens=args.max_tokens).validate()
    except SamplingParamsError as e:
        raise TallowError(str(e)) from e
    speculative = speculative_config(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if speculative is not None:
        return _generate_speculative(args, prompt, speculative)
    t_load = time.perf_counter()
    runner = runner_class(Manifest.read(Path(args.artifact)))(
        args.artifact,
        device=args.device,
        kv=KVCacheConfig(max_batch_size=1, max_total_tokens=0),
        threads=args.threads,
    )
    load_seconds = time.perf_counter() - t_load
    if not runner.supports_generation:
        raise TallowError(
            f"{args.artifact} was compiled with --task embed: it serves embeddings only "
            "(tallow serve, POST /v1/embeddings)"
        )
    model = ServedModel.from_runner(runner)
    params = sampling_params(args, model)
    prompt_ids = encode_prompt(model, prompt, args.chat, args.system)
    detok = IncrementalDetokenizer(model.tokenizer, prompt_ids)
    stats = GenerationStats()
    try:
        for token in generate_tokens(runner, prompt_ids, params, stats):
            sys.stdout.write(detok.push(token))
            sys.stdout.flush()
    except ValueError as e:
        raise TallowError(str(e)) from e
    sys.stdout.write(detok.flush() + "\n")
    sys.stdout.flush()
    library = getattr(runner, "library", None)  # the fake runner of the tests has none
    loaded = f" ({library.file})" if library is not None else ""
    print(
        f"load {load_seconds:.2f}s{loaded} | prompt {stats.prompt_tokens} tokens, "
        f"{stats.prefill_tok_s:.1f} tok/s | generated {stats.generated_tokens} tokens, "
        f"{stats.decode_tok_s:.1f} tok/s | finish: {stats.finish_reason}",
        file=sys.stderr,
    )
    return 0


def _generate_speculative(args, prompt: str, speculative) -> int:
    """`--speculative`: the request runs through the serving engine, which verifies
    proposals (`runtime/speculative.py`); the summary adds the acceptance rate."""
    from tallow.runtime.engine_factory import EngineOptions, build_engine
    from tallow.runtime.generate import generate_text_with_engine

    t_load = time.perf_counter()
    options = EngineOptions(
        device=args.device, max_num_seqs=1, threads=args.threads, speculative=speculative
    )
    engine = build_engine(args.artifact, options)
    load_seconds = time.perf_counter() - t_load
    if not engine.supports_generation:
        raise TallowError(f"{args.artifact} was compiled with --task embed: embeddings only")
    model = engine.model
    params = sampling_params(args, model)
    prompt_ids = encode_prompt(model, prompt, args.chat, args.system)
    stats = GenerationStats()
    try:
        for text in generate_text_with_engine(engine, prompt_ids, params, stats):
            sys.stdout.write(text)
            sys.stdout.flush()
    except ValueError as e:
        raise TallowError(str(e)) from e
    sys.stdout.write("\n")
    spec = engine.scheduler.speculation
    rate = (
        "off"
        if spec is None
        else (
            f"{spec.stats.accepted} of {spec.stats.proposed} proposed tokens accepted "
            f"({100 * spec.stats.acceptance_rate:.0f}%)"
        )
    )
    print(
        f"load {load_seconds:.2f}s | prompt {stats.prompt_tokens} tokens, "
        f"{stats.prefill_tok_s:.1f} tok/s | generated {stats.generated_tokens} tokens, "
        f"{stats.decode_tok_s:.1f} tok/s | finish: {stats.finish_reason} | speculative: {rate}",
        file=sys.stderr,
    )
    return 0
