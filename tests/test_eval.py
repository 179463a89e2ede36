"""`tallow eval`: perplexity in llama-perplexity's windows against transformers' logits, KL
divergence and top-1 agreement against a numpy computation over the runtime's logits, and the
command's output and errors."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from tallow.cli.main import main
from tallow.compiler.pipeline import CompileOptions, compile_model
from tallow.runtime.evaluate import EvalError, check_same_vocabulary, evaluate, text_tokens
from tallow.runtime.model_runner import KVCacheConfig, TVMModelRunner, all_position_logits

from tiny_models import load_hf

CONTEXT = 64
FIRST = CONTEXT // 2  # llama-perplexity scores each window's second half
# About 5 windows of 64 tokens for the tiny byte-level tokenizer.
TEXT = (Path(__file__).parent / "data" / "prose.txt").read_text()[:420]


@pytest.fixture(scope="module")
def f32(tiny_artifact):
    return tiny_artifact("qwen3", "f32")


@pytest.fixture(scope="module")
def q4_0(tiny_model_dir, tmp_path_factory):
    options = CompileOptions(
        model=str(tiny_model_dir("qwen3")),
        quant="q4_0",
        output=tmp_path_factory.mktemp("eval-q4_0"),
        quiet=True,
    )
    return compile_model(options)


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "prose.txt"
    path.write_text(TEXT)
    return path


def runner_for(artifact) -> TVMModelRunner:
    return TVMModelRunner(artifact, kv=KVCacheConfig(1, 256, 64))


def oracle_windows(model_dir) -> list[list[int]]:
    """The windows, from the source model's own tokenizer (the tiny one adds no BOS)."""
    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(TEXT).ids
    count = len(ids) // CONTEXT
    assert count >= 4
    return [ids[i * CONTEXT : (i + 1) * CONTEXT] for i in range(count)]


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@pytest.mark.slow
def test_perplexity_matches_transformers(tiny_model_dir, f32):
    model_dir = tiny_model_dir("qwen3")
    hf = load_hf(model_dir)
    nll = []
    for window in oracle_windows(model_dir):
        with torch.no_grad():
            logits = hf(torch.tensor([window])).logits[0].numpy()
        logprobs = log_softmax64(logits)[FIRST:-1]
        nll.extend(-logprobs[np.arange(len(logprobs)), window[FIRST + 1 :]])
    want = float(np.exp(np.mean(nll)))

    runner = runner_for(f32)
    got = evaluate(runner, text_tokens(runner, TEXT), CONTEXT)
    assert got.tokens_scored == len(nll) and got.windows == len(nll) // (CONTEXT - FIRST - 1)
    assert got.perplexity == pytest.approx(want, rel=1e-4)
    assert got.kl_mean is None and got.delta_perplexity is None


@pytest.mark.slow
def test_against_itself_kl_is_zero(f32):
    runner = runner_for(f32)
    got = evaluate(runner, text_tokens(runner, TEXT), CONTEXT, reference=runner_for(f32))
    assert got.kl_mean == 0.0 and got.kl_max == 0.0 and got.kl_p99 == 0.0
    assert got.top1_agreement == 1.0
    assert got.reference_perplexity == got.perplexity and got.delta_perplexity == 0.0


@pytest.mark.slow
def test_kl_against_quantized_matches_numpy(tiny_model_dir, f32, q4_0):
    quant, ref = runner_for(q4_0), runner_for(f32)
    got = evaluate(quant, text_tokens(quant, TEXT), CONTEXT, reference=ref)

    kl, agree, nll, ref_nll = [], [], [], []
    for window in oracle_windows(tiny_model_dir("qwen3")):
        # every position's logits (eval itself computes only the scored half's)
        p = log_softmax64(all_position_logits(ref, window))[FIRST:-1]
        q = log_softmax64(all_position_logits(quant, window))[FIRST:-1]
        targets = np.asarray(window[FIRST + 1 :])
        rows = np.arange(len(targets))
        kl.extend((np.exp(p) * (p - q)).sum(axis=1))
        agree.extend(p.argmax(axis=1) == q.argmax(axis=1))
        nll.extend(-q[rows, targets])
        ref_nll.extend(-p[rows, targets])
    kl = np.asarray(kl)

    assert kl.mean() > 1e-3 and np.mean(agree) < 1.0  # q4_0 moves the distributions
    assert got.kl_mean == pytest.approx(kl.mean(), rel=1e-5)
    assert got.kl_p99 == pytest.approx(np.percentile(kl, 99), rel=1e-5)
    assert got.kl_max == pytest.approx(kl.max(), rel=1e-5)
    assert got.top1_agreement == pytest.approx(np.mean(agree))
    assert got.perplexity == pytest.approx(np.exp(np.mean(nll)), rel=1e-6)
    assert got.reference_perplexity == pytest.approx(np.exp(np.mean(ref_nll)), rel=1e-6)
    assert got.delta_perplexity == pytest.approx(got.perplexity - got.reference_perplexity)


