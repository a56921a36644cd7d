# Generated from notebooks/A1_untrusted_files.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""The Hugging Face hub: a model's files from the local cache, else downloaded, checked by sha256.

Built in notebooks/A1_untrusted_files.ipynb. Only the files minillm reads are fetched (HUB_PATTERNS); the
endpoint and cache come from HF_ENDPOINT and HF_HOME, read at each call.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from minillm.weights.gguf_file import WeightsError

HUB_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "model.safetensors", "model-*.safetensors", "model.safetensors.index.json"]
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def download(repo_id: str, revision: str | None = None) -> Path:
    """The folder of a hub model: from the local cache if there, else downloaded (HF_ENDPOINT, HF_HOME)."""
    # imported on use: huggingface_hub reads HF_HOME and HF_ENDPOINT when first imported
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    # read the variables now, not when huggingface_hub was imported, so setting them later works
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    hf_home = os.environ.get("HF_HOME")
    cache_dir = os.environ.get("HF_HUB_CACHE") or (os.path.join(hf_home, "hub") if hf_home else None)
    where = dict(revision=revision, allow_patterns=HUB_PATTERNS, cache_dir=cache_dir)
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, **where))
    except LocalEntryNotFoundError:
        pass  # not cached: download
    try:
        folder = Path(snapshot_download(repo_id, endpoint=endpoint, **where))
    except (HfHubHTTPError, OSError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise WeightsError(
            f"{repo_id}: not in the local cache and not downloadable from {endpoint} ({first_line}). "
            "Check the id, set HF_ENDPOINT to a reachable mirror (and unset HF_HUB_OFFLINE), "
            "or pass a local folder or .gguf file"
        ) from None
    verify_sha256(folder)
    return folder


def sha256_file(path: str | Path) -> str:
    """The sha256 hex digest of a file, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def verify_sha256(folder: str | Path) -> None:
    """Check each weight file of a hub snapshot against the sha256 its cache blob is named after.

    A mismatch deletes the bad blob (so the next load downloads it again) and raises WeightsError.
    """
    for file in sorted(Path(folder).glob("*.safetensors")):
        blob = file.resolve()  # snapshots/<commit>/x.safetensors -> blobs/<sha256>
        if not re.fullmatch(r"[0-9a-f]{64}", blob.name):
            continue  # not a hub cache blob (e.g. a copied folder): nothing to compare with
        digest = sha256_file(blob)
        if digest != blob.name:
            blob.unlink()
            file.unlink()
            raise WeightsError(f"{file}: sha256 {digest} differs from the hub's {blob.name}; "
                               "the download is corrupt and was deleted, load again to re-download")
