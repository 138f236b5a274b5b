"""How far the routing controls move the references (x86, no vLLM): on the lane's prompt (and 7
greedy tokens of the float reference), the bf16 mirror against the float reference and the float64
mirror, and the mirror of the same checkpoint with every e_score_correction_bias zeroed: logprobs,
and the experts chosen per (MoE layer, position) (lane_checks.py's routing check).

    python tests/vllm/control_effect.py ct_deepseekv3_w4a16 ct_glm4moe_w4a16 --work /tmp/ctl
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lane_inputs as E  # noqa: E402
from controls import mirrors  # noqa: E402
from float_ref import greedy, reference  # noqa: E402
from lane_checks import routing_agreement  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("inputs", nargs="+")
ap.add_argument("--work", default="/tmp/int4pack_control_effect")
ap.add_argument("--prompt", default="3,17,42,99,128,200,7,64")
a = ap.parse_args()
torch.set_num_threads(1)
prompt = [int(x) for x in a.prompt.split(",")]
for item in E.resolve_inputs(a.inputs):
    rec = E.prepare(item, Path(a.work))
    d = Path(a.work) / item["key"]
    fl = reference("transformers", d / "float")
    ids = prompt + greedy(fl, prompt, 7)
    base = fl.logprobs(ids)
    mir, m64 = mirrors("transformers", Path(rec["mirror_dir"]), d, True)
    zb = mirrors("transformers", Path(rec["mirror_dir"]), d, True, zero_bias=True)[0]
    lm, lz = mir.logprobs(ids), zb.logprobs(ids)
    r_m, r_z = mir.routes, zb.routes
    l64 = m64.logprobs(ids)
    r_64 = m64.routes
    calls = list(r_m)  # one "call" per layer: the shape the probe gives for one prefill

    def med(x, y):
        return round(float((x - y).abs().max(-1).values.median()), 4)

    print(json.dumps({"input": item["input"], "bf16_mirror_vs_float_max": round(float((lm - base).abs().max()), 4),
                      "bf16_mirror_vs_mirror64_median": med(lm, l64),
                      "routing_bf16_mirror_vs_mirror64": routing_agreement(calls, r_64),
                      "routing_zero_bias_vs_mirror": routing_agreement(list(r_z), r_m),
                      "zero_bias_vs_float_max": round(float((lz - base).abs().max()), 4),
                      "zero_bias_vs_mirror_median": med(lz, lm)}), flush=True)
