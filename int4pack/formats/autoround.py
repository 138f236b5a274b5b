"""AutoRound (Intel's auto-round, ``quant_method: "auto-round"``): GPTQ or AWQ tensors under a config of its own.

``packing_format`` says which tensors (auto-round's ``inference/backend.py`` lists them):

    auto_round:auto_gptq             GPTQ qweight/qzeros/scales, zero points stored minus one (GPTQ v1)
    auto_round, auto_round:gptqmodel the same tensors with the zero points as they are (GPTQ v2)
    auto_round:auto_awq              AWQ GEMM tensors

The GPTQ and AWQ readers read them (the zero convention is told from the data, as for GPTQ); this
module adds AutoRound's config: per-module ``bits``/``group_size``/``sym`` in ``extra_config`` (an
exact module name first, else the longest regex key that ``re.search`` finds in the name, as
auto-round resolves them), 16-bit modules left in float (no qweight: copied), and the config in
``quantization_config.json`` when config.json lacks it. ``model_extra_tensors.safetensors`` (the MTP
weights auto-round copies from the source model, quantised or not) is one more shard of the index.
"""

from __future__ import annotations

import re

from ..sources.checkpoint import Checkpoint
from ..errors import InputError, RefusedError
from ..records import FormatVerdict, LinearSpec
from ._api import Format, Header, quant_method
from ._common import QuantParams, cfg_int, has_negative, require_bits4
from .awq import AWQReader
from .gptq import GPTQReader

__all__ = ["AutoRoundGPTQReader", "AutoRoundAWQReader", "open_autoround", "claims", "FORMAT", "PACKINGS"]

METHOD = "auto-round"
# packing_format -> (tensor layout, zero convention its packer writes)
PACKINGS = {
    "auto_round:auto_gptq": ("gptq", "v1"),
    "auto_round": ("gptq", "v2"),
    "auto_round:gptqmodel": ("gptq", "v2"),
    "auto_round:auto_awq": ("awq", None),
}
_REFUSED_PACKINGS = {
    "auto_round:llm_compressor": "compressed-tensors tensors under an AutoRound config",
    "auto_round:fp8_static": "FP8 weights with static activation scales",
    "auto_round:llm_compressor_nvfp4_e5m3": "NVFP4 weights",
    "auto_round:fake": "fake-quantised float weights (no packed tensors)",
}
_REGEX_CHARS = set("*+?^$()[]{}|\\")


def claims(q: dict | None, header: Header) -> bool:
    return quant_method(q) in (METHOD, "auto_round", "autoround")


def _packing(q: dict) -> str:
    return str(q.get("packing_format") or "auto_round:auto_gptq").lower()


def _check(q: dict, path: str) -> None:
    """What neither tensor reader could read: a packing of other tensors, float data types, quantised activations."""
    packing = _packing(q)
    if packing not in PACKINGS:
        what = _REFUSED_PACKINGS.get(packing, "a packing int4pack does not know")
        raise RefusedError(f"AutoRound packing_format {packing!r} is {what}", path=path,
                           hint="int4pack reads AutoRound's " + ", ".join(PACKINGS) + " packings; export with "
                                "format auto_round (or auto_gptq / auto_awq) and integer weights.")
    dtype = str(q.get("data_type") or "int").lower()
    if not dtype.startswith("int"):
        raise RefusedError(f"AutoRound data_type {dtype!r}: float weights, not int", path=path,
                           hint="int4pack reads AutoRound's integer (data_type int) weights.")
    act = cfg_int(q, "act_bits", default=16)
    if act is not None and act < 16:
        raise RefusedError(f"AutoRound act_bits {act}: weights packed with activation quantisation (W{q.get('bits')}"
                           f"A{act}), a layout of auto-round's own", path=path,
                           hint="Export a weight-only (act_bits 16) AutoRound model to convert it.")


