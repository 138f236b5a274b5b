"""How an MoE expert activates its gate and up projections, as facts and as a plain-torch reference.

The kinds (each read in the model class named; ``gate_up`` is one expert's ``x @ w13^T``, gate then up):

  ===========  =================================================================================
  silu         silu(gate) * up (Mixtral, Qwen, DeepSeek-V2/V3, GLM-4.5 to 5.2, Kimi, EXAONE-MoE, Laguna)
  swigluoai    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit)
               (gpt-oss; MiniMax-M3: transformers minimax_m3_vl/modeling_minimax_m3_vl.py
               ``MiniMaxM3VLExperts._apply_gate``, alpha 1.702, limit 7, gate/up not interleaved)
  swiglu_clamp silu(clamp(gate, max=limit)) * clamp(up, -limit, limit) (DeepSeek-V4:
               deepseek_v4/modeling_deepseek_v4.py ``DeepseekV4Experts._apply_gate``; GLM-5.3-Flash:
               glm5_next/modeling_glm5_next.py ``Glm5NextTextExperts._apply_gate``; limit 10)
  swiglustep   clamp(silu(gate), max=limit) * clamp(up, -limit, limit): the clamp after the SiLU
               (Step-3.5: step3p7/modeling_step3p7.py ``Step3p7Experts._apply_gate``, per layer
               ``swiglu_limits``; vLLM's SWIGLUSTEP)
  gelu_tanh    gelu(gate, tanh approximation) * up (Gemma-4: ``hidden_activation``
               gelu_pytorch_tanh, gemma4/modeling_gemma4.py ``Gemma4TextExperts``)
  ===========  =================================================================================

``kernel_kind`` is the activation number vLLM's CPU W4A8 MoE op (``dynamic_4bit_int_moe``) computes
exactly this with: 0 (SiLU * up) for silu, 1 for swigluoai at the op's hard-coded alpha 1.702 and
limit 7 with gate and up as halves; None for every other activation, which that op cannot apply.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._lazy import torch

__all__ = ["Activation", "KINDS", "SILU", "GELU_TANH", "OP_SWIGLUOAI", "apply", "from_record", "from_hidden_act"]

KINDS = ("silu", "swigluoai", "swiglu_clamp", "swiglustep", "gelu_tanh")
_CLAMPED = ("swigluoai", "swiglu_clamp", "swiglustep")
_OP_ALPHA, _OP_LIMIT = 1.702, 7.0  # the op's SwiGLUOAI constants (csrc/moe/dynamic_4bit_int_moe_cpu.cpp)


@dataclass(frozen=True)
class Activation:
    """One expert activation: its kind, SwiGLU-OAI's alpha, the clamp limit, and how gate and up
    lie in the gate/up projection's output ("halves": gate the first half; "interleaved": gate the
    even columns, as gpt-oss's original checkpoints store them)."""

    name: str = "silu"
    alpha: float | None = None
    limit: float | None = None
    order: str = "halves"

    def __post_init__(self):
        if self.name not in KINDS:
            raise ValueError(f"activation {self.name!r} is not one of {', '.join(KINDS)}")
        if self.name in _CLAMPED and not (self.limit and self.limit > 0):
            raise ValueError(f"activation {self.name} needs a positive limit, not {self.limit!r}")
        if self.name == "swigluoai" and self.alpha is None:
            raise ValueError("activation swigluoai needs its alpha")
        if self.order not in ("halves", "interleaved"):
            raise ValueError(f"gate/up order {self.order!r} is not halves or interleaved")

    @property
    def kernel_kind(self) -> int | None:
        """vLLM's CPU W4A8 MoE op's activation number computing exactly this, or None."""
        if self.order != "halves":
            return None
        if self.name == "silu":
            return 0
        if self.name == "swigluoai" and self.alpha == _OP_ALPHA and self.limit == _OP_LIMIT:
            return 1
        return None

    def describe(self) -> str:
        out = self.name
        if self.alpha is not None:
            out += f" alpha {self.alpha:g}"
        if self.limit is not None:
            out += f" limit {self.limit:g}"
        return out + (", gate/up interleaved" if self.order == "interleaved" else "")

    def to_record(self) -> dict:
        return {"name": self.name, "alpha": self.alpha, "limit": self.limit, "order": self.order,
                "kernel_kind": self.kernel_kind}

    def split(self, gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate, up) from a gate/up projection's output [..., 2I]."""
        if self.order == "interleaved":
            return gate_up[..., 0::2], gate_up[..., 1::2]
        i = gate_up.shape[-1] // 2
        return gate_up[..., :i], gate_up[..., i:]

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The activation of gate and up (same shape), in their dtype."""
        f = torch.nn.functional
        lim = self.limit
        if self.name == "silu":
            return f.silu(gate) * up
        if self.name == "gelu_tanh":
            return f.gelu(gate, approximate="tanh") * up
        if self.name == "swigluoai":
            g = gate.clamp(max=lim)
            return (up.clamp(-lim, lim) + 1.0) * (g * torch.sigmoid(g * self.alpha))
        if self.name == "swiglu_clamp":
            return f.silu(gate.clamp(max=lim)) * up.clamp(-lim, lim)
        return f.silu(gate).clamp(max=lim) * up.clamp(-lim, lim)  # swiglustep


SILU = Activation("silu")
GELU_TANH = Activation("gelu_tanh")
OP_SWIGLUOAI = Activation("swigluoai", alpha=_OP_ALPHA, limit=_OP_LIMIT)  # gpt-oss


def apply(kind: Activation, gate_up: torch.Tensor) -> torch.Tensor:
    """The activation of one expert's gate/up output [..., 2I] -> [..., I]."""
    return kind(*kind.split(gate_up))


def from_record(rec: dict) -> Activation:
    """``Activation.to_record``'s inverse (``kernel_kind`` is derived, not read)."""
    return Activation(str(rec["name"]), alpha=rec.get("alpha"), limit=rec.get("limit"),
                      order=str(rec.get("order") or "halves"))


def from_hidden_act(hidden_act: str | None) -> Activation | None:
    """The gated activation a config's ``hidden_act`` names (silu, swish, gelu_pytorch_tanh), or None
    for a name that is not one of them."""
    name = str(hidden_act or "silu").lower()
    if name in ("silu", "swish"):
        return SILU
    if name in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new"):
        return GELU_TANH
    return None
