"""Which router weight vLLM put on Llama-4's expert input (x86, no vLLM; reads probe outputs of a
scripts/vllm_arm_e2e.py run): vLLM's logprobs against the bf16 int8-activation mirror as the model
routes (the sigmoid of the top-1 logit on the input) and against the same mirror with the softmax
probability of that expert on the input (what ``select_experts``' softmax default gives without
the model's custom routing function). The same experts are chosen either way; the closer mirror
is the weight vLLM ran (scripts/vllm_arm_e2e.py makes the same comparison its router-weight check).

    python tests/vllm/router_weight_effect.py /tmp/e2e/ct_llama4_w4a16 \\
        /tmp/e2e/ct_llama4_w4a16/probe_0.32.0_bfloat16_group.json ... --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from controls import softmax_weights  # noqa: E402
from float_ref import dequantised_w4a8, ref_logprobs  # noqa: E402
from hf_reference import HFRef  # noqa: E402
from lane_checks import compare  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", help="the input's folder under --work (float/, w4a8_group/, mirror_w4a8_group/)")
    ap.add_argument("probes", nargs="+", help="probe_*.json files of vLLM runs of that input")
    ap.add_argument("--group", default="group")
    ap.add_argument("--json")
    a = ap.parse_args()
    d = Path(a.folder)
    _, q = dequantised_w4a8(d / f"w4a8_{a.group}")
    out = []
    for pf in a.probes:
        p = json.loads(Path(pf).read_text())
        bf16 = p.get("dtype", "bfloat16") == "bfloat16"
        rec = {"probe": Path(pf).name, "vllm": p.get("vllm"), "dtype": p.get("dtype"),
               "quantization": p.get("quantization"), "tokens": p.get("token_ids")}
        for name, make in (("sigmoid_of_logit", lambda r: r), ("softmax_probability", softmax_weights)):
            ref = make(HFRef(d / f"mirror_w4a8_{a.group}", q, a8=True, bf16=bf16))
            c = compare(ref_logprobs(ref, p["prompt"], p["token_ids"]), p["prompt"], p)
            rec[f"vs_mirror_{name}"] = {k: v for k, v in c.items() if not isinstance(v, list)}
        out.append(rec)
        print(json.dumps(rec), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"input": d.name, "results": out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