class _ExtraConfig:
    """AutoRound's per-module overrides (``extra_config``; ``layer_config`` in some exports)."""

    def __init__(self, q: dict, path: str):
        extra = q.get("extra_config")
        if extra is None:
            extra = q.get("layer_config") or {}
        if not isinstance(extra, dict) or not all(isinstance(v, dict) for v in extra.values()):
            raise InputError("quantization_config extra_config must map module names or regexes to objects",
                             path=path, hint="Fix or re-download the config.")
        self.exact = extra
        self.regex = []
        for key in sorted((k for k in extra if _REGEX_CHARS & set(k)), key=len, reverse=True):
            try:
                self.regex.append((re.compile(key), key))
            except re.error as e:
                raise InputError(f"quantization_config extra_config key {key!r} is not a valid regex ({e})",
                                 path=path, hint="Fix the regex in extra_config.") from None

    def rule(self, module: str) -> tuple[str, dict] | None:
        if module in self.exact:
            return module, self.exact[module]
        for pattern, key in self.regex:  # longest first: the most specific one wins
            if pattern.search(module):
                return key, self.exact[key]
        return None

    def module_params(self, base: QuantParams, module: str) -> tuple[QuantParams, str | None, list[str]]:
        """The module's parameters, the rule that set its bits (None: the config's), notes."""
        hit = self.rule(module)
        if hit is None:
            return base, None, []
        key, cfg = hit
        dtype = str(cfg.get("data_type") or "int").lower()
        if not dtype.startswith("int") and cfg_int(cfg, "bits", default=16) < 16:
            raise RefusedError(f"{module}: AutoRound extra_config {key!r} gives data_type {dtype!r} (float weights)",
                               tensor=module, hint="int4pack reads AutoRound's integer weights.")
        return base.overridden(cfg), (f"extra_config {key!r}" if "bits" in cfg else None), \
            [f"extra_config {key!r} applies"]


_SIGN_SAMPLE = 8
SIGNED_WARNING = ("AutoRound's symmetric int4 is full-range: each group's largest |w| sits at q = -8, so a group "
                  "led by a positive weight has a negative scale and holds -7..8 x |scale|, which no int4 group "
                  "with a positive scale holds exactly; its symmetric modules are requantised (W4A8 scales are "
                  "positive), each error reported beside plain RTN's")


