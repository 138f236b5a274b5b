"""verify's random inputs: hidden states scaled by the layer's input norm, routed by the layer's
own router (every sampled expert gets slots), the experts and layers sampled, and the rows of a
dense module. Every draw comes from one generator, in a fixed order, so a seed gives one check."""

from __future__ import annotations

import torch

from .. import routing as rt
from ..architectures import layer_index
from ..sources.checkpoint import Checkpoint
from ..families import layer_moe
from .w4a8_output import W4A8Output

__all__ = ["NORMS", "MIN_SLOTS_PER_EXPERT", "norm_weight", "hidden", "route", "pick", "default_tokens", "moe_inputs",
           "dense_input"]

MIN_SLOTS_PER_EXPERT = 2
NORMS = ("post_attention_layernorm", "pre_feedforward_layernorm", "ffn_norm")


def norm_weight(ckpt: Checkpoint, prefix: str, names: tuple[str, ...], offset: float = 0.0) -> torch.Tensor | None:
    """The RMSNorm gain in front of ``prefix`` (``offset`` 1: the model scales by 1 + weight, as
    Qwen3-Next and Qwen3.5 do); None when absent or zero everywhere (it would zero the input)."""
    parent = prefix.rsplit(".", 1)[0]
    for n in names:
        key = f"{parent}.{n}.weight"
        if key in ckpt.tensors:
            g = ckpt.get(key).float() + offset
            return g if bool(g.abs().amax() > 0) else None
    return None


def hidden(gen: torch.Generator, t: int, h: int, norm: torch.Tensor | None) -> torch.Tensor:
    x = torch.randn(t, h, generator=gen)
    x = x / x.pow(2).mean(1, keepdim=True).sqrt()
    return x * norm if norm is not None and norm.numel() == h else x


