"""``verify``: prove a converted W4A8 checkpoint is complete and computes what its source computes.

Structural pass (always): every expert of every MoE layer, tensor dtypes/shapes against the
config's quantization_config, int4 range, finite positive scales, config/ignore/index agreement,
shard checksums against ``int4pack_report.json``. In the packed serving format (serve_format.py)
every blob's size, inner consistency and decoded values are checked against the provenance its shard
header records, and repacking the decoded values must give the same bytes.

Numerical pass, per MoE layer: unit-RMS random hidden states times the layer's input norm weight,
routed by the layer's own router (every sampled expert is guaranteed tokens), run through the W4A8
MoE op (``moe.moe_forward``) and through float32 references on the converted weights and (with
``against``) on the source checkpoint's own dequantised weights. The error splits into

* activation quantisation: kernel vs float on the converted weights. Its expected size is derived
  from the inputs (per-row int8 step^2/12, propagated through the layer: ``moe.predicted_noise``);
  the measured error must stay below ``K_ACT`` times that;
* weight requantisation: float on converted vs float on source weights. Each module's weight
  error must equal convert's own measurement in the report (or, without a report, stay below the
  path's bound: bf16 scale rounding 2^-8 for lossless/fold, plain absmax RTN for requant), and each
  expert's output error must stay below ``K_WEIGHT`` times the error those budgets predict.

Dense W4A8 linears get the same with ``_dyn_quant_matmul_4bit`` on a few random rows.
"""

from __future__ import annotations

import json
import math
import re
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from . import moe as moe_mod
from . import serve_format as sf
from .architectures import classify
from .checkpoint import Checkpoint, resolve_source
from .errors import InputError, Int4packError, VerifyFailed
from .groups import check_group_size
from .w4a8 import dequantize_w4a8

__all__ = ["verify", "K_ACT", "K_WEIGHT", "LOSSLESS_BOUND", "REL_MARGIN"]

K_ACT = 1.5  # measured/predicted activation error is 0.95-1.05 on random and real layers
K_WEIGHT = 2.0  # the isotropic weight-noise model is within ~1.5x on the fixtures
LOSSLESS_BOUND = 2.0**-8  # bf16 rounding of a scale: relative error <= 2^-8 per element
REL_MARGIN = 1e-3  # report values carry 6 digits; float32 vs float64 sums differ by ~1e-6
ABS_FLOOR = 1e-6
MIN_SLOTS_PER_EXPERT = 2
_ROUTER = re.compile(r"\.(mlp|block_sparse_moe)\.(gate|router)$")
_NORMS = ("post_attention_layernorm", "pre_feedforward_layernorm", "ffn_norm")
_LAYER = re.compile(r"\.layers\.(\d+)\.")


class _Problems:
    def __init__(self):
        self.items: list[dict] = []

    def add(self, where: str, message: str) -> None:
        self.items.append({"where": where, "message": message})

    def __bool__(self) -> bool:
        return bool(self.items)


@contextmanager
def _threads(n: int | None):
    if not n:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    den = float(b.norm())
    num = float((a - b).norm())
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    den = float(a.norm() * b.norm())
    return float(a @ b) / den if den > 0 else 1.0


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3g}"


# --------------------------------------------------------------------------------- the target


