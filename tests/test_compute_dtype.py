"""The compute dtype without `--dtype` (each target's natural one), the names it gives
artifacts, and the KV cache layout options (`--kv-dtype`, `--page-size`) with their
refusals (issue 19). Cheap: nothing here builds a library."""

from __future__ import annotations

import shutil

import pytest

from tallow.cli.main import main
from tallow.compiler import phases
from tallow.compiler.compute_dtype import choose_compute_dtype
from tallow.compiler.kv_layout import check_page_size, choose_kv_dtype
from tallow.compiler.pipeline import CompileOptions, CompileState
from tallow.compiler.progress import Progress
from tallow.runtime.errors import TargetError


@pytest.mark.parametrize(
    ("targets", "config", "kind", "expected", "chosen_by"),
    [
        (["cpu"], {"torch_dtype": "bfloat16"}, "safetensors", "f32", "cpu"),
        (["cuda"], {"torch_dtype": "bfloat16"}, "safetensors", "bf16", "cuda"),
        (["cuda"], {"dtype": "float16"}, "safetensors", "f16", "cuda"),  # transformers 5's key
        (["cuda"], {"torch_dtype": "float32"}, "safetensors", "f16", "cuda"),
        (["cuda"], {}, "gguf", "f16", "cuda"),
        (["metal"], {"torch_dtype": "bfloat16"}, "safetensors", "f16", "metal"),
        # one weight set for all: the first natural dtype every target runs
        (["cuda", "metal"], {"torch_dtype": "bfloat16"}, "safetensors", "f16", "metal"),
        (["cuda", "cpu"], {"torch_dtype": "bfloat16"}, "safetensors", "bf16", "cuda"),
        (["cpu", "cuda"], {"torch_dtype": "bfloat16"}, "safetensors", "f32", "cpu"),
    ],
)
def test_natural_dtype(targets, config, kind, expected, chosen_by):
    choice = choose_compute_dtype(None, targets, config, kind)
    assert choice.dtype == expected
    assert choice.source.startswith(f"natural for {chosen_by} (")


def test_requested_dtype_wins():
    choice = choose_compute_dtype("f32", ["cuda"], {"torch_dtype": "bfloat16"}, "safetensors")
    assert (choice.dtype, choice.source) == ("f32", "--dtype")


@pytest.mark.parametrize(
    ("kv", "message"),
    [
        ("fp8_e4m3", "--kv-dtype fp8_e4m3: TVM 0.27's paged KV cache cannot hold it: it takes"),
        ("int8", "--kv-dtype int8: TVM 0.27's paged KV cache cannot hold it: its pages hold"),
        ("f64", "--kv-dtype 'f64' is not supported; choose from f16, bf16, f32"),
    ],
)
def test_kv_dtype_refusals(kv, message):
    with pytest.raises(TargetError) as e:
        choose_kv_dtype(kv, "f16", [])
    assert message in str(e.value) and "f16, bf16, f32" in str(e.value)


def test_kv_dtype_defaults_to_the_compute_dtype():
    assert choose_kv_dtype(None, "bf16", []) == "bf16"
    assert choose_kv_dtype("f32", "f16", []) == "f32"


@pytest.mark.parametrize("size", [8, 32, 0])
def test_page_size_refusal(size):
    with pytest.raises(TargetError, match=rf"--page-size {size} is not supported; choose from 16"):
        check_page_size(size)


def _read_config(tmp_path, model, **options) -> CompileState:
    """The first compile phase only: source, dtype, KV layout and the artifact's name."""
    state = CompileState(
        options=CompileOptions(model=str(model), output=tmp_path, quiet=True, **options),
        progress=Progress(quiet=True),
    )
    phases.read_config(state)
    shutil.rmtree(state.work_dir)  # the partial folder read_config made for the build
    return state


def test_name_and_manifest_fields_follow_the_choice(tiny_model_dir, tmp_path):
    model = tiny_model_dir("qwen2_wide")  # transformers writes the f32 it built the model in
    cpu = _read_config(tmp_path, model, quant="q4_0:all")
    assert (cpu.options.dtype, cpu.options.kv_dtype) == ("f32", "f32")
    assert cpu.final_dir.name == "qwen2_wide-q4_0-cpu"  # f32 stays unnamed, as before
    cuda = _read_config(tmp_path, model, target="cuda", quant="q4_0:all", kv_dtype="f32")
    assert (cuda.options.dtype, cuda.options.kv_dtype) == ("f16", "f32")
    assert cuda.dtype_source.startswith("natural for cuda")
    assert cuda.final_dir.name == "qwen2_wide-q4_0-f16-cuda-sm_90"
    floats = _read_config(tmp_path, model, target="cuda", dtype="bf16")
    assert floats.final_dir.name == "qwen2_wide-bf16-cuda-sm_90"
    assert floats.dtype_source == "--dtype"
    by_quant = _read_config(tmp_path, model, quant="f16")  # float weights name the dtype
    assert (by_quant.options.dtype, by_quant.dtype_source) == ("f16", "--quant")
    assert by_quant.final_dir.name == "qwen2_wide-f16-cpu"


def test_cli_refusals_name_the_value_and_leave_nothing(tiny_model_dir, tmp_path, capsys):
    model = str(tiny_model_dir("llama"))
    base = ["compile", "--model", model, "--output", str(tmp_path), "--quiet"]
    assert main([*base, "--kv-dtype", "fp8"]) != 0
    err = capsys.readouterr().err
    assert "--kv-dtype fp8" in err and "choose from f16, bf16, f32" in err
    assert main([*base, "--page-size", "32"]) != 0
    assert "--page-size 32 is not supported; choose from 16" in capsys.readouterr().err
    assert main([*base, "--target", "metal", "--kv-dtype", "bf16"]) != 0
    assert "bf16 is not supported on metal" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no artifact, no partial folder
