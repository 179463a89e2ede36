"""The GitHub Actions workflow users copy (docs/ci/publish-artifacts.yml): valid against the
GitHub workflow schema that check-jsonschema ships (no network), and every `tallow` command in
it parses with this tallow's own command line."""

from __future__ import annotations

import copy
import importlib.resources
import json
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
from ruamel.yaml import YAML

from tallow.cli.main import build_parser

WORKFLOW = Path(__file__).resolve().parents[1] / "docs" / "ci" / "publish-artifacts.yml"
SCHEMA = "builtin_schemas/vendor/github-workflows.json"


def load_workflow() -> dict:
    # YAML 1.2 as GitHub reads it: `on:` stays a string key (PyYAML's YAML 1.1 makes it True).
    return json.loads(json.dumps(YAML(typ="safe", pure=True).load(WORKFLOW.read_text())))


@pytest.fixture(scope="module")
def validator():
    schema = json.loads((importlib.resources.files("check_jsonschema") / SCHEMA).read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def test_the_workflow_validates_against_the_github_schema(validator):
    errors = sorted(validator.iter_errors(load_workflow()), key=str)
    assert not errors, "\n".join(e.message for e in errors)


@pytest.mark.parametrize(
    "breakage",
    [
        lambda wf: wf["jobs"]["compile"].pop("runs-on"),
        lambda wf: wf["jobs"]["compile"]["steps"][0].update({"uses": 3}),
        lambda wf: wf["jobs"]["compile"].update({"timeout-minute": 5}),
    ],
    ids=["no runs-on", "uses not a string", "misspelt key"],
)
def test_the_schema_catches_a_broken_workflow(validator, breakage):
    workflow = copy.deepcopy(load_workflow())
    breakage(workflow)
    assert list(validator.iter_errors(workflow))


def tallow_commands(workflow: dict) -> list[list[str]]:
    """Each `tallow ...` line of the run steps, continuation lines joined, with GitHub
    expressions and shell variables replaced by sample values."""
    commands = []
    for step in workflow["jobs"]["compile"]["steps"]:
        script = step.get("run", "").replace("\\\n", " ")
        for line in script.splitlines():
            line = line.strip()
            if not line.startswith("tallow ") or "--help" in line:
                continue
            line = re.sub(r"\$\{\{[^}]*\}\}", "x", line)
            line = line.replace("$DESTINATION", "hf://org/x-tallow").replace("$DRY_RUN", "")
            commands.append(shlex.split(line)[1:])
    return commands


def test_every_tallow_command_in_it_parses():
    commands = tallow_commands(load_workflow())
    used = [argv[0] for argv in commands]
    assert used == ["compile", "compile", "compile", "verify", "generate", "push"]
    parser = build_parser()
    for argv in commands:
        parser.parse_args(argv)  # exits (fails the test) on an unknown option
    compile_all = [a for argv in commands if argv[0] == "compile" for a in argv]
    assert {"cuda", "metal", "cpu", "x86-64-v3", "--add-target"} <= set(compile_all)


def test_tallow_comes_from_the_wheel_the_workflow_builds():
    """tallow is not on PyPI (issue 35): no step asks an index for it; the compile job
    installs the wheel that the `wheel` job builds with `python -m build` and uploads."""
    workflow = load_workflow()
    wheel, compile_job = workflow["jobs"]["wheel"], workflow["jobs"]["compile"]
    assert compile_job["needs"] == "wheel"
    scripts = [
        step.get("run", "").replace("\\\n", " ")
        for job in (wheel, compile_job)
        for step in job["steps"]
    ]
    for script in scripts:
        for line in script.splitlines():
            words = [w.strip("\"'") for w in line.split()]
            if "pip" in words and "install" in words:
                asked = [w for w in words[words.index("install") + 1 :] if not w.startswith("-")]
                assert not any(w.split("=")[0] == "tallow" for w in asked), line
    assert any("python -m build --wheel" in s for s in scripts)
    uploads = [s["with"] for s in wheel["steps"] if "upload-artifact" in s.get("uses", "")]
    downloads = [
        s["with"] for s in compile_job["steps"] if "download-artifact" in s.get("uses", "")
    ]
    assert [u["name"] for u in uploads] == [d["name"] for d in downloads] == ["tallow-wheel"]
    installed = next(s for s in scripts if "pip install dist/" in s)
    assert f"{downloads[0]['path']}/tallow-" in installed and uploads[0]["path"].endswith(".whl")
