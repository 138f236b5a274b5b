"""A GGUF checkpoint (llama.cpp) presented as a Checkpoint: one ``.gguf`` file, a folder holding
one, or a split set (``name-00001-of-00003.gguf``).

Only the headers are read up front, by the ``gguf`` package's own GGUFReader (its numpy memmap of
the file: metadata and tensor infos, no tensor data). The tensors are then listed under the HF
names vLLM loads, mapped by gguf's TensorNameMap from the HF parameter names of the model class
(gguf_config.ARCHS), and read with Checkpoint's positional reads at the offsets GGUF gives:

* F32/F16/BF16 tensors that are not experts: as they are (a 1-D tensor HF holds as [1, H] reshaped);
* quantised linears (``*_proj``): their block bytes, U8 ``[N, bytes per row]``, read by
  formats/gguf.py;
* fused experts ``blk.N.ffn_{gate,up,down}_exps``: GGUF's ne is [K, N, E] (ne[0] the fastest), so
  the bytes are row-major [E, N, K] and expert e is one contiguous run: listed per expert as
  ``<moe>.experts.E.<proj>.weight`` (block bytes, or float [N, K]); their biases
  ``ffn_*_exps.bias`` [E, N] (gpt-oss) likewise as ``<moe>.experts.E.<proj>.bias`` [N];
* quantised tensors vLLM loads in float (embeddings, lm_head, routers): derived BF16 tensors,
  dequantised by gguf when read (derived_tensors.py);
* deepseek2's ``blk.N.attn_k_b`` / ``attn_v_b``: llama.cpp's converter splits MLA's kv_b_proj into
  them for its absorbed attention (conversion/deepseek.py ``DeepseekV2Model.modify_tensors``:
  ``kv_b.view(H, nope + v, R)`` split into k [H, nope, R], stored transposed as [H, R, nope], and
  v [H, v, R]) and leaves ``attn_kv_b`` out; vLLM loads kv_b_proj, so it is rebuilt from them, in
  float32, as a derived tensor (a file that still has ``attn_kv_b`` gives it as it is).
  ``blk.N.exp_probs_b.bias`` is the router's ``e_score_correction_bias`` (the converter's rename
  undone, conversion/base.py ``ModelBase.modify_tensors``), and gpt-oss's ``blk.N.attn_sinks.weight``
  its ``self_attn.sinks`` (conversion/gpt_oss.py ``GptOssModel.filter_tensors`` adds ``.weight``).

A tensor of a type outside GGUF_TYPES is refused at open, naming it and its type.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from . import gguf_config
from .checkpoint import Checkpoint
from .derived_tensors import DerivedTensors, bf16_bits
from ..errors import InputError, RefusedError
from .safetensors_header import TensorInfo
from .source_folder import link_roots

__all__ = ["GGUFCheckpoint", "gguf_files", "is_gguf", "GGUF_TYPES", "FLOAT_TYPES", "GGUFLinear"]

# ggml type -> the source group (inputs per scale) int4pack reports; requantised except Q4_0
GGUF_TYPES = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q4_K": 32, "Q5_K": 32, "Q6_K": 16,
              "IQ4_NL": 32, "IQ4_XS": 32, "MXFP4": 32}
FLOAT_TYPES = {"F32": "F32", "F16": "F16", "BF16": "BF16"}  # ggml type -> safetensors dtype
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_LINEAR_LEAF = re.compile(r"\.((q|k|v|o|gate|up|down|q_a|q_b|kv_b)_proj|kv_a_proj_with_mqa|w1|w2|w3)$")
_EXPERT_LEAF = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
_ONE_ROW = (".mlp.shared_expert_gate",)  # HF holds these [1, H]; GGUF stores [H]
# the converter's renames undone (the module docstring): the GGUF name's HF spelling -> the HF key
_RENAMED = ((".e_score_correction.bias", ".e_score_correction_bias"), (".self_attn.sinks.weight", ".self_attn.sinks"))


def is_gguf(path: Path) -> bool:
    """A .gguf file, or a folder with .gguf files and no safetensors."""
    if path.is_file():
        return path.suffix == ".gguf"
    return path.is_dir() and any(path.glob("*.gguf")) and not any(path.glob("*.safetensors"))


def gguf_files(path: Path) -> list[Path]:
    """The file(s) of one GGUF model: the file given (all parts of its split set), or the one set in a folder."""
    if path.is_dir():
        sets: dict[str, list[Path]] = {}
        for p in sorted(path.glob("*.gguf")):
            if p.name.startswith("mmproj"):  # a vision projector beside the language model
                continue
            m = _SPLIT.match(p.name)
            sets.setdefault(m["stem"] if m else p.stem, []).append(p)
        if len(sets) != 1:
            raise InputError(f"{path}: {len(sets)} GGUF models in the folder ({', '.join(sorted(sets)) or 'none'})",
                             path=str(path), hint="Pass the .gguf file (the first part of a split set) to convert.")
        path = next(iter(sets.values()))[0]
    m = _SPLIT.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise InputError(f"{path.name}: part of a {count}-file split set, but {missing[0]} is missing"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""), path=str(path),
                         hint="Download every part of the split set into the same folder.")
    return parts


def _field_value(field):
    import gguf

    v = field.contents()
    if field.types and field.types[-1] == gguf.GGUFValueType.FLOAT32:  # float32's shortest decimal: 1e-06
        v = [gguf_config.f32_value(x) for x in v] if isinstance(v, list) else gguf_config.f32_value(v)
    if field.types and field.types[0] == gguf.GGUFValueType.ARRAY and not isinstance(v, list):
        v = [v]
    return v


def _read_header(path: Path):
    """(metadata, [(name, type name, ne, offset, nbytes)]) through gguf's GGUFReader."""
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - a dependency
        raise InputError("reading GGUF needs the gguf package (pip install gguf)") from e
    try:
        r = gguf.GGUFReader(path, "r")
    except (ValueError, OSError, KeyError, IndexError) as e:
        raise InputError(f"{path.name}: not a readable GGUF file ({type(e).__name__}: {str(e)[:200]})",
                         path=str(path), hint="The file is damaged or truncated; download it again.") from None
    meta = {k: _field_value(f) for k, f in r.fields.items() if not k.startswith("GGUF.")}
    infos = [(t.name, t.tensor_type.name, tuple(int(x) for x in t.shape), int(t.data_offset), int(t.n_bytes))
             for t in r.tensors]
    size = os.path.getsize(path)
    for name, _, _, off, nb in infos:
        if off + nb > size:
            raise InputError(f"{path.name}: tensor {name!r} ends at byte {off + nb}, past the file's {size}",
                             path=str(path), tensor=name, hint="The file is truncated; download it again.")
    del r  # drops the memmap: tensor bytes are read by position
    return meta, infos


