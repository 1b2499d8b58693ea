"""Publish a checkpoint to a Hugging Face Hub model repository (optional, for organizers).

A checkpoint folder (``config.json``, ``model.safetensors``, ``optimizer.safetensors``, the two
tokenizers) is uploaded as one commit into a sub-folder named after the checkpoint, so a repo
keeps the run's history (``step-0000030/``, ``step-0000060/``, ...) and anyone can fetch one with
``huggingface_hub.snapshot_download(repo_id, allow_patterns="step-0000060/*")`` and run
``crowdtrain generate --checkpoint`` on it. Only ``*.safetensors`` and ``*.json`` files are sent:
never a pickle, whatever else lies in the folder.

Needs the network and a write token (``hf auth login``, the ``HF_TOKEN`` environment
variable, or ``token=``), so nothing calls it unless the organizer does:

    python -m crowdtrain.coordinator.hub runs/my-run/checkpoints/step-0000060 my-name/my-run

If the upload is slow, leave out the optimizer state (``--model-only``): it is about twice the
model's size and only needed to resume training, not to generate.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SAFE_PATTERNS = ["*.safetensors", "*.json"]


def push_checkpoint_to_hub(checkpoint_dir: str | Path, repo_id: str, token: str | None = None, *,
                           private: bool = False, model_only: bool = False, path_in_repo: str | None = None,
                           commit_message: str | None = None, api=None):
    """Upload one checkpoint folder to ``repo_id`` (created if missing) and return the commit info.

    ``api`` is an ``huggingface_hub.HfApi``-like object (tests pass a fake); by default
    ``HfApi(token=token)``, which falls back to the locally saved login when ``token`` is None.
    """
    folder = Path(checkpoint_dir)
    if not (folder / "model.safetensors").is_file():
        raise FileNotFoundError(f"{folder} is not a checkpoint (no model.safetensors); checkpoints are in "
                                "RUN_DIR/checkpoints/step-NNNNNNN")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise ValueError(f"repo_id must be OWNER/NAME (e.g. my-name/my-run), got {repo_id!r}")
    if api is None:
        try:
            from huggingface_hub import HfApi
        except ImportError as e:
            raise ImportError("pushing to the Hub needs huggingface_hub: pip install 'crowdtrain[data]'") from e
        api = HfApi(token=token)
    api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
    patterns = ["*.json", "model.safetensors", "*_tokenizer.safetensors"] if model_only else SAFE_PATTERNS
    return api.upload_folder(
        repo_id=repo_id, folder_path=str(folder), path_in_repo=path_in_repo or folder.name, repo_type="model",
        allow_patterns=patterns, commit_message=commit_message or f"crowdtrain checkpoint {folder.name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m crowdtrain.coordinator.hub",
                                     description="Upload a crowdtrain checkpoint folder to a Hugging Face Hub repo.")
    parser.add_argument("checkpoint_dir", help="e.g. runs/my-run/checkpoints/step-0000060")
    parser.add_argument("repo_id", help="OWNER/NAME of a model repo (created if missing)")
    parser.add_argument("--token", default=None, help="write token (default: HF_TOKEN or the saved login)")
    parser.add_argument("--private", action="store_true", help="create the repo as private")
    parser.add_argument("--model-only", action="store_true", help="leave out optimizer.safetensors")
    args = parser.parse_args(argv)
    try:
        info = push_checkpoint_to_hub(args.checkpoint_dir, args.repo_id, args.token, private=args.private,
                                      model_only=args.model_only)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(getattr(info, "commit_url", info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
