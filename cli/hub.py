"""`tallow push`, and `hf://org/repo[@revision]` wherever a command takes an artifact folder.

Pulling lives in `runtime/hub_pull.py` (the server needs it); this module wires it into the
commands' arguments, and publishes an artifact with huggingface_hub.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tallow.runtime.errors import ArtifactError, TallowError
from tallow.runtime.hub_pull import (
    HubRef,
    everything,
    files_for_device,
    is_hub_ref,
    parse_hub_ref,
    pull,
    pull_manifest,
)
from tallow.runtime.manifest import MANIFEST_NAME, Manifest

from .model_card import render_model_card

CARD_NAME = "README.md"


def artifact_arg(value: str) -> Path | HubRef:
    """argparse type: a folder, or a hub reference (checked here, so a typo fails at once)."""
    if is_hub_ref(value):
        try:
            return parse_hub_ref(value)
        except ArtifactError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return Path(value)


def artifact_folder(spec: Path | HubRef, device: str | None = None) -> Path:
    """The local folder to load: `spec` itself, or the pulled snapshot of a hub artifact
    holding what a load on `device` reads."""
    if isinstance(spec, HubRef):
        return pull(spec, files_for_device(device))
    return spec


def whole_artifact_folder(spec: Path | HubRef) -> Path:
    """Every file of the artifact, not yet checked (`verify` hashes and reports each one)."""
    return pull(spec, everything, check=False) if isinstance(spec, HubRef) else spec


def manifest_folder(spec: Path | HubRef) -> Path:
    """A folder holding the manifest (for `inspect`): a hub artifact's manifest only."""
    return pull_manifest(spec) if isinstance(spec, HubRef) else spec


def served_name(spec: Path | HubRef, folder: Path) -> str:
    """The model's default name in the API: the folder's, or the hub repository's."""
    return spec.name if isinstance(spec, HubRef) else Path(folder).resolve().name


def add_push(sub) -> None:
    p = sub.add_parser(
        "push",
        help="upload an artifact to the Hugging Face Hub, with a generated model card",
        description=(
            "Check every file of ARTIFACT against its manifest, then upload the manifest, the "
            "files it records and a generated model card (README.md) to a model repository in "
            "one commit, creating the repository if needed. The token comes from HF_TOKEN or "
            "`hf auth login`. --dry-run prints the files and the card and uploads nothing."
        ),
    )
    p.add_argument("artifact", type=Path, help="artifact folder written by `tallow compile`")
    p.add_argument("repo", type=artifact_arg, help="hf://org/repo (or hf://org/repo@branch)")
    p.add_argument("--revision", help="branch to commit to (created if missing; default main)")
    p.add_argument("--private", action="store_true", help="create the repository as private")
    p.add_argument("--commit-message", help="default: 'Upload tallow artifact <folder name>'")
    p.add_argument("--dry-run", action="store_true", help="list the files and print the card")


def upload_plan(folder: Path, manifest: Manifest) -> dict[str, int]:
    """The files a push uploads (but the card), with their sizes: the manifest and every file
    it records. Refuses an artifact whose files do not match their checksums."""
    from tallow.runtime.integrity import verify

    if manifest.checksums is None:
        raise ArtifactError(
            f"{folder}: no checksums recorded (compiled by an older tallow); recompile it "
            "before pushing, so that a pull can check what it downloads"
        )
    bad = [f"{name} ({problem})" for name, problem in verify(folder, manifest.checksums) if problem]
    if bad:
        raise ArtifactError(f"{folder}: not pushed, damaged or missing: {', '.join(bad)}")
    names = [MANIFEST_NAME, *manifest.checksums]
    return {name: (folder / name).stat().st_size for name in sorted(names)}


def publishing_warnings(manifest: Manifest) -> list[str]:
    """What makes an artifact a poor one to publish (docs/ci.md): a `--cpu native` library
    runs only on CPUs with every feature of the compiling machine's."""
    out = []
    for lib in manifest.libraries:
        if lib.device == "cpu" and lib.cpu_level == "native":
            needs = ", ".join(lib.cpu_features) or "its features"
            out.append(
                f"{lib.file} was compiled with --cpu native ({lib.target}): a CPU without "
                f"{needs} refuses it; for a published artifact compile a named level "
                "(--cpu x86-64-v3, x86-64-v2, ...; docs/ci.md)"
            )
    return out


def run_push(args) -> int:
    folder: Path = args.artifact
    ref: HubRef = args.repo
    if not isinstance(ref, HubRef):
        raise TallowError(f"push: the destination must be hf://org/repo, not {ref}")
    if ref.revision and args.revision and ref.revision != args.revision:
        raise TallowError(f"push: {ref} and --revision {args.revision} name different branches")
    revision = args.revision or ref.revision
    manifest = Manifest.read(folder)
    files = upload_plan(folder, manifest)
    card = render_model_card(manifest, ref.repo_id, files)
    skipped = sorted(
        str(p.relative_to(folder))
        for p in folder.rglob("*")
        if p.is_file() and str(p.relative_to(folder)) not in files
    )
    target = f"hf://{ref.repo_id} (revision {revision or 'main'}"
    target += ", private)" if args.private else ")"
    total = sum(files.values()) + len(card.encode())
    verb = "would upload" if args.dry_run else "uploading"
    print(f"{verb} {len(files) + 1} files, {total / 2**20:.1f} MiB, to {target}:", file=sys.stderr)
    for name, size in files.items():
        print(f"{size:>14,}  {name}")
    print(f"{len(card.encode()):>14,}  {CARD_NAME} (generated model card)")
    for name in skipped:
        print(f"not uploaded (the manifest does not record it): {name}", file=sys.stderr)
    for warning in publishing_warnings(manifest):
        print(f"warning: {warning}", file=sys.stderr)
    if args.dry_run:
        print(f"--- {CARD_NAME} ---")
        print(card)
        return 0
    url = _upload(folder, ref.repo_id, files, card, revision, args)
    print(f"pushed: {url}", file=sys.stderr)
    print(f"pull it with: tallow serve hf://{ref.repo_id}" + (f"@{revision}" if revision else ""))
    return 0


def _upload(folder: Path, repo_id: str, files: dict[str, int], card: str, revision, args) -> str:
    """One commit holding exactly `files` and the card (create_commit, which upload_folder
    wraps: the card is generated, not a file of the artifact folder)."""
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi()
    ops = [CommitOperationAdd(path_in_repo=n, path_or_fileobj=str(folder / n)) for n in files]
    ops.append(CommitOperationAdd(path_in_repo=CARD_NAME, path_or_fileobj=card.encode()))
    message = args.commit_message or f"Upload tallow artifact {folder.resolve().name}"
    try:
        api.create_repo(repo_id, private=args.private, exist_ok=True, repo_type="model")
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.create_commit(repo_id, operations=ops, commit_message=message, revision=revision)
    except HfHubHTTPError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TallowError(f"push to hf://{repo_id} failed: {first}") from e
    return info.commit_url