def _mark_signed(reader, specs: dict[str, LinearSpec]) -> str:
    """AutoRound's symmetric int (``quant_tensor_sym``, "full range"): scale = -w / 8 for a group led by a
    positive w. Told from the data: the scales of up to 8 symmetric modules, spread over the model,
    read for their sign bits; where one is negative, every symmetric module is marked (records.py)."""
    sym = [s for s in specs.values() if s.sym and not s.refused]
    if not sym:
        return "no symmetric module"
    step = max(1, len(sym) // _SIGN_SAMPLE)
    sample = sym[::step][:_SIGN_SAMPLE]
    neg = [s.name for s in sample if has_negative(reader.ckpt, next(k for k in s.keys if k.endswith(".scales")))]
    if not neg:
        return f"scales of {len(sample)} sampled symmetric module(s) all positive: carried over as they are"
    for s in sym:  # 8-bit ones too: their float values are exact either way
        s.signed_scales = True
        s.notes.append("AutoRound full-range symmetric scales (signed)" + (": requantised" if s.bits == 4 else ""))
    return f"negative scales in {len(neg)} of {len(sample)} sampled symmetric module(s), e.g. {neg[0]}"


def _say_signed(v: FormatVerdict, found: str | None, specs: dict[str, LinearSpec]) -> None:
    if found is None:
        return
    v.evidence.append(found)
    if any(s.signed_scales and s.bits == 4 for s in specs.values()):
        v.warnings.append(SIGNED_WARNING)


class AutoRoundGPTQReader(GPTQReader):
    """AutoRound's auto_round / auto_gptq / gptqmodel packings: GPTQ tensors."""

    name = METHOD

    def __init__(self, ckpt: Checkpoint, q: dict, path: str | None = None):
        super().__init__(ckpt, q, path)
        self.packing = _packing(q)
        self.extra = _ExtraConfig(q, self.path)
        self.dynamic = {}  # AutoRound's overrides are extra_config's
        self._signed: str | None = None  # what the scales' signs showed (evidence)

    def _label(self) -> str | None:
        return "gptq" if PACKINGS[self.packing][1] == "v1" else "gptq_v2"

    def _check_config(self) -> None:
        if not self._checked:
            _check(self.cfg, self.path)
        super()._check_config()

    def _module_cfg(self, name: str) -> tuple[QuantParams, bool, str | None, list[str]]:
        eff, override, notes = self.extra.module_params(self.params, name)
        return eff, False, override, notes  # AutoRound keeps the input order (no act-order)

    def linears(self) -> dict[str, LinearSpec]:
        specs = super().linears()
        if self._signed is None:
            self._signed = _mark_signed(self, specs)
        return specs

    def _make_verdict(self, conv: str, label: str | None, evidence: list[str], warnings: list[str]) -> FormatVerdict:
        v = super()._make_verdict(conv, label, evidence, warnings)
        v.detail = f"auto-round {self.packing}: gptq {conv} zero points"
        v.evidence.insert(0, f"quant_method auto-round, packing_format {self.packing!r} (its packer writes "
                             f"{PACKINGS[self.packing][1]} zero points), bits {self.bits}, group_size {self.group}, "
                             f"sym {self.sym}")
        if self.extra.exact:
            v.evidence.append(f"extra_config overrides {len(self.extra.exact)} module name(s) or pattern(s)")
        _say_signed(v, self._signed, self.linears())
        v.extra["packing_format"] = self.packing
        return v


class AutoRoundAWQReader(AWQReader):
    """AutoRound's auto_awq packing: AWQ GEMM tensors; a module the config gives other than 4 bits is refused."""

    name = METHOD

    def __init__(self, ckpt: Checkpoint, q: dict, path: str | None = None):
        super().__init__(ckpt, q, path)
        self.packing = _packing(q)
        self.extra = _ExtraConfig(q, self.path)
        self._signed: str | None = None

    def _check_config(self) -> None:
        _check(self.cfg, self.path)
        super()._check_config()

    def _spec(self, name: str) -> LinearSpec:
        eff, override, notes = self.extra.module_params(self.params, name)
        if eff.bits != 4:
            raise RefusedError(f"{name}: {eff.bits}-bit by {override or 'the config'} in AutoRound's auto_awq packing, "
                               "which holds 4-bit modules only", tensor=name,
                               hint="Export the model with packing auto_round:auto_gptq to convert mixed widths.")
        if eff.group_size != self.params.group_size:
            raise RefusedError(f"{name}: group_size {eff.group_size} by {override or 'extra_config'}, beside the "
                               f"config's {self.params.group_size}, in the auto_awq packing", tensor=name,
                               hint="Export the model with packing auto_round:auto_gptq to convert mixed groups.")
        spec = super()._spec(name)
        spec.notes.extend(notes)
        spec.sym = spec.sym or eff.sym  # the AWQ reader takes every module as asymmetric; the data decide
        return spec

    def linears(self) -> dict[str, LinearSpec]:
        specs = super().linears()
        if self._signed is None:
            self._signed = _mark_signed(self, specs)
        return specs

    def verdict(self) -> FormatVerdict:
        v = super().verdict()
        v.detail = f"auto-round {self.packing}: awq gemm"
        v.evidence.insert(0, f"quant_method auto-round, packing_format {self.packing!r}")
        v.extra["packing_format"] = self.packing
        _say_signed(v, self._signed, self.linears())
        return v


def open_autoround(ckpt: Checkpoint, q: dict, path: str | None = None):
    """The reader of the tensors ``packing_format`` names."""
    where = path or str(ckpt.folder / "config.json")
    _check(q, where)
    require_bits4(cfg_int(q, "bits", default=4), "(the config's bits)", where)
    layout = PACKINGS[_packing(q)][0]
    return (AutoRoundAWQReader if layout == "awq" else AutoRoundGPTQReader)(ckpt, q, path)


FORMAT = Format(
    METHOD, claims, open_autoround,
    reads="quant_method auto-round (packing auto_round:auto_gptq, auto_round, auto_round:gptqmodel, "
          "auto_round:auto_awq)",
    lossless="symmetric with positive scales at group 32/64/128 or channel (GPTQ tensors)",
    requant="auto-round's full-range symmetric (signed scales, told from the data), asymmetric, auto_awq, other "
            "groups; 8-bit modules beside 4-bit ones",
    config_files=("quantization_config.json",), float_siblings=True)
