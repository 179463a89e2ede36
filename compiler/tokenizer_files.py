"""The tokenizer and chat template that go into the artifact, their special tokens, and the
model's sampling defaults (from the same generation_config.json that names its EOS ids)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tallow.runtime import sampling_defaults as defaults
from tallow.runtime.manifest import TokenizerInfo
from tallow.runtime.sampling_defaults import SamplingDefaults

from .source import ModelSource

CHAT_TEMPLATE_FILE = "chat_template.jinja"


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def _chat_template(folder: Path, tok_cfg: dict[str, Any]) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    as_json = folder / "chat_template.json"
    if as_json.is_file():
        return json.loads(as_json.read_text(encoding="utf-8")).get("chat_template")
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def write(source: ModelSource, config: Any, out: Path) -> TokenizerInfo:
    if source.kind == "gguf":
        return source.write_tokenizer(out)
    from tokenizers import Tokenizer

    folder = source.folder
    shutil.copyfile(folder / "tokenizer.json", out / "tokenizer.json")
    files = ["tokenizer.json"]
    tok_cfg = _read_json(folder / "tokenizer_config.json")
    if tok_cfg:
        shutil.copyfile(folder / "tokenizer_config.json", out / "tokenizer_config.json")
        files.append("tokenizer_config.json")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bos = _token_text(tok_cfg.get("bos_token"))
    eos = _token_text(tok_cfg.get("eos_token"))
    gen_cfg = _read_json(folder / "generation_config.json")
    eos_ids = _as_list(gen_cfg.get("eos_token_id")) or list(config.eos_token_id)
    if eos is not None and tokenizer.token_to_id(eos) is not None:
        eos_ids.append(tokenizer.token_to_id(eos))
    bos_id = tokenizer.token_to_id(bos) if bos else config.bos_token_id
    template = _chat_template(folder, tok_cfg)
    if template is not None:
        (out / CHAT_TEMPLATE_FILE).write_text(template, encoding="utf-8")
    return TokenizerInfo(
        files=files,
        bos_token_id=bos_id,
        eos_token_ids=sorted(set(eos_ids)),
        add_bos_token=bool(tok_cfg.get("add_bos_token", False)),
        chat_template=CHAT_TEMPLATE_FILE if template is not None else None,
        bos_token=bos,
        eos_token=eos,
    )


def sampling_defaults(source: ModelSource) -> SamplingDefaults:
    """The source's sampling defaults: a folder's generation_config.json, a GGUF's
    general.sampling keys, else what is known of the model, else tallow's fallback
    (`runtime/sampling_defaults.py`)."""
    if source.kind == "gguf":
        found = source.sampling_defaults()
    else:
        try:
            gen_cfg = _read_json(source.folder / "generation_config.json")
        except ValueError as e:
            raise defaults.SamplingDefaultsError(
                f"{source.folder / 'generation_config.json'}: not valid JSON ({e})"
            ) from e
        found = defaults.from_generation_config(gen_cfg)
    return defaults.model_defaults(found or source.known_sampling)
