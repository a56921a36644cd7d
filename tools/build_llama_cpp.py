"""Build llama.cpp's own llama-bench and llama-server, CPU only, into .venv/llama-cpp/bin/.

The benchmark's native peers (minillm/bench/native.py): `bench decode --peers llama.cpp` runs
llama-bench beside llama-cpp-python, and `bench serve --peers llama.cpp` serves the same requests
through llama-server. Both are optional; `make llama-cpp` runs this script (5-10 minutes on 2 cores).

The source is the llama.cpp that the pinned llama-cpp-python 0.3.36 sdist vendors (0c1e57098, the
same as the Python peer's), fetched and hash-checked by tools/fetch_llama_cpp_vocab.py's
pinned_sdist, unpacked into a temporary folder and built there with cmake: only the two targets,
static libraries (the binaries stand alone), no curl, no OpenSSL, no web UI download.

Instruction sets: -DGGML_NATIVE=OFF and each of AVX, AVX2, BMI2, FMA, F16C, AVX-512 (F, CD, VL, DQ,
BW) and AVX512_VNNI switched on exactly when /proc/cpuinfo lists it: the set llama-cpp-python is
built with here (bench_peers.LLAMA_CPP_INSTALL). Never AMX: where AMX is advertised but forbidden
(a VM whose kernel does not grant the tile state), a native build crashes at its first matmul.

Run again, it does nothing while the binaries are there, built from this sdist with these flags
(bin/.build-stamp says which); --force rebuilds. Standard library, pip, cmake and a C++ compiler:

    .venv/bin/python tools/build_llama_cpp.py [--sdist llama_cpp_python-0.3.36.tar.gz] [--jobs 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

from fetch_llama_cpp_vocab import DEST, LLAMA_CPP_DIR, SDIST_NAME, SDIST_SHA256, pinned_sdist  # tools/, beside this

BIN = DEST / "bin"  # ignored by git, with the rest of .venv/; minillm/bench/native.py looks here
TARGETS = ("llama-bench", "llama-server")
STAMP = ".build-stamp"
ISA = {  # ggml's cmake option -> the /proc/cpuinfo flags it needs (all of them)
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_BMI2": ("bmi2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),  # ggml's -mavx512{f,cd,vl,dq,bw}
    "GGML_AVX512_VNNI": ("avx512_vnni",),
}
NEVER = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")  # crash where advertised but forbidden
FIXED = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=OFF", "-DGGML_CCACHE=OFF",
         "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
         "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"]


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The first CPU's flags (empty where there is no /proc/cpuinfo)."""
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    line = next((line for line in text.splitlines() if line.startswith("flags")), "flags :")
    return set(line.split(":", 1)[1].split())


def cmake_flags(flags: set[str]) -> list[str]:
    """The configure options: FIXED, each ISA option ON exactly where the CPU has all its flags, AMX OFF."""
    isa = [f"-D{option}={'ON' if set(needs) <= flags else 'OFF'}" for option, needs in ISA.items()]
    return FIXED + isa + [f"-D{option}=OFF" for option in NEVER]


def stamp_text(options: list[str]) -> str:
    return f"sdist {SDIST_NAME} sha256 {SDIST_SHA256}\n" + "\n".join(options) + "\n"


def built(bin_dir: Path, options: list[str]) -> bool:
    """Both binaries are in `bin_dir`, built from the pinned sdist with these options."""
    stamp = bin_dir / STAMP
    return (all(os.access(bin_dir / t, os.X_OK) for t in TARGETS) and stamp.is_file()
            and stamp.read_text() == stamp_text(options))


def unpack(sdist: Path, folder: Path) -> Path:
    """The vendored llama.cpp's regular files (the sdist's hash vouches for them), nothing outside `folder`."""
    root = folder.resolve()
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar:
            if not (member.isfile() and member.name.startswith(LLAMA_CPP_DIR)):
                continue
            target = (root / member.name[len(LLAMA_CPP_DIR):]).resolve()
            if not target.is_relative_to(root):
                raise SystemExit(f"{sdist}: {member.name} points outside {folder}")
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as src, target.open("wb") as out:  # type: ignore[union-attr]
                shutil.copyfileobj(src, out)
            target.chmod(0o755 if member.mode & 0o111 else 0o644)
    if not (root / "CMakeLists.txt").is_file():
        raise SystemExit(f"{sdist}: no {LLAMA_CPP_DIR}CMakeLists.txt")
    return root


def build(sdist: Path | None, bin_dir: Path, jobs: int, work: Path) -> list[str]:
    """Configure and build TARGETS in `work`, then copy them into `bin_dir` (stamp written last)."""
    options = cmake_flags(cpu_flags())
    source = unpack(pinned_sdist(sdist, work), work / "llama.cpp")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    print("cmake", *options, flush=True)
    subprocess.run(["cmake", "-S", str(source), "-B", str(work / "build"), *generator, *options], check=True)
    subprocess.run(["cmake", "--build", str(work / "build"), "--config", "Release", "-j", str(jobs),
                    "--target", *TARGETS], check=True)
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / STAMP).unlink(missing_ok=True)
    for target in TARGETS:
        found = next((p for p in (work / "build").rglob(target) if p.is_file() and os.access(p, os.X_OK)), None)
        if found is None:  # (build/bin/ has it; build/tools/<name>/ is a folder of the same name)
            raise SystemExit(f"the build made no {target} under {work / 'build'}")
        shutil.copy2(found, bin_dir / target)
    (bin_dir / STAMP).write_text(stamp_text(options))
    return options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdist", type=Path, help=f"use this copy of {SDIST_NAME} instead of downloading it")
    parser.add_argument("--bin", type=Path, default=BIN, help=f"where the binaries go (default {BIN})")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile jobs (default: the cores)")
    parser.add_argument("--force", action="store_true", help="build even if the binaries are there")
    args = parser.parse_args()
    if shutil.which("cmake") is None:
        raise SystemExit("cmake is not on PATH (apt-get install cmake, or pip install cmake)")
    if not args.force and built(args.bin, cmake_flags(cpu_flags())):
        print(f"llama.cpp's {' and '.join(TARGETS)}: already in {args.bin}")
        return
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="llama-cpp-build-") as work:  # source (174 MB) and build tree not kept
        options = build(args.sdist, args.bin, args.jobs, Path(work))
    on = [o.removeprefix("-DGGML_").removesuffix("=ON") for o in options if o.startswith("-DGGML_") and o.endswith("=ON")]
    print(f"llama.cpp's {' and '.join(TARGETS)} in {args.bin} ({', '.join(on)}), built in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