def route(x, router_w, sampled: list[int], top_k: int, renorm: bool, gen, scoring: str = "softmax",
           bias: torch.Tensor | None = None, *, routing: rt.Routing | None = None,
           per_expert_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k among the sampled experts from the real router, scored as the family scores (softmax,
    sigmoid or sqrt-softplus of the logits, soft-capped where the layer caps them; the score bias
    choosing but not weighting); every sampled expert gets slots; the weights renormalised, then
    times the per-expert scale and the routed scaling of ``routing`` (the layer's table row).
    Groups and hash tables are not applied among a sample of the experts (they decide which
    experts run, not how): the kernel and the float reference take the same ids and weights, and
    the comparison is of the experts."""
    t = x.shape[0]
    k = min(top_k, len(sampled))
    if router_w is not None:
        logits = x @ router_w.float()[sampled].t()
    else:
        logits = torch.randn(t, len(sampled), generator=gen)
    if routing is not None:
        scoring = routing.scoring
        if routing.softcap:
            logits = torch.tanh(logits / routing.softcap) * routing.softcap
    probs = rt.scores(logits.float(), scoring)
    choice = probs + bias.float()[sampled] if bias is not None else probs
    ids = choice.topk(k, dim=1).indices
    w = probs.gather(1, ids)
    # guarantee coverage: give an expert with too few slots slots of tokens lacking it, the last
    # (lowest-scored) slots first, taken from experts that keep enough without them; only when none
    # can spare one, the last slot of any token lacking it
    count = torch.bincount(ids.reshape(-1), minlength=len(sampled)).tolist()
    for e in range(len(sampled)):
        if count[e] >= MIN_SLOTS_PER_EXPERT:
            continue
        lacking = (~(ids == e).any(1)).tolist()
        order = [i for i in torch.randperm(t, generator=gen).tolist() if lacking[i]]
        for j, spare_only in [(j, True) for j in range(k - 1, -1, -1)] + [(k - 1, False)]:
            for i in order:
                had = int(ids[i, j])
                if count[e] >= MIN_SLOTS_PER_EXPERT:
                    break
                if not lacking[i] or (spare_only and count[had] <= MIN_SLOTS_PER_EXPERT):
                    continue
                count[had] -= 1
                count[e] += 1
                lacking[i] = False
                ids[i, j] = e
                w[i, j] = probs[i, e]
    if renorm:
        w = w / w.sum(1, keepdim=True)
    if routing is not None and routing.per_expert_scale and per_expert_scale is not None:
        w = w * per_expert_scale.float()[sampled][ids]
    if routing is not None and routing.scale != 1.0:
        w = w * routing.scale
    return ids, w


def pick(seq: list, n: int | None, gen: torch.Generator) -> list:
    if n is None or n >= len(seq):
        return list(seq)
    idx = sorted(torch.randperm(len(seq), generator=gen)[:n].tolist())
    return [seq[i] for i in idx]


def default_tokens(experts: int, top_k: int) -> int:
    """Rows per MoE layer by default: a quarter more slots than MIN_SLOTS_PER_EXPERT for each sampled
    expert (the routing gives the short ones slots of experts with more to spare), at least 32.
    Each slot costs a row through torch's matmul, the scalar reference kernel on x86."""
    return max(32, -(-5 * MIN_SLOTS_PER_EXPERT * experts // (4 * top_k)))


def moe_inputs(output: W4A8Output, prefix: str, experts_n, tokens, gen, clock) -> dict:
    """Everything random about one MoE layer's check: its sampled experts, hidden states and routing
    (drawn layer after layer from one generator, so a seed gives the same check however many
    layers then run at once)."""
    experts = output.layers[prefix]
    ids_all = sorted(experts)
    sampled = pick(ids_all, experts_n, gen)
    e_s = len(sampled)
    ck = output.ckpt
    res: dict = {"layer": prefix, "kind": "moe", "experts": len(ids_all), "experts_checked": e_s,
                 "experts_sampled": list(sampled), "problems": []}
    router = output.routers.get(prefix)
    row = layer_moe(ck.family_type, ck.text_config, layer_index(prefix)) or layer_moe(ck.family_type, ck.text_config)
    r = row.routing if row else None
    with clock("read"):
        rw = ck.get(router).float() if router else None
        norm = norm_weight(ck, prefix, NORMS, output.norm_offset)
        wants_bias = r.bias if r is not None else output.routing.get("bias")
        bias_name = next((n for n in (f"{prefix}.gate.e_score_correction_bias", f"{prefix}.e_score_correction_bias",
                                      f"{prefix}.experts.e_score_correction_bias", f"{prefix}.gate.bias",
                                      f"{prefix}.router_bias")
                          if n in ck.tensors), None) if wants_bias else None
        bias = ck.get(bias_name).float() if bias_name else None
        pes_name = f"{prefix}.router.per_expert_scale"  # Gemma-4: the MoE block is the decoder layer
        pes = ck.get(pes_name).float() if r is not None and r.per_expert_scale and pes_name in ck.tensors else None
    k_top = min(output.top_k, e_s)
    n_tok = tokens or default_tokens(e_s, k_top)
    x = hidden(gen, n_tok, output.shape(experts[ids_all[0]]["gate"])[1], norm)
    scoring = (r.scoring if r is not None else output.routing.get("scoring")) or "softmax"
    # a latent MoE (Kimi-K3: experts at routed_expert_hidden_size, the router at the model's hidden
    # size) routes hidden states of its own width: they pick the experts' inputs, nothing more
    latent = rw is not None and rw.shape[1] != x.shape[1]
    xr = hidden(gen, n_tok, rw.shape[1], None) if latent else x
    ids, wts = route(xr, rw, sampled, output.top_k, output.norm_topk, gen, scoring, bias, routing=r,
                     per_expert_scale=pes)
    res["tokens"] = n_tok
    res["min_slots"] = int(torch.bincount(ids.reshape(-1), minlength=e_s).min()) if e_s else 0
    res["router"] = ("real, on hidden states of its own size" if latent else "real") if rw is not None \
        else "random logits"
    res["scoring"] = scoring + (" + score bias" if bias is not None else "") + \
        (" + per-expert scale" if pes is not None else "") + (f", soft-capped {r.softcap:g}" if r and r.softcap else "")
    if row is not None:  # the model's activation, and the one the W4A8 op and the reference ran
        res["activation"] = row.activation.describe()
        if row.activation.kernel_kind is None:
            res["activation"] += " (not one of the W4A8 op's: each expert's two matmuls run apart, with it between)"
    res["input_norm"] = norm is not None
    return {"res": res, "sampled": sampled, "x": x, "ids": ids, "wts": wts}


def dense_input(output: W4A8Output, m: str, tokens: int, gen) -> torch.Tensor:
    """The random rows a dense module is checked on (drawn in module order, before any runs)."""
    k = output.shape(m)[1]
    norm = None
    if m.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value"):
        norm = norm_weight(output.ckpt, m.rsplit(".", 1)[0], ("input_layernorm",), output.norm_offset)
    elif m.rsplit(".", 1)[-1] in ("gate_proj", "up_proj"):
        norm = norm_weight(output.ckpt, m.rsplit(".", 1)[0], NORMS, output.norm_offset)
    return hidden(gen, tokens, k, norm)
