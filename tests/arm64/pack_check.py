#!/usr/bin/env python3
"""Proof that int4pack's portable KleidiAI packer writes torch's native bytes.

Two halves in one file:
  x86 side (this repo's python):  builds a shape matrix, packs every case with int4pack's C++
      packer, computes a float64 reference and torch's x86 fallback output for the same
      activations, writes everything to DIR/cases.safetensors, then runs the other half under
      the emulated aarch64 python and summarises.
  emulated side (``--emulated DIR``, torch + numpy + safetensors only, no int4pack): packs each
      case with ``torch.ops.aten._dyn_quant_pack_4bit_weight`` (real KleidiAI), compares bytes,
      and runs ``_dyn_quant_matmul_4bit`` on OUR blob and on torch's blob. With ``--arm-lib`` it
      also packs each case with int4pack's own C++ library built for aarch64
      (``int4pack/_kernels-aarch64.so``: ``python -m int4pack._build --machine aarch64``, see
      _build.py) and compares those bytes with torch's as well.

Usage:  python tests/arm64/pack_check.py [--out DIR] [--emu /tmp/arm64emu/bin/python3-arm64]
                                            [--quick] [--json FILE] [--arm-lib]
Exit status 0 only if every case is byte-identical and every matmul is within tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# matmul tolerances (kleidiai.md §2.4 and the arm64-emu README): int8 activation quantisation
# costs ~1% relative Frobenius vs float; KleidiAI vs torch's x86 fallback differs ~1e-7, rarely
# ~6e-4 (a different zero point for near-symmetric rows).
TOL_VS_FLOAT = 0.03
TOL_VS_X86 = 2e-3
M_ROWS = (1, 5)  # GEMV (dotprod) and GEMM (i8mm on neoverse-n2)


def matrix(quick: bool):
    ns = [8, 13, 64, 200, 1024, 4096]
    ks = [64, 256, 1024, 4096]
    if quick:
        ns, ks = [8, 13, 200], [64, 256]
    cases = []
    for n in ns:
        for k in ks:
            for g in (32, 64, 128, -1):
                if g != -1 and (k % g or g == k):  # g == K is the channelwise case
                    continue
                for bias in (False, True):
                    cases.append((n, k, g, bias))
    # edge shapes: N=1, tiny K, channelwise K not a multiple of 32 (padded with zeros)
    cases += [(1, 64, 32, True), (1, 32, -1, False), (7, 96, 32, True), (13, 48, -1, True), (9, 80, -1, False)]
    return cases


# ---------------------------------------------------------------------------------------------
# x86 side


def make(out: Path, quick: bool) -> dict:
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from int4pack import kleidiai

    if kleidiai._ext_mod() is None:
        raise SystemExit("the C++ packer did not build: " + str(kleidiai._ext.build_error("kleidiai_pack")))
    gen = torch.Generator().manual_seed(1234)
    tensors, meta = {}, []
    t_pack = 0.0
    for i, (n, k, g, has_bias) in enumerate(matrix(quick)):
        q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
        q[0, :2] = torch.tensor([-8, 7], dtype=torch.int8)  # both extremes present
        if g == -1:
            s = torch.rand(n, 1, generator=gen) * 0.02 + 1e-4
        else:
            s = (torch.rand(n, k // g, generator=gen) * 0.02 + 1e-4).to(torch.bfloat16)
        bias = torch.randn(n, generator=gen) * 0.1 if has_bias else None
        t0 = time.perf_counter()
        blob = kleidiai.pack_portable(q, s, bias, g)
        t_pack += time.perf_counter() - t0
        bl = k if g == -1 else g
        w = (q.double().reshape(n, k // bl, bl) * s.double().reshape(n, k // bl, 1)).reshape(n, k)
        p = f"c{i}."
        tensors[p + "nib"] = kleidiai.nibble_pack(q)
        tensors[p + "scales"] = s
        if bias is not None:
            tensors[p + "bias"] = bias
        tensors[p + "ours"] = blob
        x86_w = kleidiai.load_for_matmul(blob, n, k, g, has_bias)
        for m in M_ROWS:
            x = torch.randn(m, k, generator=gen)
            ref = x.double() @ w.T + (bias.double() if bias is not None else 0)
            tensors[p + f"x{m}"] = x
            tensors[p + f"ref{m}"] = ref
            tensors[p + f"x86_{m}"] = torch.ops.aten._dyn_quant_matmul_4bit(x, x86_w, bl, k, n)
        meta.append({"i": i, "n": n, "k": k, "g": g, "bias": has_bias})
    out.mkdir(parents=True, exist_ok=True)
    save_file({k_: v.contiguous() for k_, v in tensors.items()}, str(out / "cases.safetensors"))
    (out / "cases.json").write_text(json.dumps(meta))
    return {"cases": len(meta), "x86_pack_s": round(t_pack, 3)}


# ---------------------------------------------------------------------------------------------
# emulated side: torch (KleidiAI) only


def emulated(d: Path) -> dict:
    t0 = time.perf_counter()
    import platform

    import torch
    from safetensors.torch import load_file

    import_s = time.perf_counter() - t0
    meta = json.loads((d / "cases.json").read_text())
    t = load_file(str(d / "cases.safetensors"))
    rows = []
    t_pack = t_mm = t_lib = 0.0
    lib = arm_library()

    def rel(a, b):  # relative Frobenius distance of a from reference b
        return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))

    for c in meta:
        p = f"c{c['i']}."
        n, k, g = c["n"], c["k"], c["g"]
        bl = k if g == -1 else g
        ours = t[p + "ours"]
        t1 = time.perf_counter()
        native = torch.ops.aten._dyn_quant_pack_4bit_weight(t[p + "nib"], t[p + "scales"], t.get(p + "bias"), bl, k, n)
        t_pack += time.perf_counter() - t1
        row = dict(c, native_dtype=str(native.dtype), native_bytes=native.numel(), our_bytes=ours.numel())
        same = native.dtype == torch.uint8 and native.numel() == ours.numel() and torch.equal(native, ours)
        row["identical"] = bool(same)
        if lib is not None:  # int4pack's aarch64 library, from the same int8 codes
            u = t[p + "nib"]
            q = torch.stack([(u & 0xF).to(torch.int8) - 8, (u >> 4).to(torch.int8) - 8], dim=2).reshape(n, k)
            t1 = time.perf_counter()
            mine = lib(q, t[p + "scales"], t.get(p + "bias"), g)
            t_lib += time.perf_counter() - t1
            row["arm_lib_identical"] = bool(native.dtype == torch.uint8 and torch.equal(mine, native))
        if not same and native.dtype == torch.uint8 and native.numel() == ours.numel():
            diff = (native != ours).nonzero().flatten()
            row["n_diff"] = int(diff.numel())
            row["first_diff"] = int(diff[0])
        t1 = time.perf_counter()
        for m in M_ROWS:
            x = t[p + f"x{m}"]
            y = torch.ops.aten._dyn_quant_matmul_4bit(x, ours, bl, k, n)
            y_nat = torch.ops.aten._dyn_quant_matmul_4bit(x, native, bl, k, n)
            row[f"m{m}_rel_vs_float"] = rel(y, t[p + f"ref{m}"])
            row[f"m{m}_rel_vs_x86"] = rel(y, t[p + f"x86_{m}"])
            row[f"m{m}_maxabs_vs_x86"] = float((y - t[p + f"x86_{m}"]).abs().max())
            row[f"m{m}_equal_native"] = bool(torch.equal(y, y_nat))
        t_mm += time.perf_counter() - t1
        rows.append(row)
    api = api_checks(meta, t)
    return {
        "api": api,
        "arm_lib": None if lib is None else {"library": lib.path, "pack_s": round(t_lib, 2)},
        "machine": platform.machine(),
        "torch": torch.__version__,
        "kleidiai": bool(torch.backends.kleidiai.is_available()),
        "qemu_cpu": os.environ.get("QEMU_CPU"),
        "import_s": round(import_s, 1),
        "pack_s": round(t_pack, 2),
        "matmul_s": round(t_mm, 2),
        "rows": rows,
    }


def arm_library():
    """int4pack's C++ packer from the library built for this machine, or None (INT4PACK_NO_EXT set).
    Raises when it was asked for (no INT4PACK_NO_EXT) and does not load: that is the finding."""
    if os.environ.get("INT4PACK_NO_EXT"):
        return None
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from int4pack import _ext, kleidiai

    if kleidiai._ext_mod() is None:
        raise SystemExit(f"int4pack's aarch64 library did not load: {_ext.build_error('kleidiai_pack')}")

    def pack(q, scales, bias, g):
        return kleidiai.pack_portable(q, scales, bias, g)

    pack.path = str(_ext.library_path())
    return pack


def api_checks(meta, t) -> dict:
    """int4pack's own Arm-side API on the real thing (pure Python; INT4PACK_NO_EXT=1)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from int4pack import kleidiai

    res = {"native_available": kleidiai.native_kleidiai_available(), "auto_native": 0, "unpack_ok": 0,
           "load_is_blob": 0, "checked": 0}
    for c in meta:
        if c["n"] * c["k"] > 256 * 1024:  # the pure-Python paths are slow under QEMU
            continue
        p = f"c{c['i']}."
        n, k, g = c["n"], c["k"], c["g"]
        u = t[p + "nib"]
        q = torch.stack([(u & 0xF).to(torch.int8) - 8, (u >> 4).to(torch.int8) - 8], dim=2).reshape(n, k)
        blob, used = kleidiai.pack(q, t[p + "scales"], t.get(p + "bias"), g)
        res["checked"] += 1
        res["auto_native"] += used == "native" and torch.equal(blob, t[p + "ours"])
        q2, s2, b2 = kleidiai.unpack(blob, n, k, g, c["bias"])
        res["unpack_ok"] += torch.equal(q2, q) and torch.equal(s2.reshape(t[p + "scales"].shape), t[p + "scales"])
        w = kleidiai.load_for_matmul(blob, n, k, g, c["bias"])
        res["load_is_blob"] += w.data_ptr() == blob.data_ptr()
    return res


