"""Builds int4pack's C++ kernels during ``pip install`` (metadata lives in pyproject.toml).

The kernels (``int4pack/csrc``) include no torch or Python headers: they compile with the plain
C++ compiler into ``int4pack/_kernels-<machine>.so`` (``int4pack/_build.py``), which int4pack
loads through ctypes, so the build needs no torch (build isolation is fine) and one build serves
every torch and Python. Without a compiler the install still succeeds, says so, and int4pack runs
its pure-torch paths (about 22x slower to convert) with a one-line warning saying what to install.
"""

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

ROOT = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("int4pack_build", ROOT / "int4pack" / "_build.py")
_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_build)


class BuildKernels(build_ext):
    """build_ext for the one library: our own compiler call (flags of _build.py, sources compiled in
    parallel), a file name without a Python tag, and a failure that warns instead of failing."""

    def get_ext_filename(self, fullname):
        # called with the full name (in-place copies) and with the last part (get_ext_fullpath)
        if fullname == "int4pack._kernels":
            return os.path.join("int4pack", _build.library_name())
        if fullname == "_kernels":
            return _build.library_name()
        return super().get_ext_filename(fullname)

    def build_extension(self, ext):
        if ext.name != "int4pack._kernels":
            return super().build_extension(ext)
        out = Path(self.get_ext_fullpath(ext.name))
        try:
            _build.build(out, log=lambda msg: print(msg, file=sys.stderr))
        except RuntimeError as e:
            # the install goes on: int4pack runs its pure-torch paths and says so, in one line
            print(f"WARNING: int4pack: the C++ kernels were not built: {e}", file=sys.stderr)


class PlatformWheel(bdist_wheel):
    """py3-none-<platform>: the library depends on no Python ABI, so one wheel per platform serves
    every Python (prebuilt wheels: pyproject's [tool.cibuildwheel])."""

    def get_tag(self):
        return "py3", "none", super().get_tag()[2]


setup(
    # optional: setuptools copies the library into the source tree for an editable install only when
    # it was built
    ext_modules=[Extension("int4pack._kernels", sources=[], optional=True)],
    cmdclass={"build_ext": BuildKernels, "bdist_wheel": PlatformWheel},
)
