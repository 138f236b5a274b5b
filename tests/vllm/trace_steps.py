#!/usr/bin/env python3
"""Emulated side, a diagnostic beside tests/vllm/probe.py: serve one folder as the probe does (its
environment, its op counters, greedy, enforce_eager) and record, per forward step, what vLLM computed
inside: the input ids and positions, the attention metadata of every layer (seq_lens, block table,
slot mapping), and the input and output of each decoder layer's modules (norms, qkv/o projections,
the attention op's q/k/v and output, the head-wise gate, the MLP or MoE block and its router), the
final norm and the logits, all as float32; torch.save'd for the x86 side to set against the
references' intermediates (docs/serving.md: Step-3.5-Flash and the MLX mixed fixture).

    PYTHONPATH=SITE /tmp/arm64emu/bin/python3-arm64-vllm0.32.0 tests/vllm/trace_steps.py \\
        MODEL_DIR OUT.pt [PROMPT_IDS]      # SITE: the plugin's (WORK/int4pack_install.json "site")

A module vLLM's model calls with the residual (fused add + norm) records the residual as its input.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import probe  # noqa: E402

# modules recorded in each decoder layer, where the model class has them ("" is the layer itself)
SUBMODULES = ("", ".input_layernorm", ".self_attn", ".self_attn.qkv_proj", ".self_attn.q_norm",
              ".self_attn.k_norm", ".self_attn.attn", ".self_attn.g_proj", ".self_attn.o_proj",
              ".post_attention_layernorm", ".mlp", ".mlp.gate", ".moe")


def _install(model) -> str:
    """Hooks on the worker's model (the engine runs in this process: the record is torch's attribute,
    shared with main whatever apply_model does with this function)."""
    import torch
    from vllm.forward_context import get_forward_context

    rec = torch.__dict__.setdefault("_int4pack_trace", {"steps": []})

    def f32(t):
        t = t[0] if isinstance(t, (tuple, list)) else t
        return t.detach().to(torch.float32).cpu().clone() if isinstance(t, torch.Tensor) else None

    def step() -> dict:
        if not rec["steps"]:
            rec["steps"].append({"mods": {}, "meta": {}})
        return rec["steps"][-1]

    def on_embed(mod, args, kwargs):  # the first module of a forward step
        ids = args[0] if args else next(iter(kwargs.values()))
        rec["steps"].append({"input_ids": ids.detach().cpu().clone(), "mods": {}, "meta": {}})

    def on_first_layer(mod, args, kwargs):  # inside the forward context: positions and metadata
        if not rec["steps"] or "positions" in rec["steps"][-1]:
            rec["steps"].append({"mods": {}, "meta": {}})
        s = step()
        s["positions"] = (args[0] if args else kwargs["positions"]).detach().cpu().clone()
        md = get_forward_context().attn_metadata
        for name, m in (md.items() if isinstance(md, dict) else ()):
            s["meta"][name] = {f: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v)
                               for f in ("num_actual_tokens", "max_query_len", "max_seq_len", "causal",
                                         "query_start_loc", "seq_lens", "block_table", "slot_mapping")
                               for v in [getattr(m, f, None)]}

    def recorder(name: str):
        def hook(mod, args, kwargs, out):
            mods = step()["mods"]
            if name.endswith(".attn"):  # Attention(q, k, v)
                for i, x in enumerate("qkv"):
                    mods[f"{name}.in_{x}"] = f32(args[i] if len(args) > i else kwargs.get(("query", "key", "value")[i]))
            else:
                mods[f"{name}.in"] = f32(kwargs.get("hidden_states", args[-1] if args else None))
            mods[f"{name}.out"] = f32(out)
        return hook

    inner = model.model
    inner.embed_tokens.register_forward_pre_hook(on_embed, with_kwargs=True)
    inner.layers[0].register_forward_pre_hook(on_first_layer, with_kwargs=True)
    inner.norm.register_forward_hook(recorder("norm"), with_kwargs=True)
    if hasattr(model, "logits_processor"):
        model.logits_processor.register_forward_hook(recorder("logits"), with_kwargs=True)
    for i, layer in enumerate(inner.layers):
        for sub in SUBMODULES:
            m = layer
            for part in filter(None, sub.split(".")):
                m = getattr(m, part, None)
            if m is not None:
                m.register_forward_hook(recorder(f"layers.{i}{sub}"), with_kwargs=True)
        sa = layer.self_attn
        rec.setdefault("attn", {})[i] = {
            "num_heads": sa.num_heads, "num_kv_heads": sa.num_kv_heads, "head_dim": sa.head_dim,
            "scaling": sa.scaling, "sliding_window": getattr(sa.attn.impl, "sliding_window", None),
            "rotary": repr(getattr(sa, "rotary_emb", None))}
    return "hooked"


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    prompt = [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "3,17,42,99,128,200,7,64").split(",")]
    for k, v in probe._ENV.items():
        os.environ.setdefault(k, v)
    st = probe._setup()
    import torch
    from vllm import LLM, SamplingParams

    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    vocab = (cfg.get("text_config") or cfg)["vocab_size"]
    llm = LLM(model=model_dir, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=128, max_num_seqs=2,
              max_num_batched_tokens=128, max_logprobs=vocab, seed=0, **probe.engine_options(1))
    print(llm.apply_model(_install), flush=True)
    rec = torch._int4pack_trace
    rec["steps"].clear()
    st["routes"].clear()
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=vocab, prompt_logprobs=vocab)
    o = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    rec.update(prompt=prompt, token_ids=list(o.outputs[0].token_ids), routes=list(st["routes"]))
    torch.save(rec, out)
    print("TRACE_DONE", rec["token_ids"], len(rec["steps"]), "steps", flush=True)
    os._exit(0)  # skip vLLM's slow interpreter teardown under emulation


if __name__ == "__main__":
    main()