class GGUFLinear:
    """Where one linear's GGUF data lies: its key in ``tensors``, ggml type, [N, K], GGUF tensor name, for
    a RoPE-permuted q/k projection the GGUF row of each HF row, and an expert's bias key (gpt-oss)."""

    __slots__ = ("key", "qtype", "n", "k", "source", "rows", "bias")

    def __init__(self, key: str, qtype: str, n: int, k: int, source: str, rows: np.ndarray | None = None):
        self.key, self.qtype, self.n, self.k, self.source, self.rows = key, qtype, n, k, source, rows
        self.bias: str | None = None


class GGUFCheckpoint(DerivedTensors, Checkpoint):
    """See the module docstring."""

    container = "gguf"  # what the reader table's rows see (formats/_api.Header)
    expert_layout = "GGUF's fused blk.N.ffn_{gate,up,down}_exps, one [E, N, K] tensor each, read per expert"

    def __init__(self, path: str | os.PathLike):
        files = gguf_files(Path(path))
        self.folder = files[0].parent
        self._roots = link_roots(self.folder)
        for f in files:
            self.check_link(f)
        self.files = [f.name for f in files]
        self.quant_config_path = files[0]
        self.tensors: dict[str, TensorInfo] = {}
        self.shard_metadata: dict[str, dict[str, str]] = {}
        self.index_path = None
        self._start_io()
        self._init_derived()
        headers = [_read_header(f) for f in files]
        for f, (_, infos) in zip(files, headers):  # first: a type int4pack cannot read is named before anything
            for name, qtype, *_ in infos:
                if qtype not in GGUF_TYPES and qtype not in FLOAT_TYPES:
                    raise RefusedError(f"{f.name}: tensor {name!r} is {qtype}, a GGUF type int4pack does not read",
                                       path=str(f), tensor=name,
                                       hint="int4pack reads GGUF F32/F16/BF16 and " + ", ".join(GGUF_TYPES) +
                                            "; pick a quantisation of the model in one of them (e.g. Q4_0, Q4_K_M).")
        self.metadata: dict = headers[0][0]
        arch = str(self.metadata.get("general.architecture") or "")
        names = {name for _, infos in headers for name, *_ in infos}
        self.config, self.arch = gguf_config.build_config(self.metadata, arch, names, str(files[0]))
        self.generated, self.tokenizer_note = gguf_config.tokenizer_files(
            self.metadata, self.config.get("max_position_embeddings"))
        self.gguf_linears: dict[str, GGUFLinear] = {}
        self.types: dict[str, int] = {}  # ggml type -> tensors of it
        blocks = int(self.config["num_hidden_layers"]) + int(self.config.get("num_nextn_predict_layers") or 0)
        self._hf = self._name_map(blocks)
        self._kv_b: dict[str, dict[str, tuple]] = {}  # layer prefix -> "k"/"v" -> the attn_k_b / attn_v_b tensor
        for f, (_, infos) in zip(files, headers):
            for info in infos:
                self._add(f.name, *info)
        self.rebuilt_kv_b = self._rebuild_kv_b()  # the kv_b_proj modules put back together
        for mod, lin in self.gguf_linears.items():
            if ".experts." in mod and f"{mod}.bias" in self.tensors:
                lin.bias = f"{mod}.bias"
        self.quant_config = {"quant_method": "gguf", "architecture": arch, "types": dict(sorted(self.types.items())),
                             "file_type": self.metadata.get("general.file_type")}

    def _name_map(self, n_layers: int) -> dict[str, str]:
        """GGUF tensor base name -> HF module name, through gguf's TensorNameMap of the architecture.

        The MTP block's ``blk.N.nextn.*`` names are gguf's TENSOR_NAMES for NEXTN_*: the gguf wheel on PyPI
        leaves them out of deepseek2's tensor list, where the gguf-py vendored with llama.cpp (llama-cpp-python
        0.3.36) has them."""
        import gguf

        arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[self.arch.gguf_name]
        tmap = gguf.get_tensor_name_map(arch, n_layers)
        nextn = {f"model.layers.{{bid}}.{n}": gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, "NEXTN_" + n.replace(
            ".", "_").upper())] for n in gguf_config.NEXTN}
        out: dict[str, str] = {}
        for tmpl in self.arch.modules:
            for bid in (range(n_layers) if "{bid}" in tmpl else (None,)):
                hf = tmpl.format(bid=bid)
                g = tmap.get_name(hf)
                if g is None and tmpl in nextn:
                    g = nextn[tmpl].format(bid=bid)
                if g is not None:
                    out[g] = hf
        return out

    def _add(self, file: str, name: str, qtype: str, ne: tuple, off: int, nbytes: int) -> None:
        base, dot, suffix = name.rpartition(".")
        hf = self._hf.get(base) if dot else None
        if hf is None:
            raise RefusedError(f"{file}: tensor {name!r} has no Hugging Face name in a {self.arch.gguf_name} model",
                               path=str(self.folder / file), tensor=name,
                               hint="int4pack maps GGUF names with gguf's TensorNameMap; this tensor is not one "
                                    f"{self.arch.cls} loads.")
        self.types[qtype] = self.types.get(qtype, 0) + 1
        shape = tuple(reversed(ne))  # GGUF's ne[0] is the fastest-varying dimension
        key = f"{hf}.{suffix}"
        for spelled, hf_key in _RENAMED:
            if key.endswith(spelled):
                key = key[: -len(spelled)] + hf_key
        if hf.endswith((".k_b_proj", ".v_b_proj")):  # put back together into kv_b_proj (_rebuild_kv_b)
            attn, _, leaf = hf.rpartition(".")
            self._kv_b.setdefault(attn, {})[leaf[0]] = (file, qtype, shape, off, nbytes, name)
            return
        quant = qtype in GGUF_TYPES
        if ".experts." in hf and hf.rsplit(".", 1)[-1] in _EXPERT_LEAF:
            bias = suffix == "bias"
            if len(shape) != (2 if bias else 3) or suffix not in ("weight", "bias") or (bias and quant):
                want = "a float [E, N]" if bias else "[E, N, K]"
                raise InputError(f"{name}: fused experts' {suffix} {qtype} of shape {list(shape)}, expected {want}",
                                 tensor=name, path=str(self.folder / file),
                                 hint="The file is not a layout llama.cpp writes.")
            e_n = shape[0]
            per = nbytes // e_n
            moe, proj = hf.rsplit(".", 1)
            for e in range(e_n):
                if bias:  # expert e's bias: row e of [E, N]
                    k = f"{moe}.{e}.{proj}.bias"
                    self.tensors[k] = TensorInfo(k, file, FLOAT_TYPES[qtype], shape[1:], off + e * per,
                                                 off + (e + 1) * per)
                else:
                    self._linear(f"{moe}.{e}.{proj}", file, qtype, shape[1], shape[2], off + e * per, per, name)
            return
        if hf.endswith(_ONE_ROW) and len(shape) == 1:
            shape = (1, shape[0])
        rows = self._rope_rows(hf, shape[0])
        if suffix == "weight" and len(shape) == 2 and _LINEAR_LEAF.search(hf) and quant:
            self._linear(hf, file, qtype, shape[0], shape[1], off, nbytes, name, rows)
        elif not quant and rows is not None:  # a float q/k projection: its rows put back in HF's order
            self.add_derived(TensorInfo(key, file, FLOAT_TYPES[qtype], shape, 0, nbytes),
                             self._float_rows(file, qtype, shape, off, nbytes, rows))
        elif not quant:
            self.tensors[key] = TensorInfo(key, file, FLOAT_TYPES[qtype], shape, off, off + nbytes)
        else:  # a quantised tensor vLLM loads in float: BF16, dequantised when read
            self.add_derived(TensorInfo(key, file, "BF16", shape, 0, 2 * int(np.prod(shape))),
                             self._dequant_rows(file, qtype, shape, off, nbytes))

    def _rope_rows(self, hf: str, n: int) -> np.ndarray | None:
        """HF row r of a q/k projection llama.cpp permuted is GGUF row rows[r] (None: not permuted).

        LlamaModel.permute: W.reshape(h, 2, n / h / 2, K).swapaxes(1, 2), h the module's heads."""
        if not self.arch.rope_permuted or not hf.endswith((".q_proj", ".k_proj")):
            return None
        key = "num_attention_heads" if hf.endswith(".q_proj") else "num_key_value_heads"
        h = int(self.config.get(key) or self.config["num_attention_heads"])
        if n % (2 * h):
            raise InputError(f"{hf}: {n} rows are not {h} heads of pairs", tensor=hf,
                             hint="The metadata's head counts disagree with the tensor; the file is damaged.")
        perm = np.arange(n).reshape(h, 2, n // h // 2).swapaxes(1, 2).reshape(-1)  # GGUF row i = HF row perm[i]
        return np.argsort(perm)

    def _float_rows(self, file: str, qtype: str, shape: tuple, off: int, nbytes: int, order: np.ndarray):
        info = TensorInfo("", file, FLOAT_TYPES[qtype], shape, off, off + nbytes)
        item = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[qtype]

        def rows(r0: int, r1: int) -> np.ndarray:
            buf = np.empty(shape, item)
            Checkpoint._read(self, info, buf, 0, nbytes)
            return buf[order[r0:r1]]

        return rows

    def _linear(self, module: str, file: str, qtype: str, n: int, k: int, off: int, nbytes: int, src: str,
                rows: np.ndarray | None = None) -> None:
        key = f"{module}.weight"
        if qtype in GGUF_TYPES:
            self.tensors[key] = TensorInfo(key, file, "U8", (n, nbytes // n), off, off + nbytes)
        else:
            self.tensors[key] = TensorInfo(key, file, FLOAT_TYPES[qtype], (n, k), off, off + nbytes)
        self.gguf_linears[module] = GGUFLinear(key, qtype, n, k, src, rows)

    def _dequant_rows(self, file: str, qtype: str, shape: tuple, off: int, nbytes: int):
        run = self._float_run(file, qtype, shape[0], off, nbytes)
        return lambda r0, r1: bf16_bits(run(r0, r1))

    def _rebuild_kv_b(self) -> list[str]:
        """kv_b_proj [H * (nope + v), R] of each layer whose file has attn_k_b [H, R, nope] and
        attn_v_b [H, v, R] in its place: the converter's split undone (module docstring)."""
        cfg = self.config
        done = []
        for attn, parts in sorted(self._kv_b.items()):
            key = f"{attn}.kv_b_proj.weight"
            if key in self.tensors:  # a file with attn_kv_b as well: that one is the weight vLLM loads
                continue
            if set(parts) != {"k", "v"}:
                file, *_, have = next(iter(parts.values()))
                raise InputError(f"{file}: {have} without its {'attn_v_b' if 'k' in parts else 'attn_k_b'}"
                                 " half: kv_b_proj cannot be rebuilt", tensor=have, path=str(self.folder / file),
                                 hint="The file is incomplete; re-download it.")
            (kf, kq, ks, ko, kn, kname), (vf, vq, vs, vo, vn, vname) = parts["k"], parts["v"]
            heads, rank = int(cfg["num_attention_heads"]), int(cfg["kv_lora_rank"])
            nope, v_dim = int(cfg["qk_nope_head_dim"]), int(cfg["v_head_dim"])
            if ks != (heads, rank, nope) or vs != (heads, v_dim, rank):
                raise InputError(f"{kname} {list(ks)} and {vname} {list(vs)}: expected [{heads}, {rank}, {nope}] "
                                 f"and [{heads}, {v_dim}, {rank}] (heads, kv_lora_rank, qk_nope_head_dim, "
                                 "v_head_dim of the metadata)", tensor=kname, path=str(self.folder / kf),
                                 hint="The metadata disagrees with the tensors; the file is damaged.")
            k_rows = self._float_run(kf, kq, heads * rank, ko, kn)
            v_rows = self._float_run(vf, vq, heads * v_dim, vo, vn)
            per = nope + v_dim

            def rows(r0: int, r1: int, k_rows=k_rows, v_rows=v_rows, per=per, rank=rank, nope=nope,
                     v_dim=v_dim) -> np.ndarray:
                h0, h1 = r0 // per, -(-r1 // per)  # the heads the rows lie in
                k = k_rows(h0 * rank, h1 * rank).reshape(h1 - h0, rank, nope).transpose(0, 2, 1)
                v = v_rows(h0 * v_dim, h1 * v_dim).reshape(h1 - h0, v_dim, rank)
                kv = np.concatenate([k, v], axis=1).reshape(-1, rank)
                return np.ascontiguousarray(kv[r0 - h0 * per: r1 - h0 * per])

            n = heads * per
            self.add_derived(TensorInfo(key, kf, "F32", (n, rank), 0, 4 * n * rank), rows)
            self.gguf_linears[key[: -len(".weight")]] = GGUFLinear(key, "F32", n, rank, f"{kname} + {vname}")
            done.append(key[: -len(".weight")])
        return done

    def _float_run(self, file: str, qtype: str, n_rows: int, off: int, nbytes: int):
        """rows(r0, r1) -> float32 [r1 - r0, K] of a tensor held as ``n_rows`` rows of its type, as gguf
        dequantises them."""
        row_bytes = nbytes // n_rows
        probe = TensorInfo("", file, "U8", (n_rows, row_bytes), off, off + nbytes)

        def rows(r0: int, r1: int) -> np.ndarray:
            from gguf import GGMLQuantizationType, quants

            buf = np.empty((r1 - r0, row_bytes), np.uint8)
            Checkpoint._read(self, probe, buf, r0 * row_bytes, buf.nbytes)
            return np.asarray(quants.dequantize(buf, GGMLQuantizationType[qtype]), np.float32)

        return rows

    def block_bytes(self, lin: GGUFLinear) -> np.ndarray:
        """A quantised linear's block bytes, U8 [N, bytes per row], in memory of its own."""
        t = self.tensors[lin.key]
        b = np.frombuffer(self.read_bytes(lin.key), np.uint8).reshape(t.shape)
        return b if lin.rows is None else b[lin.rows]  # rows of blocks are independent

    def extra_files(self) -> list[str]:
        return []  # the folder's other files belong to other quantisations or the hub's card

    def generated_files(self) -> dict[str, bytes]:
        return dict(self.generated)
