"""verify's progress: the structural pass after the numerical one says where it is, layer by
layer, instead of a screen left blank while it runs."""

from __future__ import annotations


import int4pack
from _reference import FIXTURES
from int4pack.verify import NullProgress



class Recorder(NullProgress):
    def __init__(self):
        self.calls = []

    def phase(self, what):
        self.calls.append(("phase", what))

    def start(self, layers, experts, dense):
        self.calls.append(("start", layers))

    def stop(self):
        self.calls.append(("stop", None))


def test_the_structural_pass_shows_each_layer(tmp_path):
    out = tmp_path / "out"
    int4pack.convert(FIXTURES / "gptq_q3_sym", out)
    rec = Recorder()
    rep = int4pack.verify(out, FIXTURES / "gptq_q3_sym", progress=rec)
    assert rep["ok"], rep["verdict"]
    kinds = [k for k, _ in rec.calls]
    started, stopped = kinds.index("start"), kinds.index("stop")
    assert stopped == len(kinds) - 1, rec.calls  # stopped once, after the structural pass
    after = [w for k, w in rec.calls[started:] if k == "phase"]
    layers = [w for w in after if w.startswith("structure: layers ")]
    n = int(layers[-1].rsplit("/", 1)[1]) if layers else 0
    assert n >= 2 and layers == [f"structure: layers {i}/{n}" for i in range(1, n + 1)], after