class _Target:
    """The converted checkpoint: W4A8 scheme from its config, quantised modules, MoE layers."""

    def __init__(self, ckpt: Checkpoint, problems: _Problems):
        self.ckpt = ckpt
        q = ckpt.quant_config or {}
        groups = q.get("config_groups") or {}
        rec = sf.read_record(q)
        if q.get("quant_method") not in ("compressed-tensors", sf.QUANT_METHOD) or not groups:
            raise InputError(f"{ckpt.folder}: not a compressed-tensors W4A8 checkpoint "
                             f"(quant_method {q.get('quant_method')!r})",
                             hint="verify checks int4pack's output; pass the folder convert wrote.")
        for gname, grp in groups.items():
            w = grp.get("weights") or {}
            a = grp.get("input_activations") or {}
            fmt = grp.get("format") or q.get("format")
            where = "config" if len(groups) == 1 else f"config group {gname}"
            if fmt != "int-quantized":
                problems.add(where, f"format {fmt!r}, expected 'int-quantized' (vLLM's W4A8 int layout)")
            if w.get("num_bits") != 4 or w.get("type") != "int" or not w.get("symmetric", False):
                problems.add(where, f"weights must be 4-bit symmetric int, config says {w}")
            if a.get("num_bits") != 8 or a.get("strategy") != "token" or not a.get("dynamic"):
                problems.add(where, "input_activations must be 8-bit dynamic per token (vLLM's W4A8 detection)")
        self.ignore = list(q.get("ignore") or [])
        for why in sf.record_problems(rec) if rec else []:
            problems.add("config", f"quantization_config.kleidiai: {why}")
        self.packed = sf.PackedWeights(ckpt, rec) if rec else None  # None: int8 weights and scales
        self.modules = (self.packed.modules if self.packed else
                        sorted(n[: -len(".weight_scale")] for n in ckpt.tensors if n.endswith(".weight_scale")))
        self.groups = _module_groups(ckpt, q, self.modules, problems)
        tc = ckpt.text_config
        self.num_experts = next((tc[k] for k in ("num_experts", "num_local_experts", "n_routed_experts")
                                 if isinstance(tc.get(k), int)), None)
        self.top_k = int(tc.get("num_experts_per_tok") or tc.get("moe_topk") or 2)
        self.norm_topk = bool(tc.get("norm_topk_prob", ckpt.model_type in ("mixtral", "phimoe")))
        act = str(tc.get("hidden_act") or "silu")
        self.activation = 1 if "oai" in act else 0
        self.layers: dict[str, dict[int, dict[str, str]]] = {}
        self.roles: dict[str, str] = {}
        for m in self.modules:
            role, d = classify(m)
            self.roles[m] = role
            if role == "expert":
                self.layers.setdefault(d["moe"], {}).setdefault(d["e"], {})[d["proj"]] = m
        self.routers = {n[: -len(".gate.weight")] if n.endswith(".gate.weight") else n[: -len(".router.weight")]: n
                        for n in ckpt.tensors if n.endswith(".weight") and _ROUTER.search(n[:-7])}

    def group_for(self, m: str) -> int:
        """Module m's group from its config group; a group equal to K is channelwise."""
        g, k = self.groups.get(m, -1), self.shape(m)[1]
        return -1 if g in (-1, k) else g

    def moe_group(self, slot: dict[str, str]) -> int:
        """The one group vLLM's MoE kernel runs for an expert's w13 and w2 (channel only if both are)."""
        a, b = self.group_for(slot["gate"]), self.group_for(slot["down"])
        return a if a == b else self.groups.get(slot["gate"], -1)

    def weight(self, m: str) -> tuple[torch.Tensor, torch.Tensor, int]:
        if self.packed:
            q, s, _ = self.packed.decode(m, check=False)  # checked once, in the structural pass
        else:
            q = self.ckpt.get(f"{m}.weight")
            s = self.ckpt.get(f"{m}.weight_scale")
        return q, s, self.group_for(m)

    def shape(self, m: str) -> tuple[int, int]:
        return self.packed.shape(m) if self.packed else tuple(self.ckpt.tensors[f"{m}.weight"].shape)

    def blob(self, m: str) -> torch.Tensor | None:
        """Module m's blob as stored, where torch's KleidiAI path can run it; else None (pack on the fly).
        Not one with a bias inside: the references here leave biases out."""
        from . import kleidiai

        if not (self.packed and kleidiai.native_kleidiai_available()):
            return None
        return None if self.packed.prov.get(f"{m}.{sf.SUFFIX}", {}).get("bias") else self.packed.blob(m)

    def dequant(self, m: str) -> torch.Tensor:
        q, s, g = self.weight(m)
        return dequantize_w4a8(q, s, g)


def _module_groups(ckpt: Checkpoint, q: dict, modules: list[str], problems: _Problems) -> dict[str, int]:
    """Each module's group from the config group whose targets name it (vLLM resolves one per module:
    a module named by two groups, or by none, is a problem)."""
    from .formats.compressed_tensors import CompressedTensorsReader

    schemes = CompressedTensorsReader(ckpt, q).schemes
    out = {}
    for m in modules:
        ranked = sorted((r, i) for i, sc in enumerate(schemes) if (r := sc.match_rank(m)) is not None)
        if not ranked:
            problems.add(m, "no quantization_config group targets this module (vLLM would not quantise it)")
            continue
        if len(ranked) > 1 and ranked[1][0] == ranked[0][0]:
            problems.add(m, f"targeted by config groups {schemes[ranked[0][1]].name} and "
                            f"{schemes[ranked[1][1]].name}: one scheme per module")
        sc = schemes[ranked[0][1]]
        out[m] = -1 if sc.strategy == "channel" else int(sc.group_size or -1)
    return out


def _layer_index(prefix: str) -> int:
    m = _LAYER.search(prefix + ".")
    return int(m.group(1)) if m else -1


# --------------------------------------------------------------------------------- structural


