#!/usr/bin/env python3
"""Does int4pack's vLLM plugin refuse same-size corruptions of a packed checkpoint at load?

x86 side: converts two fixtures with ``--serve-format kleidiai`` (ct_qwen3moe_w4a16: group 32, the
experts' down_proj has K = 64 = 2 x 32; ct_qwen3moe_w4a16_channel: the same shapes, channelwise),
makes three corruptions of the same size with tests/corrupt_corpus.py (a flipped bit in an expert
blob, two experts' gate blobs swapped, a group-32 blob with K = 2g in place of a channelwise one),
then loads the intact channelwise checkpoint and the three in ONE emulated vLLM process
(tests/vllm/probe.py: vLLM imported once) and writes what each load gave:

    python tests/vllm/trust_check.py --vllm 0.32.0 --work /tmp/e2e-trust --json results.json

The intact checkpoint must load and generate; each corrupted one must fail with the plugin's
message naming the corrupted tensor. Exit 0 when that is what happened.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(HERE))

EXPECT = {  # case -> the tensor the refusal must name
    "flip_byte": "model.layers.0.mlp.experts.0.gate_proj.weight_packed",
    "swap_experts": "model.layers.0.mlp.experts.0.gate_proj.weight_packed",
    "k2g_as_channel": "model.layers.0.mlp.experts.0.down_proj.weight_packed",
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", default="0.32.0")
    ap.add_argument("--work", type=Path, default=Path("/tmp/e2e-trust"))
    ap.add_argument("--prefix", type=Path, default=Path("/tmp/arm64emu"))
    ap.add_argument("--timeout", type=int, default=3000)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    import int4pack
    from corrupt_corpus import build
    from lane_plugin import plugin_env

    PROBE = HERE / "probe.py"

    fixtures = REPO / "tests" / "fixtures"
    work = a.work
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    int4pack.convert(fixtures / "ct_qwen3moe_w4a16", work / "packed", serve_format="kleidiai")
    int4pack.convert(fixtures / "ct_qwen3moe_w4a16", work / "plain")
    int4pack.convert(fixtures / "ct_qwen3moe_w4a16_channel", work / "packed_channel", serve_format="kleidiai")
    cases = build(work / "cases", {"packed": work / "packed", "plain": work / "plain",
                                   "packed_channel": work / "packed_channel"})
    # the refusals first: each stops at load, before the engine runs; the intact load last
    runs = {**{k: cases[f"packed_{k}"].folder for k in EXPECT}, "intact_channel": work / "packed_channel"}
    todo = [f"{folder}={work / (name + '.json')}" for name, folder in runs.items()]
    wrapper = a.prefix / "bin" / f"python3-arm64-vllm{a.vllm}"
    cmd = [str(wrapper), str(PROBE), *todo, "--max-tokens", "4", "--dtype", "float32"]
    t = time.perf_counter()
    with open(work / "probe.log", "w") as log:
        try:
            subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=a.timeout, check=False,
                           env=plugin_env(work))
        except subprocess.TimeoutExpired:
            print(f"the emulated process ran past --timeout {a.timeout} s; what it wrote is below")
    wall = round(time.perf_counter() - t, 1)
    out = {"vllm": a.vllm, "wall_s": wall, "cases": {}}
    ok = True
    for name in runs:
        pj = work / f"{name}.json"
        p = json.loads(pj.read_text()) if pj.is_file() else {"error": "no probe output (see probe.log)"}
        err = p.get("error")
        rec = {"error": err, "tokens": p.get("token_ids"), "vllm": p.get("vllm"), "qemu_cpu": p.get("qemu_cpu"),
               "model_s": p.get("model_s")}
        if name == "intact_channel":
            rec["ok"] = err is None and bool(p.get("token_ids"))
        else:
            rec["ok"] = bool(err) and "int4pack-kleidiai" in err and EXPECT[name] in err
            rec["what"] = cases[f"packed_{name}"].what
        ok &= rec["ok"]
        out["cases"][name] = rec
        print(f"{name}: {'ok' if rec['ok'] else 'NOT OK'}: {(err or 'loaded, tokens ' + str(rec['tokens']))[:300]}")
    out["ok"] = ok
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
