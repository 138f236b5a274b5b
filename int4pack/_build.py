"""Builds the C++ kernels (``int4pack/csrc``) into one plain shared library, ``_kernels-<machine>.so``.

setup.py runs this at ``pip install`` time (sdist or editable install): the sources include no
torch or Python headers, so nothing but a C++17 compiler is needed, torch is not, and one build
serves every torch and Python. Standalone (no int4pack or torch import): setup.py loads this file
by path. A developer who edits the sources rebuilds in place with ``python -m int4pack._build``.

The library records the hash of the sources it was built from; ``_native.py`` compares it with
the sources beside it, so a stale build is refused instead of run.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"
# -O3; no contraction of a * b + c into FMA (GCC's ISO default, not clang's), which would change float
# results against the torch twins; no -march: the AVX2 loops are picked at run time
CXXFLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-fPIC", "-DNDEBUG", "-fvisibility=hidden", "-pthread", "-Wno-psabi"]
LDFLAGS = ["-shared", "-pthread"]
INSTALL_HINT = "install a C++ compiler (Debian/Ubuntu: apt-get install g++; Fedora: dnf install gcc-c++; macOS: xcode-select --install)"


def machine() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def library_name(target: str | None = None) -> str:
    return f"_kernels-{target or machine()}.so"


def sources() -> list[Path]:
    return sorted(p for p in CSRC.rglob("*") if p.suffix in (".cpp", ".h"))


def source_hash(root: Path = CSRC) -> str:
    """sha256 (16 hex digits) of every source's path and text, and the flags."""
    h = hashlib.sha256()
    for p in sorted(q for q in root.rglob("*") if q.suffix in (".cpp", ".h")):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(" ".join(CXXFLAGS).encode())
    return h.hexdigest()[:16]


def find_compiler() -> list[str] | None:
    """The C++ compiler command: $CXX, else the first of c++, g++, clang++ on PATH."""
    env = os.environ.get("CXX", "").strip()
    if env:
        cmd = shlex.split(env)
        return cmd if shutil.which(cmd[0]) else None
    for name in ("c++", "g++", "clang++"):
        if shutil.which(name):
            return [name]
    return None


def build(out: Path, *, jobs: int | None = None, log=print) -> Path:
    """Compile every ``csrc/**/*.cpp`` (in parallel) and link ``out``. Raises RuntimeError with the
    compiler's message when something fails, or when there is no compiler."""
    cxx = find_compiler()
    if cxx is None:
        raise RuntimeError(f"no C++ compiler found (looked for $CXX, c++, g++, clang++): {INSTALL_HINT}")
    cpps = [p for p in sources() if p.suffix == ".cpp"]
    tag = source_hash()
    flags = [*CXXFLAGS, f'-DI4P_SOURCE_HASH="{tag}"']
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="int4pack-build-") as tmp:
        def compile_one(src: Path) -> Path:
            obj = Path(tmp) / (src.relative_to(CSRC).as_posix().replace("/", "__") + ".o")
            cmd = [*cxx, *flags, "-c", str(src), "-o", str(obj)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr.strip()[-4000:]}")
            return obj

        workers = jobs or min(len(cpps), os.cpu_count() or 1)
        # the largest sources first: they set the wall time
        order = sorted(cpps, key=lambda p: -p.stat().st_size)
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            objs = list(pool.map(compile_one, order))
        partial = out.with_name(out.name + f".{os.getpid()}.tmp")
        cmd = [*cxx, *LDFLAGS, *map(str, objs), "-o", str(partial)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            partial.unlink(missing_ok=True)
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr.strip()[-4000:]}")
        os.replace(partial, out)  # a running process keeps the old file's inode
    log(f"int4pack: built the C++ kernels {out} ({' '.join(cxx)}, {len(cpps)} sources, hash {tag})")
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m int4pack._build [--machine M]``. --machine names the library for another machine,
    built by the cross compiler in $CXX; for aarch64 on an x86-64 host, PyPI's ziglang:
    ``CXX="python -m ziglang c++ -target aarch64-linux-gnu.2.17" python -m int4pack._build --machine aarch64``
    (glibc 2.17 and up; libc++ linked in statically)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m int4pack._build", description="Build int4pack's C++ kernels in place.")
    ap.add_argument("--machine", help="the machine the library is for, as platform.machine() names it "
                                      "(default: this one's); set $CXX to a compiler for it")
    args = ap.parse_args(argv)
    try:
        build(HERE / library_name(args.machine))
    except RuntimeError as e:
        print(f"int4pack: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