def _check_module(t: _Target, m: str, problems: _Problems, counts: dict) -> None:
    ck = t.ckpt
    if t.packed:
        probs, dec = t.packed.check_blob(m)
        for p in probs:
            problems.add(f"{m}.{sf.SUFFIX}", p)
        if dec is not None:
            counts["blobs"] += 1
            if t.packed.group(m) != t.group_for(m):
                problems.add(f"{m}.{sf.SUFFIX}", f"packed with group {t.packed.group(m)}, but the config's group "
                                                 f"for the module is {t.group_for(m)} (-1: channel)")
            _check_values(m, f"{m}.{sf.SUFFIX}", f"{m}.{sf.SUFFIX} (scales)", dec[0], dec[1].float(), problems, counts)
        return
    wn, sn = f"{m}.weight", f"{m}.weight_scale"
    if wn not in ck.tensors:
        problems.add(m, f"{sn} present but {wn} missing")
        return
    wi, si = ck.tensors[wn], ck.tensors[sn]
    if wi.dtype != "I8" or len(wi.shape) != 2:
        problems.add(m, f"{wn}: {wi.dtype}{list(wi.shape)}, expected int8 [N, K]")
        return
    n, k = wi.shape
    g = t.group_for(m)
    if g == -1:
        want_dt, want_shape = "F32", (n, 1)
    else:
        want_dt, want_shape = "BF16", (n, k // g if k % g == 0 else -1)
        why = check_group_size(g, k)
        if why:
            problems.add(m, f"group size {g} invalid for K={k}: {why}")
    if si.dtype != want_dt or tuple(si.shape) != want_shape:
        problems.add(m, f"{sn}: {si.dtype}{list(si.shape)}, expected {want_dt}{list(want_shape)} "
                        f"({'channel' if g == -1 else f'group {g}'}); another dtype makes torch fall back silently")
        return
    _check_values(m, wn, sn, ck.get(wn), ck.get(sn).float(), problems, counts)


def _check_values(m: str, wn: str, sn: str, q: torch.Tensor, s: torch.Tensor, problems: _Problems,
                  counts: dict) -> None:
    lo, hi = (int(v) for v in torch.aminmax(q)) if q.numel() else (0, 0)
    if lo < -8 or hi > 7:
        problems.add(m, f"{wn}: values in [{lo}, {hi}], outside int4 [-8, 7]")
    if not bool(torch.isfinite(s).all()):
        problems.add(m, f"{sn}: {int((~torch.isfinite(s)).sum())} non-finite scale(s)")
    elif s.numel() and float(s.min()) <= 0:
        problems.add(m, f"{sn}: {int((s <= 0).sum())} scale(s) <= 0 (symmetric scales must be positive)")
    counts["modules"] += 1
    counts["int_values"] += q.numel()


def _check_layers(t: _Target, problems: _Problems) -> None:
    want = t.num_experts
    prefixes = sorted(set(t.layers) | set(t.routers), key=lambda p: (_layer_index(p), p))
    for p in prefixes:
        experts = t.layers.get(p, {})
        if p not in t.routers:
            problems.add(p, "experts without a router weight")
        n = want or ((max(experts) + 1) if experts else 0)
        missing = [e for e in range(n) if e not in experts]
        if missing:
            problems.add(p, f"expert(s) {missing[:8]}{' ...' if len(missing) > 8 else ''} missing "
                            f"({len(experts)} of {n} present; config says {want})")
        extra = [e for e in experts if e >= n]
        if extra:
            problems.add(p, f"expert(s) {extra[:8]} beyond the config's {n} experts")
        for e, slot in sorted(experts.items()):
            lack = [r for r in ("gate", "up", "down") if r not in slot]
            if lack:
                problems.add(f"{p}.experts.{e}", f"no W4A8 {'/'.join(lack)} projection")
        schemes = {t.groups.get(m) for slot in experts.values() for m in slot.values()}
        if len(schemes) > 1:  # vLLM's MoE method runs one scheme for w13 and w2 of every expert
            problems.add(p, f"experts under several config groups (group sizes {sorted(map(str, schemes))}); "
                            "vLLM takes one scheme per MoE layer")


def _check_config_index(t: _Target, problems: _Problems) -> None:
    ck = t.ckpt
    quant = set(t.modules)
    for m in t.ignore:
        if m in quant:
            problems.add(m, "listed in quantization_config.ignore but stored as W4A8 (vLLM would misload it)")
    for name, info in ck.tensors.items():
        if name.endswith(".weight") and info.dtype == "I8" and name[:-7] not in quant:
            problems.add(name, "int8 weight without a weight_scale")
    nl = ck.text_config.get("num_hidden_layers")
    if isinstance(nl, int):
        seen = {_layer_index(n) for n in ck.tensors} - {-1}
        missing = sorted(set(range(nl)) - seen)
        if missing:
            problems.add("config", f"num_hidden_layers={nl} but no tensors for layer(s) {missing[:8]}")


def _check_hashes(ckpt: Checkpoint, problems: _Problems) -> dict | None:
    """Shard checksums recorded by convert; returns the report (or None)."""
    from . import kernels
    from .writer import digest_kind, hash_shard

    rp = ckpt.folder / "int4pack_report.json"
    if not rp.is_file():
        return None
    try:
        report = json.loads(rp.read_text())
    except (OSError, json.JSONDecodeError) as e:
        problems.add("int4pack_report.json", f"unreadable ({e})")
        return None
    for shard, rec in (report.get("shards") or {}).items():
        if not isinstance(rec, dict) or "data_digest" not in rec:
            continue
        path = ckpt.folder / shard
        if not path.is_file():
            problems.add(shard, "listed in int4pack_report.json but missing")
            continue
        if digest_kind(rec["data_digest"]) == "crc32c" and kernels.ext() is None:
            continue  # without the extension CRC-32C is a Python byte loop (hours on a large model)
        got = hash_shard(path, rec["data_digest"])
        if got["data_digest"] != rec["data_digest"] or got["size"] != rec.get("size", got["size"]):
            problems.add(shard, "tensor bytes differ from what convert wrote (data checksum mismatch with "
                                "int4pack_report.json): the shard was modified or corrupted")
    return report


# --------------------------------------------------------------------------------- the source


class _Source:
    """The source checkpoint read by int4pack's own readers, plus convert's per-module budgets."""

    def __init__(self, path, revision):
        from .architectures import vllm_output_names
        from .formats import open_reader

        self.label = str(path)
        self.ckpt = Checkpoint(resolve_source(path, revision=revision))
        self.reader = open_reader(self.ckpt)
        # keyed by the output's module names (convert renames some families for vLLM)
        ren = {k[:-7]: v[:-7] for k, v in vllm_output_names(
            self.ckpt.model_type, [f"{m}.weight" for m in self.reader.linears()]).items()}
        self.specs = {ren.get(m, m): s for m, s in self.reader.linears().items()}
        try:
            from .plan import make_plan

            plan = make_plan(self.ckpt)
            self.paths = {ren.get(m, m): p for j in plan.jobs for m, p in j.paths.items()}
        except Int4packError:
            self.paths = {}
        self._cache: dict[str, object] = {}

    def read(self, m: str):
        if m not in self._cache:
            if m not in self.specs:
                raise InputError(f"{m}: not a quantised module of the source {self.label}", tensor=m,
                                 hint="--against must be the checkpoint this output was converted from.")
            self._cache[m] = self.reader.read(self.specs[m])
        return self._cache[m]

    def dequant(self, m: str) -> torch.Tensor:
        return self.read(m).dequantize()

    def g_idx_perm(self, m: str) -> torch.Tensor | None:
        ql = self.read(m)
        if ql.g_idx is None or ql.has_trivial_g_idx():
            return None
        return torch.argsort(ql.g_idx.long(), stable=True)

    def close(self):
        self._cache.clear()
        self.ckpt.close()


def _rtn_rel(w: torch.Tensor, g: int) -> float:
    """rel_l2 of plain absmax round-to-nearest at the target group (scales rounded as shipped)."""
    n, k = w.shape
    gg = k if g == -1 else g
    wg = w.reshape(n, k // gg, gg)
    s = wg.abs().amax(2, keepdim=True) / 7
    s = (s.to(torch.bfloat16).float() if g != -1 else s).clamp(min=2.0**-126)
    q = (wg / s).round().clamp(-8, 7)
    return _rel((q * s).reshape(n, k), w)


def _budget(m: str, w_src: torch.Tensor, g: int, report: dict | None, src: _Source) -> tuple[float, str]:
    """Allowed weight rel_l2 of module m against the source, and where the number comes from."""
    rec = ((report or {}).get("modules") or {}).get(m)
    if isinstance(rec, dict) and rec.get("rel_l2") not in (None, ""):
        return float(rec["rel_l2"]) * (1 + REL_MARGIN) + ABS_FLOOR, "report"
    path = src.paths.get(m, "requant")
    if path == "reemit":
        return ABS_FLOOR, "reemit (exact)"
    if path in ("lossless", "fold"):
        return (ABS_FLOOR if g == -1 else LOSSLESS_BOUND), f"{path} (scale cast)"
    return _rtn_rel(w_src, g) * (1 + REL_MARGIN) + ABS_FLOOR, "requant (<= absmax RTN)"


# --------------------------------------------------------------------------------- inputs


def _norm_weight(ckpt: Checkpoint, prefix: str, names: tuple[str, ...]) -> torch.Tensor | None:
    parent = prefix.rsplit(".", 1)[0]
    for n in names:
        key = f"{parent}.{n}.weight"
        if key in ckpt.tensors:
            return ckpt.get(key).float()
    return None


def _hidden(gen: torch.Generator, t: int, h: int, norm: torch.Tensor | None) -> torch.Tensor:
    x = torch.randn(t, h, generator=gen)
    x = x / x.pow(2).mean(1, keepdim=True).sqrt()
    return x * norm if norm is not None and norm.numel() == h else x


def _route(x, router_w, sampled: list[int], top_k: int, renorm: bool, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k among the sampled experts from the real router; every sampled expert gets slots."""
    t = x.shape[0]
    k = min(top_k, len(sampled))
    if router_w is not None:
        logits = x @ router_w.float()[sampled].t()
    else:
        logits = torch.randn(t, len(sampled), generator=gen)
    probs = torch.softmax(logits, dim=1)
    w, ids = probs.topk(k, dim=1)
    # guarantee coverage: give an expert with too few slots the last slot of tokens lacking it
    for e in range(len(sampled)):
        have = int((ids == e).sum())
        if have >= MIN_SLOTS_PER_EXPERT:
            continue
        cand = [i for i in torch.randperm(t, generator=gen).tolist() if not bool((ids[i] == e).any())]
        for i in cand[: MIN_SLOTS_PER_EXPERT - have]:
            ids[i, k - 1] = e
            w[i, k - 1] = probs[i, e]
    if renorm:
        w = w / w.sum(1, keepdim=True)
    return ids, w


def _pick(seq: list, n: int | None, gen: torch.Generator) -> list:
    if n is None or n >= len(seq):
        return list(seq)
    idx = sorted(torch.randperm(len(seq), generator=gen)[:n].tolist())
    return [seq[i] for i in idx]


# --------------------------------------------------------------------------------- numerics


class _Clock:
    def __init__(self):
        self.s = {"reference": 0.0, "kernel": 0.0, "pack": 0.0, "read": 0.0, "prediction": 0.0}

    @contextmanager
    def __call__(self, what: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.s[what] += time.perf_counter() - t0


def _weights_vs_source(t: _Target, src: _Source, mods: dict[str, str], report, clock):
    """Source float weights aligned with the converted ones (undoing an act-order fold), per-module
    measured rel_l2 and budget. mods: role -> module name of one MLP."""
    with clock("read"):
        conv = {r: t.dequant(m) for r, m in mods.items()}
        srcw = {r: src.dequant(m) for r, m in mods.items()}
    perm = src.g_idx_perm(mods["down"]) if "down" in mods else None
    if perm is not None:
        # a fold permuted the intermediate dim: keep it only if it explains the converted weights
        alt = {"gate": srcw["gate"][perm], "up": srcw["up"][perm], "down": srcw["down"][:, perm]}
        if _rel(conv["down"], alt["down"]) < _rel(conv["down"], srcw["down"]):
            srcw = alt
    stats, problems = {}, []
    for r, m in mods.items():
        g = t.group_for(m)
        meas = _rel(conv[r], srcw[r])
        bud, why = _budget(m, srcw[r], g, report, src)
        stats[r] = {"module": m, "rel_l2": meas, "budget": bud, "budget_from": why}
        if not meas <= bud:
            problems.append(f"{m}: weight rel_l2 {meas:.4g} vs the source exceeds its budget {bud:.4g} ({why})")
    return conv, srcw, problems, stats


def _moe_layer(t: _Target, prefix: str, src: _Source | None, report, experts_n, tokens, gen, clock) -> dict:
    experts = t.layers[prefix]
    ids_all = sorted(experts)
    sampled = _pick(ids_all, experts_n, gen)
    e_s = len(sampled)
    ck = t.ckpt
    res: dict = {"layer": prefix, "kind": "moe", "experts": len(ids_all), "experts_checked": e_s, "problems": []}
    router = t.routers.get(prefix)
    with clock("read"):
        rw = ck.get(router).float() if router else None
        norm = _norm_weight(ck, prefix, _NORMS)
    k_top = min(t.top_k, e_s)
    n_tok = tokens or max(32, -(-MIN_SLOTS_PER_EXPERT * 2 * e_s // k_top))
    x = _hidden(gen, n_tok, t.shape(experts[ids_all[0]]["gate"])[1], norm)
    ids, wts = _route(x, rw, sampled, t.top_k, t.norm_topk, gen)
    res["tokens"] = n_tok
    res["router"] = "real" if rw is not None else "random logits"
    res["input_norm"] = norm is not None

    use_blobs = t.blob(experts[ids_all[0]]["gate"]) is not None
    res["weights"] = "the checkpoint's KleidiAI blobs" if use_blobs else "packed on the fly"
    hidden = x.shape[1]
    k_slots = ids.shape[1]
    slots_c = torch.zeros(n_tok, k_slots, hidden)
    slots_s = torch.zeros(n_tok, k_slots, hidden) if src is not None else slots_c
    act_var = torch.zeros(n_tok, k_slots)
    w_var = torch.zeros(n_tok, k_slots)
    w13p = w2p = None
    wstats: dict[int, dict] = {}
    inter = None
    # one expert at a time: a 128-expert layer's float weights would be ~2.4 GB at once
    for i, e in enumerate(sampled):
        slot = experts[e]
        if not use_blobs:
            with clock("read"):
                qg, sg, _ = t.weight(slot["gate"])
                qu, su, _ = t.weight(slot["up"])
                qd, sd, _ = t.weight(slot["down"])
            inter = qd.shape[1]
            g = t.moe_group(slot)
            with clock("pack"):
                b13 = moe_mod.pack_for_matmul(torch.cat([qg, qu]), torch.cat([sg, su]), g,
                                              None if w13p is None else w13p[i])
                b2 = moe_mod.pack_for_matmul(qd, sd, g, None if w2p is None else w2p[i])
                if w13p is None:
                    w13p = torch.empty((e_s, b13.numel()), dtype=b13.dtype)
                    w2p = torch.empty((e_s, b2.numel()), dtype=b2.dtype)
                if b13.data_ptr() != w13p[i].data_ptr():
                    w13p[i] = b13
                if b2.data_ptr() != w2p[i].data_ptr():
                    w2p[i] = b2
        if src is not None:
            cw, sw, probs, st = _weights_vs_source(t, src, slot, report, clock)
            res["problems"] += [f"expert {e}: {p}" for p in probs]
            wstats[e] = st
            wv = [st[r]["budget"] ** 2 * float(sw[r].double().pow(2).mean()) for r in ("gate", "up", "down")]
        else:
            with clock("read"):
                cw = {r: t.dequant(m) for r, m in slot.items()}
        inter = cw["down"].shape[1]
        tt, jj = (ids == i).nonzero(as_tuple=True)
        xe = x[tt]
        g2 = wts[tt, jj] ** 2
        w13c = torch.cat([cw["gate"], cw["up"]])
        with clock("reference"):
            slots_c[tt, jj] = moe_mod.expert_forward(xe, w13c, cw["down"], t.activation)
            if src is not None:
                w13s = torch.cat([sw["gate"], sw["up"]])
                slots_s[tt, jj] = moe_mod.expert_forward(xe, w13s, sw["down"], t.activation)
        with clock("prediction"):
            act_var[tt, jj] = moe_mod.expert_noise(xe, w13c, cw["down"], t.activation) * g2
            if src is not None:
                w_var[tt, jj] = moe_mod.expert_noise(xe, w13s, sw["down"], t.activation, activations=False,
                                                     weight_var=wv) * g2
    g = t.moe_group(experts[sampled[-1]])
    if use_blobs:
        # vLLM's w13 of an expert is its gate blob then its up blob (8-row blocks: serve_format.py)
        with clock("read"):
            w13p = torch.stack([torch.cat([t.blob(experts[e]["gate"]), t.blob(experts[e]["up"])]) for e in sampled])
            w2p = torch.stack([t.blob(experts[e]["down"]) for e in sampled])
    with clock("kernel"):
        y_k = moe_mod.moe_forward(x, ids, wts, w13p, w2p, hidden, inter, g, False, t.activation)
    y_c = (slots_c * wts.unsqueeze(2)).sum(1)
    y_s = (slots_s * wts.unsqueeze(2)).sum(1) if src is not None else y_c

    ref_norm = float(y_s.double().norm())
    act_rel = _rel(y_k, y_c)
    act_pred = math.sqrt(float(act_var.sum())) / max(float(y_c.double().norm()), 1e-30)
    res.update(rel_l2=_rel(y_k, y_s), max_abs=float((y_k - y_s).abs().max()), cosine=_cos(y_k, y_s),
               act_rel=act_rel, act_pred=act_pred, act_ratio=act_rel / act_pred if act_pred > 0 else None)
    if act_rel > K_ACT * act_pred + ABS_FLOOR:
        res["problems"].append(f"activation-quantisation error {act_rel:.4g} exceeds {K_ACT} x its predicted "
                               f"{act_pred:.4g}: the kernel or the packed weights disagree with the int4 tensors")
    tol = K_ACT * act_pred
    if src is not None:
        w_rel = _rel(y_c, y_s)
        w_pred = math.sqrt(float(w_var.sum())) / max(ref_norm, 1e-30)
        res.update(weight_rel=w_rel, weight_pred=w_pred)
        tol = math.hypot(K_ACT * act_pred, K_WEIGHT * w_pred)
        worst = None
        for i, e in enumerate(sampled):
            mask = ids == i
            a, b = slots_c[mask], slots_s[mask]
            we = _rel(a, b)
            pe = _expert_pred(w_var, wts, mask, b)
            wstats[e]["output_rel"] = we
            wstats[e]["output_pred"] = pe
            wstats[e]["slots"] = int(mask.sum())
            if worst is None or we / max(pe, 1e-30) > worst[1]:
                worst = (e, we / max(pe, 1e-30), we, pe)
            if we > K_WEIGHT * pe + ABS_FLOOR:
                res["problems"].append(
                    f"expert {e}: output on its {int(mask.sum())} routed token(s) deviates from the source by "
                    f"{we:.4g} (allowed {K_WEIGHT} x {pe:.4g} from the weight budgets)")
        if worst:
            res["worst_expert"] = {"expert": worst[0], "output_rel": worst[2], "output_pred": worst[3]}
        res["expert_stats"] = {str(e): s for e, s in wstats.items()}
    res["tolerance"] = tol
    if res["rel_l2"] > tol + ABS_FLOOR:
        res["problems"].append(f"layer output error {res['rel_l2']:.4g} exceeds the tolerance {tol:.4g}")
    res["ok"] = not res["problems"]
    return res


def _expert_pred(w_var: torch.Tensor, wts: torch.Tensor, mask: torch.Tensor, ref_slots: torch.Tensor) -> float:
    """Predicted relative output error of one expert's (ungated) outputs from its weight budgets."""
    v = w_var[mask] / (wts[mask] ** 2).clamp(min=1e-30)  # predicted_noise gated by g^2: undo it
    den = float(ref_slots.double().norm())
    return math.sqrt(float(v.sum())) / den if den > 0 else 0.0


def _dense(t: _Target, m: str, src: _Source | None, report, tokens: int, gen, clock) -> dict:
    res: dict = {"module": m, "kind": "dense", "problems": []}
    with clock("read"):
        q, s, g = t.weight(m)
        w_c = dequantize_w4a8(q, s, g)
    n, k = q.shape
    norm = None
    if m.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value"):
        norm = _norm_weight(t.ckpt, m.rsplit(".", 1)[0], ("input_layernorm",))
    elif m.rsplit(".", 1)[-1] in ("gate_proj", "up_proj"):
        norm = _norm_weight(t.ckpt, m.rsplit(".", 1)[0], _NORMS)
    x = _hidden(gen, tokens, k, norm)
    with clock("pack"):
        wp = t.blob(m)
        if wp is None:
            wp = moe_mod.pack_for_matmul(q, s, g)
    with clock("kernel"):
        y_k = torch.ops.aten._dyn_quant_matmul_4bit(x, wp, k if g == -1 else g, k, n)
    with clock("reference"):
        y_c = x @ w_c.t()
    step2 = moe_mod.int8_step(x) ** 2 / 12
    act_pred = math.sqrt(float(step2.sum()) * float(w_c.double().pow(2).sum())) / max(float(y_c.double().norm()), 1e-30)
    act_rel = _rel(y_k, y_c)
    res.update(act_rel=act_rel, act_pred=act_pred, act_ratio=act_rel / act_pred if act_pred else None)
    if act_rel > K_ACT * act_pred + ABS_FLOOR:
        res["problems"].append(
            f"activation-quantisation error {act_rel:.4g} exceeds {K_ACT} x predicted {act_pred:.4g}")
    tol = K_ACT * act_pred
    y_s = y_c
    if src is not None:
        with clock("read"):
            w_s = src.dequant(m)
        meas = _rel(w_c, w_s)
        bud, why = _budget(m, w_s, g, report, src)
        if not meas <= bud:
            res["problems"].append(f"weight rel_l2 {meas:.4g} vs the source exceeds its budget {bud:.4g} ({why})")
        with clock("reference"):
            y_s = x @ w_s.t()
        w_pred = bud * math.sqrt(float(w_s.double().pow(2).mean()) * float(x.double().pow(2).sum()) * n) \
            / max(float(y_s.double().norm()), 1e-30)
        w_rel = _rel(y_c, y_s)
        res.update(weight_rel=w_rel, weight_pred=w_pred, weight_l2=meas, budget=bud)
        tol = math.hypot(K_ACT * act_pred, K_WEIGHT * w_pred)
        if w_rel > K_WEIGHT * w_pred + ABS_FLOOR:
            res["problems"].append(
                f"output deviates from the source by {w_rel:.4g} (allowed {K_WEIGHT} x {w_pred:.4g})")
    res.update(rel_l2=_rel(y_k, y_s), max_abs=float((y_k - y_s).abs().max()), cosine=_cos(y_k, y_s), tolerance=tol)
    if res["rel_l2"] > tol + ABS_FLOOR:
        res["problems"].append(f"output error {res['rel_l2']:.4g} exceeds the tolerance {tol:.4g}")
    res["ok"] = not res["problems"]
    return res


# --------------------------------------------------------------------------------- entry point


def _select_layers(prefixes: list[str], layers, gen) -> list[str]:
    if layers is None or layers == "all":
        return prefixes
    if isinstance(layers, int):
        return _pick(prefixes, layers, gen)
    if isinstance(layers, str):
        layers = [int(s) for s in layers.replace(" ", "").split(",") if s]
    want = {int(v) for v in layers}
    return [p for p in prefixes if _layer_index(p) in want]


def verify(out, against=None, *, tokens: int | None = None, layers=None, experts: int | None = None,
           seed: int = 0, threads: int | None = None, structural_only: bool = False, dense: bool = True,
           dense_tokens: int = 8, revision: str | None = None, raise_on_failure: bool = True) -> dict:
    """Check a converted W4A8 checkpoint; returns the report, raises VerifyFailed when it fails.

    ``layers``: None/"all", a count (seeded sample) or layer indices ("0,3" or [0, 3]);
    ``experts``: per-layer sample size (default all); ``tokens``: rows per MoE layer (default enough
    for every sampled expert to get >= 2 slots, at least 32). The VerifyFailed carries ``.report``.
    """
    t0 = time.perf_counter()
    folder = resolve_source(out, revision=revision)
    if not (Path(folder) / "config.json").is_file():
        raise InputError(f"{folder}: no config.json", path=str(folder))
    problems = _Problems()
    report: dict = {"output": str(out), "against": None if against is None else str(against), "seed": seed,
                    "threads": threads or torch.get_num_threads(), "tolerance": {
                        "k_act": K_ACT, "k_weight": K_WEIGHT, "lossless_bound": LOSSLESS_BOUND,
                        "rule": "act_rel <= k_act * predicted int8 noise; module weight rel_l2 <= budget "
                                "(report, or 2^-8 lossless / absmax RTN requant); expert output error <= "
                                "k_weight * predicted from budgets; layer rel_l2 <= hypot of both"}}
    clock = _Clock()
    try:
        ckpt = Checkpoint(folder)
    except InputError as e:
        report.update(ok=False, structural={"ok": False, "problems": [{"where": "checkpoint", "message": str(e)}]},
                      layers=[], dense=[])
        return _finish(report, t0, clock, raise_on_failure)
    with _threads(threads), ckpt:
        ts = time.perf_counter()
        t = _Target(ckpt, problems)
        counts = {"modules": 0, "int_values": 0, "blobs": 0, "moe_layers": len(t.layers),
                  "experts": sum(len(v) for v in t.layers.values())}
        for m in t.modules:
            _check_module(t, m, problems, counts)
        _check_layers(t, problems)
        _check_config_index(t, problems)
        conv_report = _check_hashes(ckpt, problems)
        report["structural"] = {"ok": not problems, "problems": problems.items, "counts": counts,
                                "seconds": round(time.perf_counter() - ts, 3),
                                "serve_format": sf.KLEIDIAI if t.packed else sf.PLAIN}
        report["layers"], report["dense"] = [], []
        report["kernel"] = _kernel_info()
        if not structural_only:
            src = _Source(against, revision) if against is not None else None
            gen = torch.Generator().manual_seed(seed)
            bad = {p["where"] for p in problems.items}
            try:
                moe_prefixes = sorted(t.layers, key=lambda p: (_layer_index(p), p))
                chosen = _select_layers(moe_prefixes, layers, gen)
                for p in chosen:
                    if any(w == p or w.startswith(p + ".") for w in bad):
                        report["layers"].append({"layer": p, "kind": "moe", "ok": False, "skipped": True,
                                                 "problems": ["structural problems (see above): not run"]})
                        continue
                    report["layers"].append(_moe_layer(t, p, src, conv_report, experts, tokens, gen, clock))
                if dense:
                    idx = {_layer_index(p) for p in chosen}
                    for m in t.modules:
                        if t.roles[m] == "expert" or (layers is not None and _layer_index(m) not in idx):
                            continue
                        if any(w == m for w in bad):
                            continue
                        report["dense"].append(_dense(t, m, src, conv_report, dense_tokens, gen, clock))
            finally:
                if src is not None:
                    src.close()
    report["ok"] = report["structural"]["ok"] and all(r["ok"] for r in report["layers"] + report["dense"])
    return _finish(report, t0, clock, raise_on_failure)


def _kernel_info() -> dict:
    from . import kleidiai

    ext = moe_mod.extension()
    return {"matmul": "kleidiai" if kleidiai.native_kleidiai_available() else "torch reference (x86 fallback)",
            "moe_op": "csrc/moe.cpp" if ext is not None else "python twin"}


def _finish(report: dict, t0: float, clock: _Clock, raise_on_failure: bool) -> dict:
    report["timing"] = {k: round(v, 4) for k, v in clock.s.items()}
    report["timing"]["total"] = round(time.perf_counter() - t0, 4)
    fails = [r for r in report.get("layers", []) + report.get("dense", []) if not r.get("ok")]
    st = report.get("structural", {})
    n_l = len(report.get("layers", []))
    worst = max((r.get("rel_l2") or 0 for r in report.get("layers", [])), default=None)
    if report.get("ok"):
        report["verdict"] = (f"PASS: structure ok, {n_l} MoE layer(s) and {len(report.get('dense', []))} dense "
                             f"linear(s) within tolerance (worst layer rel_l2 {_fmt(worst)})")
    else:
        parts = []
        if not st.get("ok", False):
            parts.append(f"{len(st.get('problems', []))} structural problem(s)")
        if fails:
            names = [r.get("layer") or r.get("module") for r in fails]
            parts.append(f"{len(fails)} layer(s)/linear(s) out of tolerance ({', '.join(names[:3])}"
                         f"{' ...' if len(names) > 3 else ''})")
        report["verdict"] = "FAIL: " + "; ".join(parts)
    if not report.get("ok") and raise_on_failure:
        first = next((p for p in st.get("problems", [])), None)
        detail = f"{first['where']}: {first['message']}" if first else next(
            (f"{r.get('layer') or r.get('module')}: {r['problems'][0]}" for r in fails if r.get("problems")), "")
        err = VerifyFailed(f"{report['verdict']}. First: {detail}",
                           hint="Re-run convert (the output is damaged or differs from its source), or see "
                                "--json for every per-layer figure.")
        err.report = report
        raise err
    return report