@pytest.mark.slow
def test_cli_summary_and_json(capsys, f32, q4_0, text_file):
    argv = ["eval", str(q4_0), "--text", str(text_file), "--context", str(CONTEXT)]
    assert main([*argv, "--reference", str(f32)]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1, out
    line = re.fullmatch(
        r"perplexity (\S+) over (\d+) tokens \((\d+) windows of 64\) \| reference (\S+) "
        r"\(delta (\S+)\) \| KL mean (\S+), p99 (\S+) \| top-1 agreement (\S+)%\n",
        out,
    )
    assert line, out
    assert re.search(r"\d+/\d+ windows", err)  # the progress line

    assert main([*argv, "--reference", str(f32), "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["perplexity"] == pytest.approx(float(line[1]), rel=1e-4)
    assert figures["tokens_scored"] == int(line[2]) and figures["windows"] == int(line[3])
    assert figures["kl_mean"] == pytest.approx(float(line[6]), abs=1e-6)
    assert figures["top1_agreement"] == pytest.approx(float(line[8]) / 100, abs=1e-4)
    assert figures["reference"] == str(f32) and figures["context"] == CONTEXT

    # without a reference: perplexity only
    assert main([*argv, "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert alone["perplexity"] == figures["perplexity"] and alone["kl_mean"] is None
    assert figures["same_weights"] is False and "same weights" not in err


@pytest.mark.slow
def test_cli_says_when_the_reference_has_the_same_weights(capsys, f32, text_file, tmp_path):
    """A copy of the artifact as its own reference: KL 0, and a note saying why (issue 35)."""
    import shutil

    copy = shutil.copytree(f32, tmp_path / "copy")
    argv = ["eval", str(f32), "--text", str(text_file), "--context", str(CONTEXT)]
    assert main([*argv, "--reference", str(copy), "--json"]) == 0
    out, err = capsys.readouterr()
    figures = json.loads(out)
    assert figures["kl_mean"] == 0.0 and figures["same_weights"] is True
    assert f"note: {copy} has the very same weights as {f32}" in err


@pytest.mark.slow
def test_cli_bad_input(capsys, f32, tmp_path):
    def error(*args: str) -> str:
        assert main(["eval", str(f32), *args]) == 2
        return capsys.readouterr().err

    missing = tmp_path / "nope.txt"
    assert f"--text {missing}: no such file" in error("--text", str(missing))
    short = tmp_path / "short.txt"
    short.write_text("The river turns twice.")
    err = error("--text", str(short), "--context", "64")
    assert "needs at least 128" in err and "tokens" in err
    long = tmp_path / "long.txt"
    long.write_text(TEXT * 4)
    assert "longer than" in error("--text", str(long), "--context", "1024")
    assert "at least 4 tokens" in error("--text", str(long), "--context", "2")


def fake_runner(tokenizer: Tokenizer, vocab_size: int = 320) -> SimpleNamespace:
    bundle = SimpleNamespace(tokenizer=tokenizer, add_bos_token=False, bos_token_id=1)
    return SimpleNamespace(folder=Path("a"), tokenizer=bundle, vocab_size=vocab_size)


def test_reference_with_another_vocabulary_is_refused(tmp_path):
    from tiny_models import make_tokenizer

    make_tokenizer(tmp_path, 320)
    ours = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    spec = json.loads(ours.to_str())
    vocab = spec["model"]["vocab"]
    by_id = {i: token for token, i in vocab.items()}
    a, b = by_id[100], by_id[101]
    vocab[a], vocab[b] = 101, 100  # the same tokens under each other's ids
    theirs = Tokenizer.from_str(json.dumps(spec))

    check_same_vocabulary(fake_runner(ours), fake_runner(ours))  # the same: accepted
    with pytest.raises(EvalError, match="another tokenizer.*2 tokens differ"):
        check_same_vocabulary(fake_runner(ours), fake_runner(theirs))
    with pytest.raises(EvalError, match="vocabulary of 640 tokens"):
        check_same_vocabulary(fake_runner(ours), fake_runner(ours, vocab_size=640))
