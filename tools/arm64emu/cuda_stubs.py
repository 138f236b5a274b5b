#!/usr/bin/env python3
"""No-GPU stand-ins for the CUDA libraries that PyPI's aarch64 torch (a CUDA build) links.

PyPI's aarch64 torch >= 2.11 is built with CUDA: libtorch_cpu.so, libtorch_python.so and
libtorch_cuda.so name libcudart, libcublas, libcudnn, libnccl, ... as DT_NEEDED, so ``import
torch`` fails without the nvidia-* wheels (gigabytes, and not all published for aarch64). The
CPU code (ATen CPU kernels, KleidiAI, oneDNN, NVPL BLAS) lives in libtorch_cpu.so and never calls
them for CPU tensors. This script writes, for every library that the torch site needs and that
is missing, a small aarch64 shared object with the same SONAME, the same symbol version node, and
every function and object that torch's libraries import from it. Each function returns an error
code (100, cudaErrorNoDevice for the CUDA runtime; ``cudaGetDeviceCount`` also sets the count to
0); the ``*String``/``*ErrorName`` functions return a message. So torch imports,
``torch.cuda.is_available()`` is False, and any real CUDA use fails with an error.

Packages built against that torch link the same CUDA libraries: PyPI's aarch64 torchvision 0.28.0
(``_C.so``) imports ``__cudaInitModule`` and the other ``__cuda*`` registration functions that
nvcc's generated code calls from static constructors when the library is loaded. ``--also
PKG_DIR`` adds a package's ``.so`` files to the walk, so the stand-ins export its imports too.
The registration functions succeed and do nothing (``__cudaRegisterFatBinary`` returns a
non-null handle, the ``void`` ones return): loading such a library must not fail, only a launch.

Run on the x86-64 host with pyelftools and ziglang on PYTHONPATH (``zig cc`` links for
aarch64-linux-gnu):

    python3 cuda_stubs.py SITE/torch SYSROOT OUT_DIR [--also SITE/torchvision ...]

Then put OUT_DIR on the emulated process's LD_LIBRARY_PATH (the wrappers pass it with qemu's -E).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from elftools.elf.dynamic import DynamicSection
from elftools.elf.elffile import ELFFile

NO_DEVICE = 100  # cudaErrorNoDevice; any non-zero status means failure to the caller
MESSAGE_SUFFIXES = ("String", "ErrorName")
MESSAGE_FUNCTIONS = {"ncclGetLastError"}  # returns const char*, unlike cudaGetLastError
# what nvcc's host code calls when a library with device code is loaded or unloaded
# (crt/host_runtime.h): they must not fail, or the library does not load
REGISTRATION_VOID = {"__cudaRegisterFatBinaryEnd", "__cudaRegisterFunction", "__cudaRegisterVar",
                     "__cudaRegisterManagedVar", "__cudaUnregisterFatBinary"}


def elf_summary(path: str) -> tuple[list[str], list[tuple[str, str, str, tuple[str, str] | None]], set[str]]:
    """(DT_NEEDED names, undefined dynamic symbols as (name, type, binding, (file, version)),
    defined dynamic symbol names)."""
    with open(path, "rb") as f:
        elf = ELFFile(f)
        needed = [t.needed for s in elf.iter_sections() if isinstance(s, DynamicSection)
                  for t in s.iter_tags() if t.entry.d_tag == "DT_NEEDED"]
        versions = {}  # version index -> (file that must define it, version name)
        verneed = elf.get_section_by_name(".gnu.version_r")
        if verneed is not None:
            for vn, auxes in verneed.iter_versions():
                for aux in auxes:
                    versions[aux.entry.vna_other] = (vn.name, aux.name)
        versym = elf.get_section_by_name(".gnu.version")
        undefined, defined = [], set()
        for i, sym in enumerate(elf.get_section_by_name(".dynsym").iter_symbols()):
            if not sym.name:
                continue
            if sym.entry.st_shndx != "SHN_UNDEF":
                defined.add(sym.name)
                continue
            idx = versym.get_symbol(i).entry.ndx if versym is not None else None
            undefined.append((sym.name, sym.entry.st_info.type, sym.entry.st_info.bind, versions.get(idx)))
        return needed, undefined, defined


def package_roots(pkg_dir: str) -> tuple[list[str], list[str]]:
    """(the .so files of an extra package, the folders its RPATH names: the package's own and the
    ``<name>.libs`` beside it, where auditwheel puts the libraries it bundles)."""
    libs = os.path.normpath(pkg_dir) + ".libs"
    roots = sorted(os.path.join(r, n) for r, _, names in os.walk(pkg_dir) for n in names
                   if n.endswith(".so") or ".so." in n)
    return roots, [pkg_dir] + ([libs] if os.path.isdir(libs) else [])


def missing_imports(torch_dir: str, sysroot: str, also: list[str] = ()) -> dict[str, tuple[str | None, dict[str, str]]]:
    """Missing library -> (symbol version node or None, {symbol: ELF type}) for everything that
    ``import torch`` loads (torch/_C and libtorch_global_deps.so, and what they need), and every
    shared object of the packages in ``also`` (and what they need)."""
    lib = os.path.join(torch_dir, "lib")
    dirs = [lib, os.path.join(sysroot, "usr/lib/aarch64-linux-gnu"), os.path.join(sysroot, "lib/aarch64-linux-gnu")]
    roots = [os.path.join(torch_dir, n) for n in os.listdir(torch_dir) if n.startswith("_C.") and n.endswith(".so")]
    roots.append(os.path.join(lib, "libtorch_global_deps.so"))
    for pkg in also:
        r, d = package_roots(pkg)
        roots += r
        dirs += d
    seen: dict[str, tuple] = {}
    missing: set[str] = set()
    todo = list(roots)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen[path] = elf_summary(path)
        for name in seen[path][0]:
            found = next((os.path.realpath(os.path.join(d, name)) for d in dirs if os.path.exists(os.path.join(d, name))), None)
            if found is None:
                missing.add(name)
            elif found not in seen:
                todo.append(found)
    defined = set().union(*(s[2] for s in seen.values()))
    versioned: dict[str, dict[str, str]] = {m: {} for m in missing}
    node: dict[str, str] = {}
    loose: dict[str, str] = {}  # unversioned imports nobody defines (the interpreter's Py* aside)
    for _, undefined, _ in seen.values():
        for name, typ, bind, ver in undefined:
            if bind == "STB_WEAK":
                continue
            if ver and ver[0] in missing:
                versioned[ver[0]][name] = typ
                node[ver[0]] = ver[1]
            elif not ver and name not in defined and not name.startswith(("Py", "_Py")):
                loose[name] = typ
    # an unversioned import cannot be traced to one library: every unversioned stub exports it
    return {m: (node.get(m), versioned[m] if m in node else dict(loose)) for m in sorted(missing)}


def stub_source(symbols: dict[str, str]) -> str:
    out = ['static const char message[] = "CUDA is not available: no-GPU stand-in library";',
           "static void *fatbin_handle[8];"]
    for name, typ in sorted(symbols.items()):
        if typ == "STT_OBJECT":
            out.append(f"char {name}[256];")
        elif name == "__cudaRegisterFatBinary":
            out.append(f"void **{name}(void *fatbin) {{ (void)fatbin; return fatbin_handle; }}")
        elif name in REGISTRATION_VOID:
            out.append(f"void {name}(void) {{}}")
        elif name == "__cudaInitModule":  # char __cudaInitModule(void **handle): nothing to initialise
            out.append(f"char {name}(void **handle) {{ (void)handle; return 0; }}")
        elif name.endswith(MESSAGE_SUFFIXES) or name in MESSAGE_FUNCTIONS:
            out.append(f"const char *{name}(void) {{ return message; }}")
        elif name == "cudaGetDeviceCount":
            out.append(f"int {name}(int *count) {{ if (count) *count = 0; return {NO_DEVICE}; }}")
        else:
            out.append(f"int {name}(void) {{ return {NO_DEVICE}; }}")
    return "\n".join(out) + "\n"


def build(torch_dir: str, sysroot: str, out_dir: str, also: list[str] = ()) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    made = []
    zig = [sys.executable, "-m", "ziglang", "cc", "-target", "aarch64-linux-gnu.2.17", "-shared", "-O1"]
    with tempfile.TemporaryDirectory() as tmp:
        for soname, (node, symbols) in missing_imports(torch_dir, sysroot, also).items():
            src = os.path.join(tmp, soname + ".c")
            with open(src, "w") as f:
                f.write(stub_source(symbols))
            cmd = zig + ["-o", os.path.join(out_dir, soname), src, f"-Wl,-soname,{soname}"]
            if node:  # versioned imports need the same version node, or ld.so refuses the library
                vs = os.path.join(tmp, soname + ".map")
                with open(vs, "w") as f:
                    f.write(node + " {\n  global:\n" + "".join(f"    {s};\n" for s in sorted(symbols)) + "  local: *;\n};\n")
                cmd.append(f"-Wl,--version-script={vs}")
            subprocess.run(cmd, check=True)
            made.append(f"{soname} ({len(symbols)} symbols{', version ' + node if node else ''})")
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("torch_dir", help="the installed torch package folder (SITE/torch)")
    ap.add_argument("sysroot", help="the aarch64 sysroot with libc, libstdc++, libgomp")
    ap.add_argument("out_dir")
    ap.add_argument("--also", action="append", default=[], metavar="PKG_DIR",
                    help="an installed package folder built against that torch (SITE/torchvision): its "
                         ".so files' imports are stood in for too")
    a = ap.parse_args()
    for line in build(a.torch_dir, a.sysroot, a.out_dir, a.also):
        print("cuda_stubs.py:", line, file=sys.stderr)


if __name__ == "__main__":
    main()
