"""Fetch the test files llama.cpp ships, from its pinned sdist, into .venv/llama-cpp/.

Two things, neither committed (data/ has a 10 MB budget, and one is a program, not data):

- ggml-vocab-qwen35.gguf, llama.cpp's Qwen3.5 test vocabulary (5.9 MB; 1.3 MB with xz -9e), read
  by tests/text/test_qwen35_tokenizer.py; its own sha256 is checked too. The test texts and ids
  (.inp, .out) are small and are in data/llama-cpp-vocab/.
- llama.cpp's Hugging Face to GGUF converter (convert_hf_to_gguf.py, its conversion/ package and
  gguf-py/), unpacked under .venv/llama-cpp/llama.cpp/, which tests/weights/test_hybrid_gguf.py
  runs on the tiny Qwen3.5 checkpoint so that minillm's qwen35 loader (appendix A5) is checked
  against what llama.cpp really writes.
- llama.cpp's corpus of real chat templates (models/templates/*.jinja: 70 models' templates, Qwen2.5,
  Qwen3, QwQ, Qwen3-Coder and Qwen3.5 among them), under .venv/llama-cpp/llama.cpp/models/templates/,
  which tests/text/test_template_corpus.py renders with minillm's sandbox and with transformers.

`make test` runs this script (through the Makefile's .venv/.dev target). It downloads the same pinned
source distribution the files in data/llama-cpp-vocab/ come from (llama-cpp-python 0.3.36, which
vendors llama.cpp at 0c1e57098) and checks its sha256 before extracting anything. The tests fail,
naming this script, if what they need is absent.

Run again, it does nothing once everything is there. Standard library and pip only:

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
LLAMA_CPP_DIR = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
CONVERTER = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/templates/")  # under LLAMA_CPP_DIR: the
# converter and its package, and the chat templates
CONVERTER_STAMP = "llama.cpp/.sdist-sha256"  # written last: the converter is complete, from this sdist
TEMPLATES = "llama.cpp/models/templates"  # extracted with the converter (a copy from before them lacks it)
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
    """Every file is in `dest` with its pinned hash, and the converter was unpacked from the pinned sdist."""
    stamp = dest / CONVERTER_STAMP
    converter = stamp.is_file() and stamp.read_text().strip() == SDIST_SHA256 and (dest / TEMPLATES).is_dir()
    return converter and all((dest / name).is_file() and sha256(dest / name) == digest for name, digest in FILES.items())


def download_sdist(folder: Path) -> Path:
    """pip downloads the pinned source distribution (no dependencies, no wheel) into `folder`."""
    subprocess.run([sys.executable, "-m", "pip", "download", SDIST_PIP, "--no-deps", "--no-binary", ":all:",
                    "--disable-pip-version-check", "--quiet", "-d", str(folder)], check=True)
    sdist = folder / SDIST_NAME
    if not sdist.is_file():
        raise SystemExit(f"pip download {SDIST_PIP} did not give {SDIST_NAME} (got {sorted(p.name for p in folder.iterdir())})")
    return sdist


def checked(sdist: Path) -> Path:
    """`sdist` once its sha256 is the pinned one (SystemExit otherwise: nothing is read from it)."""
    got = sha256(sdist)
    if got != SDIST_SHA256:
        raise SystemExit(f"{sdist}: sha256 {got}, expected {SDIST_SHA256}; not extracted")
    return sdist


def pinned_sdist(given: Path | None, folder: Path) -> Path:
    """The pinned sdist, its hash checked: `given` (a copy at hand), or else downloaded by pip into `folder`.
    tools/build_llama_cpp.py gets its llama.cpp source through this too."""
    return checked(given if given is not None else download_sdist(folder))


def extract(sdist: Path, dest: Path) -> None:
    """Check the sdist's hash, then copy the FILES out of it into `dest`, each checked by its own hash."""
    checked(sdist)
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
        extract_converter(tar, sdist, dest / "llama.cpp")


def extract_converter(tar: tarfile.TarFile, sdist: Path, folder: Path) -> None:
    """The converter's regular files (the sdist's hash vouches for them), no links, nothing outside `folder`."""
    members = [m for m in tar.getmembers() if m.name.startswith(LLAMA_CPP_DIR)
               and m.name[len(LLAMA_CPP_DIR):].startswith(CONVERTER) and m.isfile()]
    if not any(m.name == LLAMA_CPP_DIR + CONVERTER[0] for m in members):
        raise SystemExit(f"{sdist}: no {LLAMA_CPP_DIR + CONVERTER[0]}")
    for member in members:
        target = (folder / member.name[len(LLAMA_CPP_DIR):]).resolve()
        if not target.is_relative_to(folder.resolve()):
            raise SystemExit(f"{sdist}: {member.name} points outside {folder}")
        target.parent.mkdir(parents=True, exist_ok=True)
        with tar.extractfile(member) as src:  # type: ignore[union-attr]
            target.write_bytes(src.read())
    (folder / ".sdist-sha256").write_text(SDIST_SHA256 + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdist", type=Path, help=f"use this copy of {SDIST_NAME} instead of downloading it")
    parser.add_argument("--dest", type=Path, default=DEST, help=f"where the files go (default {DEST})")
    args = parser.parse_args()
    if present(args.dest):
        print(f"llama.cpp's test files: already in {args.dest}")
        return
    with tempfile.TemporaryDirectory() as tmp:  # a downloaded sdist (77 MB) is not kept
        extract(pinned_sdist(args.sdist, Path(tmp)), args.dest)
    print(f"llama.cpp's test files: {', '.join(FILES)}, the converter and the chat templates in {args.dest}")


if __name__ == "__main__":
    main()
