"""The C++ library's SIGBUS guard (csrc/fault_guard.h), on a mapped file cut under a kernel: the
call raises SourceBytesVanished at the first vanished byte, whether the caller's thread or a thread
the kernel started took the fault; afterwards the kernels run as before, and a SIGBUS outside any
kernel still ends the process, through faulthandler where it is enabled. Each case runs in a
process of its own: a guard that failed would end it."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from _reliability import ROOT, _env

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGBUS"), reason="POSIX signals")

# a 16 MB file of compressed-tensors words [4096 rows, 1024 words] mapped as convert maps a shard,
# cut to its first 8 MB (rows 0-2047) after one whole unpacking, then unpacked again on THREADS
# threads (2: the caller's thread takes rows 0-2047, which are all there, a thread of the kernel's
# own rows 2048-4095, whose first read faults); then AFTER: "none", or "touch" (a read of a cut
# page from Python, outside any kernel)
_RUN = r"""
import ctypes, faulthandler, mmap, os, sys
import torch
path, threads, after, handler = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
if handler == "faulthandler":
    faulthandler.enable()  # before the library is loaded, as pytest enables it
from int4pack import kernels
from int4pack.errors import SourceBytesVanished
ext = kernels.ext()
with open(path, "wb") as f:
    f.write(os.urandom(16 << 20))
fh = open(path, "rb")
m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
base = ctypes.addressof(ctypes.c_char.from_buffer(m))
words = torch.frombuffer(m, dtype=torch.int32).view(4096, 1024)
whole = ext.unpack_ct(words, 8192, threads)
os.truncate(path, 8 << 20)
for _ in range(2):
    try:
        ext.unpack_ct(words, 8192, threads)
        print("no fault")
    except SourceBytesVanished as e:
        print("vanished at", e.address - base)
print("first half again:", bool(torch.equal(ext.unpack_ct(words[:2048], 8192, threads), whole[:2048])))
sys.stdout.flush()
if after == "touch":
    ctypes.string_at(base + (12 << 20), 1)
print("alive")
"""


def _run(tmp_path, threads: int, after: str, handler: str = "default") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _RUN, str(tmp_path / "words.bin"), str(threads), after, handler],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)


def _need_kernels():
    from int4pack import kernels

    if kernels.ext() is None:
        pytest.skip("the guard is the C++ library's")


@pytest.mark.parametrize("threads", [1, 2])
def test_a_file_cut_under_a_kernel_is_an_error_at_the_first_vanished_byte(tmp_path, threads):
    _need_kernels()
    r = _run(tmp_path, threads, "none")
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    lines = r.stdout.splitlines()
    assert lines == [f"vanished at {8 << 20}"] * 2 + ["first half again: True", "alive"], r.stdout


@pytest.mark.parametrize("handler", ["default", "faulthandler"])
def test_a_sigbus_outside_the_kernels_still_ends_the_process(tmp_path, handler):
    """After the guarded faults, a read of a cut page from Python (no kernel running) goes to the
    handler installed before the library's (faulthandler: its traceback) or the default action."""
    _need_kernels()
    r = _run(tmp_path, 2, "touch", handler)
    assert r.returncode == -signal.SIGBUS, (r.returncode, r.stdout, r.stderr[-2000:])
    assert "first half again: True" in r.stdout and "alive" not in r.stdout, r.stdout
    assert ("Fatal Python error: Bus error" in r.stderr) == (handler == "faulthandler"), r.stderr[-2000:]
    if handler == "faulthandler":
        assert "string_at" in r.stderr, r.stderr[-2000:]
