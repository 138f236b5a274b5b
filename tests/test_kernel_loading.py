"""The C++ kernels missing, stale or failing: one line that says what to do, never a wrong result."""

from __future__ import annotations

import pytest
import torch


def _fresh_ext(monkeypatch, library):
    from int4pack import _ext

    monkeypatch.setattr(_ext, "library_path", lambda: library)
    monkeypatch.setattr(_ext, "_loaded", {})
    monkeypatch.setattr(_ext, "_error", None)
    monkeypatch.setattr(_ext, "_warned", False)
    monkeypatch.delenv("INT4PACK_NO_EXT", raising=False)
    return _ext


def test_missing_kernels_without_a_compiler_say_what_to_install_in_one_line(tmp_path, monkeypatch):
    """No library and no compiler: one warning per process, one line, naming the cause, what to
    install and the cost; INT4PACK_NO_EXT=1 chooses the slow paths without a warning."""
    import warnings

    from int4pack import _build

    _ext = _fresh_ext(monkeypatch, tmp_path / _build.library_name())
    monkeypatch.setenv("PATH", str(tmp_path))  # no c++, g++ or clang++ to find
    monkeypatch.delenv("CXX", raising=False)
    with pytest.warns(_ext.SlowPathWarning) as got:
        assert _ext.load("convert_kernels") is None
    (w,) = got
    msg = str(w.message)
    assert "\n" not in msg and msg.startswith("no C++ compiler was found")
    assert "apt-get install g++" in msg and "22x slower" in msg and "reinstall int4pack" in msg
    text = warnings.formatwarning(w.message, w.category, w.filename, w.lineno, None)
    assert text.count("\n") == 1, text  # printed as one line: no source line quoted under it
    assert _ext.build_error("kleidiai_pack") == _ext.build_error("convert_kernels")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _ext.load("convert_kernels") is None  # known failure: no second warning
        assert _ext.load("kleidiai_pack") is None  # nor for the other kernels (one library)
        monkeypatch.setattr(_ext, "_warned", False)
        monkeypatch.setenv("INT4PACK_NO_EXT", "1")
        assert _ext.load("kleidiai_pack") is None
        assert _ext.build_error() == "disabled by INT4PACK_NO_EXT"


def test_missing_kernels_with_a_compiler_say_reinstall(tmp_path, monkeypatch):
    from int4pack import _build

    lib = tmp_path / _build.library_name()
    _ext = _fresh_ext(monkeypatch, lib)
    cxx = tmp_path / "bin" / "c++"
    cxx.parent.mkdir()
    cxx.write_text("#!/bin/sh\n")
    cxx.chmod(0o755)
    monkeypatch.setenv("PATH", str(cxx.parent))
    monkeypatch.delenv("CXX", raising=False)
    with pytest.warns(_ext.SlowPathWarning, match="not built when it was installed"):
        assert _ext.load("convert_kernels") is None
    assert str(lib) in _ext.build_error()


def test_unusable_or_stale_kernels_are_refused_not_run(tmp_path, monkeypatch):
    """A file that is no library for this machine, or a library built from other sources than the
    ones beside it, is refused (the pure-torch paths run) with the reason."""
    from int4pack import _build, _ext, _native

    real = _ext.library_path()
    if not real.is_file():
        pytest.fail(f"{real} is missing: pip install -e . (or python -m int4pack._build) builds it")
    bad = tmp_path / _build.library_name()
    bad.write_bytes(b"not an ELF file")
    e = _fresh_ext(monkeypatch, bad)
    with pytest.warns(e.SlowPathWarning, match="cannot be used"):
        assert e.load("convert_kernels") is None
    e = _fresh_ext(monkeypatch, real)
    monkeypatch.setattr(_build, "source_hash", lambda root=None: "0123456789abcdef")
    with pytest.warns(e.SlowPathWarning, match="built from other sources"):
        assert e.load("convert_kernels") is None
    monkeypatch.undo()
    assert _native.open_library(real).i4p_abi_version() == _native.ABI_VERSION


def test_kernel_errors_come_back_as_exceptions_with_the_message():
    """A check that fails inside the library raises with its message (i4p_last_error), and the
    library stays usable."""
    import torch

    from int4pack import kernels

    m = kernels.ext()
    if m is None:
        pytest.fail("the C++ kernels are missing: pip install -e . (or python -m int4pack._build) builds them")
    with pytest.raises(RuntimeError, match="does not fit"):
        m.unpack_ct(torch.zeros(2, 1, dtype=torch.int32), 9, 1)
    with pytest.raises(RuntimeError, match="layout 7 is not read here"):
        m.lossless_job(7, torch.zeros(2, 1, dtype=torch.int32), 2, 8, torch.ones(2, 1), None, None, 8, 8, True, 1)
    with pytest.raises(RuntimeError, match="qweight: expected"):
        m.unpack_gptq(torch.zeros(2, 4, dtype=torch.int64), 1)
    assert kernels.crc32c(b"123456789") == 0xE3069283
