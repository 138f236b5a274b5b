"""verify --against's exact path (int4pack/verify/exact_ints.py): a lossless expert equal to its source is
checked from its int4 values, and its figures are still the float64 ones; the copies' check does
not map the source's packed weights."""

from __future__ import annotations


import numpy as np
import pytest

import int4pack
from _reference import FIXTURES, ct_decode, gptq_decode, load_all, rel_l2, w4a8_decode



def _source_w(t: dict, m: str) -> np.ndarray:
    """Module m's float64 weights from the source's own tensors (tests/_reference.py's decoders)."""
    if f"{m}.qweight" in t:
        d = gptq_decode(t, m, v1=True)
        if not (d["z"] == 8).all():  # v2 zero points are stored as they are
            d = gptq_decode(t, m, v1=False)
        return d["w"]
    return ct_decode(t, m, None if f"{m}.weight_shape" not in t else
                     int(t[f"{m}.weight_shape"][1]) // t[f"{m}.weight_scale"].shape[1])["w"]


@pytest.mark.parametrize("fmt", ["compressed-tensors", "kleidiai"])
@pytest.mark.parametrize("fixture", ["gptq_q3_sym", "ct_qwen3moe_w4a16"])
def test_lossless_experts_are_checked_as_ints_with_their_float64_figures(tmp_path, fixture, fmt):
    out = tmp_path / "out"
    int4pack.convert(FIXTURES / fixture, out)
    if fmt == "kleidiai":  # the figures are read from the plain output, the check runs on the blobs
        int4pack.convert(FIXTURES / fixture, tmp_path / "packed", serve_format=fmt)
    rep = int4pack.verify(tmp_path / ("packed" if fmt == "kleidiai" else "out"), FIXTURES / fixture)
    assert rep["ok"], rep["verdict"]
    src, conv = load_all(FIXTURES / fixture), load_all(out)
    seen = 0
    for lay in rep["layers"]:
        assert lay["experts_exact"] == lay["experts_checked"] > 0, lay
        for st in lay["expert_stats"].values():
            for r in ("gate", "up", "down"):
                m = st[r]["module"]
                want = rel_l2(w4a8_decode(conv, m)["w"], _source_w(src, m))
                assert st[r]["exact_ints"] and st[r]["rel_l2"] == pytest.approx(want, rel=1e-4, abs=1e-9), (m, st[r])
                seen += 1
    for d in rep["dense"]:  # a dense linear: the same figures, from its int4 values
        m = d["module"]
        if f"{m}.weight" in conv and f"{m}.weight_scale" in conv:
            want = rel_l2(w4a8_decode(conv, m)["w"], _source_w(src, m))
            assert d["exact_ints"] and d["weight_l2"] == pytest.approx(want, rel=1e-4, abs=1e-9), (m, d)
            seen += 1
    assert seen


def test_the_copies_check_maps_no_source_weights(tmp_path, monkeypatch):
    """check_copies asks every quantised module for its bias: a spec without one is answered
    without mapping the module's packed weights (once the whole source, counted in RSS)."""
    from int4pack.sources.checkpoint import Checkpoint
    from int4pack.verify.threads import Clock
    from int4pack.verify.source import Source, check_copies
    from int4pack.verify.w4a8_output import W4A8Output

    out = tmp_path / "out"
    int4pack.convert(FIXTURES / "gptq_q3_sym", out)
    viewed = []
    view = Checkpoint.view
    monkeypatch.setattr(Checkpoint, "view", lambda self, name: viewed.append(name) or view(self, name))
    src = Source(FIXTURES / "gptq_q3_sym", None)
    t = W4A8Output(Checkpoint(out))
    try:
        r = check_copies(t, src, Clock())
    finally:
        src.close()
        t.ckpt.close()
    assert r["ok"] and r["checked"] > 0, r
    assert not [n for n in viewed if n.rsplit(".", 1)[0] in t.modules], viewed
