"""The lane's routing check (lane_checks.py ``routing_agreement``, run by scripts/vllm_arm_e2e.py) on hand-made calls: the
probe records one list of expert sets per MoE op call, the prefill's layer by layer and then one
token per decode step; the reference has one list of positions per MoE layer."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lane_checks import routing_agreement  # noqa: E402

# two MoE layers, five positions (a prefill of three tokens, two decode steps), top-2
REF = [[[0, 1], [2, 3], [1, 2], [0, 3], [1, 3]],
       [[4, 5], [4, 6], [5, 7], [6, 7], [4, 7]]]


def calls(ref):
    """What the probe records for ``ref``'s routes: per step, one call per layer."""
    out = [ref[0][:3], ref[1][:3]]
    for pos in (3, 4):
        out += [[ref[0][pos]], [ref[1][pos]]]
    return out


def test_the_same_routes_agree_everywhere():
    got = routing_agreement(calls(REF), REF)
    assert got == {"agree": "10/10", "fraction": 1.0, "worst_layer": 0, "worst_layer_fraction": 1.0}


def test_a_decode_step_of_the_second_layer_that_differs_is_counted_there():
    served = calls(REF)
    served[5] = [[4, 6]]  # layer 1, position 3: the reference has [6, 7]
    got = routing_agreement(served, REF)
    assert got == {"agree": "9/10", "fraction": 0.9, "worst_layer": 1, "worst_layer_fraction": 0.8}


def test_calls_that_do_not_fit_the_layers_are_an_error():
    assert "error" in routing_agreement(calls(REF)[:-1], REF)
    assert "error" in routing_agreement([], REF)


def test_gpt_oss_layout_groups_and_swap_control(tmp_path):
    """gpt-oss's per-expert W4A8 layout (stored transposed, gate then up): the lane reads each
    expert's group as vLLM will run it, and the gate/up-swap control really swaps the halves."""
    import int4pack
    import torch
    from controls import swap_gate_up
    from float_ref import load_tensors
    from lane_checks import _layer_group, disk_groups

    int4pack.convert(Path(__file__).resolve().parents[1] / "fixtures" / "gptoss_mxfp4", tmp_path / "out")
    g = disk_groups(tmp_path / "out")
    assert len(g) == 24 and set(g.values()) == {32}
    assert _layer_group(g, "model.layers.1.mlp.experts.routed_experts") == 32
    t = load_tensors(tmp_path / "out")
    s = swap_gate_up(t)
    k = "model.layers.0.mlp.experts.2.gate_up_proj"
    for x in (".weight", ".weight_scale", ".bias"):
        assert torch.equal(s[k + x][..., :64], t[k + x][..., 64:]) and not torch.equal(s[k + x], t[k + x])


def test_the_plain_column_says_not_run_and_never_identical_when_plain_was_not_served():
    from lane_checks import plain_cell

    assert plain_cell({"run": False, "not_run": "--no-plain", "identical": None}) == "not run"
    assert plain_cell({"run": False, "identical": None, "single_process_plain_tokens_identical": False}) == \
        "not run (single-process plain: other tokens)"
    assert plain_cell({"run": True, "identical": False}) == "NO"


def test_the_plain_folder_is_skipped_with_ranks_only_where_stock_vllm_refuses_it():
    from types import SimpleNamespace

    from lane_compare import plain_not_run, vs_plain

    fx = Path(__file__).resolve().parents[1] / "fixtures"
    ds3 = {"plain_dir": str(fx / "ct_deepseekv3_w4a16")}  # DeepSeekV3 routing: stock 0.32.0 refuses it
    qwen = {"plain_dir": str(fx / "gptq_q3_sym")}  # softmax: stock 0.32.0 serves it
    tp2 = SimpleNamespace(no_plain=False, tensor_parallel=2, pipeline_parallel=1, vllm="0.32.0")
    one = SimpleNamespace(no_plain=False, tensor_parallel=1, pipeline_parallel=1, vllm="0.32.0")
    assert "tensor_parallel_size=2" in plain_not_run(ds3, tp2)
    assert plain_not_run(qwen, tp2) is None  # served at TP=2 like the packed folder
    assert plain_not_run(ds3, one) is None  # one process: served, its refusal recorded
    assert plain_not_run(qwen, SimpleNamespace(**{**vars(tp2), "no_plain": True})) == "--no-plain"
    res = vs_plain({"token_ids": [1, 2]}, Path("/nonexistent"), {**qwen, "key": "k", "plain_not_run": "--no-plain",
                                                                  "serve_format": "kleidiai"}, "t", None)
    assert res["run"] is False and res["fails"] == [] and res["identical"] is None


def test_a_layer_group_is_found_under_the_checkpoint_name_a_wrapper_renames():
    """vLLM loads Qwen3.5's ``model.language_model.*`` as ``language_model.model.*``: the group of
    the tensors behind a vLLM layer is looked up under both names, and a name under neither is None."""
    from lane_checks import _layer_group

    groups = {"model.language_model.layers.0.mlp.experts.0.gate_proj": 32,
              "model.language_model.layers.1.self_attn.q_proj": 64}
    assert _layer_group(groups, "language_model.model.layers.0.mlp.experts.routed_experts") == 32
    assert _layer_group(groups, "language_model.model.layers.1.self_attn.qkv_proj") == 64
    assert _layer_group(groups, "language_model.model.layers.2.self_attn.qkv_proj") is None


def test_moe_layers_are_counted_where_the_experts_sit_right_under_the_layer(tmp_path):
    """Gemma-4 keeps its experts at ``layers.L.experts.E.*`` (no ``mlp.`` between): check_layers
    expects one vLLM MoE layer per such layer, as for the ``layers.L.mlp.experts`` families."""
    import int4pack
    from lane_checks import check_layers

    fx = Path(__file__).resolve().parents[1] / "fixtures"
    for name, n in (("ct_gemma4_w4a16", 2), ("ct_qwen3moe_w4a16", 2)):
        out = tmp_path / name
        int4pack.convert(fx / name, out)
        _, fails = check_layers({"layers": {}, "calls": {}}, out)
        assert f"0 FusedMoE layers, expected {n}" in fails, fails


def test_a_plain_module_of_the_packed_format_is_checked_as_vllms_own(tmp_path):
    """Laguna's g_proj (N = 2 or 4 rows) is stored as plain W4A8 in the packed format (plain_modules):
    vLLM's own scheme and kernel are right for it there, the plugin's packed method is not required."""
    import int4pack
    from lane_checks import LINEAR_KERNEL, LINEAR_SCHEME, check_layers

    out = tmp_path / "packed"
    int4pack.convert(Path(__file__).resolve().parents[1] / "fixtures" / "ct_laguna_w4a16", out, serve_format="kleidiai")
    name = "model.layers.0.self_attn.g_proj"
    own = {"scheme": LINEAR_SCHEME, "kernel": LINEAR_KERNEL, "quant_method": "CompressedTensorsLinearMethod",
           "group_size": 32, "output_size_per_partition": 4, "input_size_per_partition": 128}
    for layer, bad in ((own, False), ({**own, "kernel": None}, True)):
        _, fails = check_layers({"layers": {name: layer}, "calls": {}}, out, packed=True)
        assert any(f.startswith(f"{name}: a plain module") for f in fails) is bad, fails