def summarise(res: dict) -> dict:
    rows = res["rows"]
    keys_f = [f"m{m}_rel_vs_float" for m in M_ROWS]
    keys_x = [f"m{m}_rel_vs_x86" for m in M_ROWS]
    s = {
        "torch": res["torch"],
        "qemu_cpu": res["qemu_cpu"],
        "cases": len(rows),
        "identical": sum(r["identical"] for r in rows),
        "native_uint8": sum(r["native_dtype"] == "torch.uint8" for r in rows),
        "max_rel_vs_float": max(r[k_] for r in rows for k_ in keys_f),
        "max_rel_vs_x86": max(r[k_] for r in rows for k_ in keys_x),
        "max_abs_vs_x86": max(r[f"m{m}_maxabs_vs_x86"] for r in rows for m in M_ROWS),
        "matmul_equal_native": sum(all(r[f"m{m}_equal_native"] for m in M_ROWS) for r in rows),
        "import_s": res["import_s"],
        "pack_s": res["pack_s"],
        "matmul_s": res["matmul_s"],
    }
    api = res["api"]
    s["api"] = api
    if res.get("arm_lib") is not None:
        s["arm_lib"] = dict(res["arm_lib"], identical=sum(r["arm_lib_identical"] for r in rows))
    s["ok"] = (s["identical"] == s["cases"] and s["max_rel_vs_float"] < TOL_VS_FLOAT
               and s["max_rel_vs_x86"] < TOL_VS_X86 and s["matmul_equal_native"] == s["cases"]
               and api["native_available"] and api["checked"] > 0
               and api["checked"] == api["auto_native"] == api["unpack_ok"] == api["load_is_blob"]
               and ("arm_lib" not in s or s["arm_lib"]["identical"] == s["cases"]))
    s["failures"] = [r for r in rows if not r["identical"]][:5]
    return s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/int4pack_arm64_pack_check"))
    ap.add_argument("--emu", default=os.environ.get("ARM64EMU_PYTHON", "/tmp/arm64emu/bin/python3-arm64"))
    ap.add_argument("--quick", action="store_true", help="small matrix (seconds, for smoke tests)")
    ap.add_argument("--json", type=Path, help="write the summary and per-case rows here")
    ap.add_argument("--reuse", action="store_true", help="reuse DIR's cases (another torch / QEMU_CPU)")
    ap.add_argument("--arm-lib", action="store_true",
                    help="also pack with int4pack/_kernels-aarch64.so under emulation (built beforehand)")
    ap.add_argument("--emulated", type=Path, help=argparse.SUPPRESS)  # internal: the aarch64 half
    a = ap.parse_args(argv)
    if a.emulated:
        (a.emulated / "emulated.json").write_text(json.dumps(emulated(a.emulated)))
        return 0
    t0 = time.perf_counter()
    if a.reuse and (a.out / "cases.json").exists():
        print(f"x86: reusing {a.out}", flush=True)
    else:
        made = make(a.out, a.quick)
        print(f"x86: {made['cases']} cases packed in {made['x86_pack_s']} s -> {a.out}", flush=True)
    if not Path(a.emu).exists():
        print(f"no emulated python at {a.emu}: run bash tools/arm64emu/setup.sh", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env.setdefault("QEMU_CPU", "neoverse-n2")
    if a.arm_lib:
        env.pop("INT4PACK_NO_EXT", None)
    else:
        env["INT4PACK_NO_EXT"] = "1"  # an x86-built library cannot load there
    t1 = time.perf_counter()
    r = subprocess.run([a.emu, str(Path(__file__).resolve()), "--emulated", str(a.out)], env=env)
    if r.returncode:
        print(f"emulated check failed with exit status {r.returncode}", file=sys.stderr)
        return 1
    res = json.loads((a.out / "emulated.json").read_text())
    s = summarise(res)
    s["emulated_wall_s"] = round(time.perf_counter() - t1, 1)
    s["total_wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps({k_: v for k_, v in s.items() if k_ != "failures"}, indent=1))
    for f in s["failures"]:
        print("MISMATCH", f)
    if a.json:
        a.json.write_text(json.dumps({"summary": s, "rows": res["rows"]}, indent=1))
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
