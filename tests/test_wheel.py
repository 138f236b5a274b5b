"""The package as a user installs it: the sdist carries the C++ sources and their build, the wheel
built from it carries the compiled library (py3-none: one wheel for every Python), and that wheel
installed (not editable) into a fresh virtual environment converts with the C++ kernels at once.

Offline: setuptools' own build backend is called in this interpreter (no build isolation, so no
download), and the fresh environment sees this one's dependencies through a .pth file instead of
installing them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from _reference import FIXTURES

ROOT = Path(__file__).resolve().parents[1]
CSRC = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "int4pack" / "csrc").rglob("*")
              if p.suffix in (".cpp", ".h"))
_BUILD = "import sys\nfrom setuptools import build_meta as b\nprint(getattr(b, sys.argv[1])(sys.argv[2]))"


def _backend(hook: str, folder: Path, out: Path) -> Path:
    r = subprocess.run([sys.executable, "-c", _BUILD, hook, str(out)], cwd=folder, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return out / r.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(sdist, wheel): the sdist built from the repository's files, the wheel built from that sdist."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "setup.py"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "int4pack", src / "int4pack", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    sdist = _backend("build_sdist", src, tmp / "dist")
    with tarfile.open(sdist) as tf:
        tf.extractall(tmp / "unpacked", filter="data")
    (unpacked,) = (tmp / "unpacked").iterdir()
    wheel = _backend("build_wheel", unpacked, tmp / "dist")
    return sdist, wheel


def test_sdist_and_wheel_carry_every_cpp_source(built):
    sdist, wheel = built
    assert len(CSRC) >= 8 and any(p.endswith(".h") for p in CSRC)
    with tarfile.open(sdist) as tf:
        in_sdist = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    with zipfile.ZipFile(wheel) as zf:
        in_wheel = set(zf.namelist())
    assert [p for p in CSRC if p not in in_sdist] == []
    assert [p for p in CSRC if p not in in_wheel] == []
    assert {"setup.py", "int4pack/_build.py"} <= in_sdist
    assert not [n for n in in_sdist if n.endswith(".so")], "the sdist must not carry a built library"
    for p in CSRC:  # the shipped text is the repository's
        with zipfile.ZipFile(wheel) as zf:
            assert zf.read(p) == (ROOT / p).read_bytes(), p


def test_wheel_carries_the_library_for_every_python(built):
    import platform

    from int4pack import _build

    _, wheel = built
    assert wheel.name.split("-")[2:4] == ["py3", "none"], wheel.name
    with zipfile.ZipFile(wheel) as zf:
        libs = [n for n in zf.namelist() if n.endswith(".so")]
        assert libs == [f"int4pack/{_build.library_name()}"], libs
        elf = zf.read(libs[0])[:20]
    assert elf[:4] == b"\x7fELF"
    machine = int.from_bytes(elf[18:20], "little")  # e_machine: 62 x86-64, 183 AArch64
    assert machine == {"x86_64": 62, "aarch64": 183}[_build.machine()], (machine, platform.machine())


def _dependency_dirs() -> list[str]:
    """Where this environment's copies of int4pack's dependencies live."""
    import huggingface_hub
    import numpy
    import psutil
    import rich
    import safetensors
    import torch
    import typer

    mods = (huggingface_hub, numpy, psutil, rich, safetensors, torch, typer)
    return sorted({str(Path(m.__file__).resolve().parents[1]) for m in mods})


def test_installed_wheel_converts_with_the_cpp_kernels(built, tmp_path):
    _, wheel = built
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index",
                        str(wheel)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    # the dependencies come from this environment, after the venv's own site-packages (a .pth line
    # is appended to sys.path and its folder's own .pth files, e.g. an editable int4pack, are not read)
    (site / "test_deps.pth").write_text("\n".join(_dependency_dirs()) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("INT4PACK_NO_EXT", "PYTHONPATH")}
    where = subprocess.run([py, "-c", "import int4pack._ext as e; print(e.csrc_dir())"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).parent.parent == site, "the fresh venv imported int4pack from elsewhere"
    out = tmp_path / "deep" / "out"
    r = subprocess.run([venv / "bin" / "int4pack", "convert", str(FIXTURES / "gptq_q3_asym"), str(out), "--json"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["kernels"] == "c++", report["kernels"]
    assert "SlowPathWarning" not in r.stderr
    assert json.loads((out / "int4pack_report.json").read_text())["kernels"] == "c++"
