"""A model's sampling defaults (issue 35, item 1): read from generation_config.json or a GGUF's
general.sampling keys at compile time, recorded in the manifest, and applied by the server
(chat, completions, Responses) and `tallow generate` to every field a request leaves unset;
a request's own value and `tallow serve`'s flags win.

The server checks use the fake runner with an oracle computed here (numpy over its
`reference_logits`), as tests/test_sampling_wiring.py does: a default is seen by its effect.
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import httpx
import openai
import pytest
import yaml
from server_helpers import MODEL, serve_engine  # noqa: I001
from test_sampling_wiring import PROMPT, REPEAT, RepetitiveRunner, V, _tokenizer, ids, oracle

from tallow.cli.main import main
from tallow.compiler.source import resolve_source
from tallow.compiler.tokenizer_files import sampling_defaults as source_defaults
from tallow.runtime import sampling_defaults as sd
from tallow.runtime.artifact import TokenizerBundle
from tallow.runtime.engine import Engine
from tallow.runtime.manifest import Manifest
from tallow.runtime.scheduler import SchedulerConfig
from tallow.server.app import ServerOptions

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"

# --- where the defaults come from --------------------------------------------------------------


def test_generation_config_fields_are_read_and_checked():
    got = sd.from_generation_config(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 2}
    )
    assert got.given() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert got.value("min_p") == 0.0 and got.value("repetition_penalty") == 1.0  # neutral
    assert sd.from_generation_config({"eos_token_id": 2, "do_sample": True}) is None
    with pytest.raises(sd.SamplingDefaultsError, match="top_p 1.5 is out of range"):
        sd.from_generation_config({"top_p": 1.5})
    with pytest.raises(sd.SamplingDefaultsError, match="temperature must be a number"):
        sd.from_generation_config({"temperature": "hot"})


def test_a_folder_records_its_generation_config_and_one_without_gets_the_fallback(
    tiny_model_dir, tmp_path
):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("qwen3"), folder)
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 2, "temperature": 0.7, "repetition_penalty": 1.05})
    )
    got = source_defaults(resolve_source(str(folder)))
    assert got.given() == {"temperature": 0.7, "repetition_penalty": 1.05}
    assert got.source == sd.FROM_GENERATION_CONFIG
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert source_defaults(resolve_source(str(folder))) == sd.FALLBACK
    (folder / "generation_config.json").unlink()
    assert source_defaults(resolve_source(str(folder))) == sd.FALLBACK


def test_a_gguf_records_its_general_sampling_keys(tiny_model_dir, tmp_path):
    from gguf_models import write_gguf

    def sampling(writer, _cfg):
        writer.add_float32("general.sampling.temp", 0.25)
        writer.add_int32("general.sampling.top_k", 30)

    path = write_gguf(tiny_model_dir("llama_plain"), tmp_path / "s.gguf", "llama")
    assert source_defaults(resolve_source(str(path))) == sd.FALLBACK
    path = write_gguf(
        tiny_model_dir("llama_plain"), tmp_path / "t.gguf", "llama", metadata_fn=sampling
    )
    got = source_defaults(resolve_source(str(path)))
    assert got.given() == {"temperature": 0.25, "top_k": 30} and got.source == sd.FROM_GGUF


def test_the_manifest_keeps_them_and_old_manifests_load(tiny_artifact, tmp_path):
    import shutil

    art = tmp_path / "art"
    shutil.copytree(tiny_artifact("qwen3", "f32"), art)
    manifest = Manifest.read(art)
    assert manifest.sampling_defaults == sd.FALLBACK  # the tiny folder has none
    mine = sd.SamplingDefaults(temperature=0.3, min_p=0.1, source="generation_config.json")
    dataclasses.replace(manifest, sampling_defaults=mine).write(art)
    assert Manifest.read(art).sampling_defaults == mine
    raw = yaml.safe_load((art / "manifest.yaml").read_text())
    del raw["sampling_defaults"]  # a manifest from before the field
    (art / "manifest.yaml").write_text(yaml.safe_dump(raw))
    assert Manifest.read(art).sampling_defaults == sd.FALLBACK
    raw["sampling_defaults"] = {"temperature": 700}
    (art / "manifest.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(Exception, match="temperature 700 is out of range"):
        Manifest.read(art)


# --- the server applies them ------------------------------------------------------------------


def _server(defaults_in_manifest, options: ServerOptions):
    tok = _tokenizer()
    runner = RepetitiveRunner(vocab_size=V, context_window=1024, num_pages=512)
    runner.tokenizer = TokenizerBundle(
        tokenizer=tok,
        bos_token_id=None,
        eos_token_ids=[],
        add_bos_token=False,
        chat_template=TEMPLATE,
        bos_token=None,
        eos_token=None,
    )
    # What ServedModel reads of a TVM runner's manifest.
    runner.manifest = SimpleNamespace(
        model=SimpleNamespace(name="fake"), sampling_defaults=defaults_in_manifest
    )
    engine = Engine(
        runner,
        tokenizer=tok,
        eos_token_ids=(),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512),
    )
    server = serve_engine(engine, options)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    return server, runner, client


def _penalized(runner, prompt, n, penalty):
    import numpy as np

    def edit(logits, p, out):
        seen = np.bincount(np.asarray(p + out, dtype=np.int64), minlength=V) > 0
        pen = np.float32(penalty)
        logits[:] = np.where(seen, np.where(logits > 0, logits / pen, logits * pen), logits)

    return oracle(runner, prompt, n, edit)


@pytest.fixture(scope="module")
def model_defaults():
    """A model whose generation_config says greedy with a repetition penalty of 2.5."""
    defaults = sd.SamplingDefaults(temperature=0.0, repetition_penalty=2.5, source="test")
    server, runner, client = _server(defaults, ServerOptions())
    yield server, runner, client
    server.stop()


def test_unset_fields_take_the_models_defaults_on_every_route(model_defaults):
    server, runner, client = model_defaults
    n = 8
    plain = oracle(runner, PROMPT, n)
    assert plain == [REPEAT] * n
    expected = _penalized(runner, PROMPT, n, 2.5)
    assert expected != plain  # the default changes the output, so ignoring it fails below
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=n)
    assert ids(got.choices[0].text) == expected
    chat_prompt = [5, 6, 7]
    messages = [{"role": "user", "content": "w5 w6 w7"}]
    res = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n)
    assert ids(res.choices[0].message.content) == _penalized(runner, chat_prompt, n, 2.5)
    body = {"model": MODEL, "input": "w5 w6 w7", "max_output_tokens": n}
    r = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    text = r.json()["output"][-1]["content"][0]["text"]
    assert ids(text) == _penalized(runner, chat_prompt, n, 2.5)
    assert r.json()["temperature"] == 0.0  # the value used, not OpenAI's 1


def test_a_request_overrides_a_default(model_defaults):
    _server_, runner, client = model_defaults
    got = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, extra_body={"repetition_penalty": 1.0}
    )
    assert ids(got.choices[0].text) == oracle(runner, PROMPT, 8)


def test_serve_flags_and_openai_defaults_replace_the_models():
    model = sd.SamplingDefaults(temperature=0.0, repetition_penalty=2.5, source="test")
    # `--sampling-defaults openai --temperature 0`: the penalty is gone, greedy stays.
    args = SimpleNamespace(
        sampling_defaults="openai",
        temperature=0.0,
        top_p=None,
        top_k=None,
        min_p=None,
        repetition_penalty=None,
    )
    from tallow.cli.sampling_flags import sampling_defaults

    chosen = sampling_defaults(args, model)
    assert chosen.given() == {"temperature": 0.0}
    server, runner, client = _server(model, ServerOptions(sampling_defaults=chosen))
    try:
        got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8)
        assert ids(got.choices[0].text) == oracle(runner, PROMPT, 8)
    finally:
        server.stop()
    # `--repetition-penalty 2.5` over a model that sets none.
    args.sampling_defaults, args.repetition_penalty = "model", 2.5
    assert sampling_defaults(args, model).value("repetition_penalty") == 2.5


def test_bad_sampling_flags_are_one_error_line(capsys, tmp_path):
    code = main(["generate", str(tmp_path), "--prompt", "x", "--top-p", "0"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --top-p") and "out of range" in err
    code = main(["serve", str(tmp_path), "--temperature", "300"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --temperature") and "0 to 100" in err
