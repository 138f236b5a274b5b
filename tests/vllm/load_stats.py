#!/usr/bin/env python3
"""Emulated side: what loading a checkpoint costs in vLLM's Arm CPU backend.

Runs under the aarch64 interpreter that tools/arm64emu/vllm_setup.sh builds:

    python3-arm64-vllm0.32.0 tests/vllm/load_stats.py MODEL_DIR --json OUT [--dtype float32] [--max-tokens 4]
        [--torch-without-kleidiai]

``LoadStats`` (also used by tests/vllm/probe.py) wraps, without changing them, vLLM's
``BaseModelLoader.load_model`` (weights read + ``process_weights_after_loading``: the load) and
torch's ``_dyn_quant_pack_4bit_weight`` (every matrix packed meanwhile, told apart by its shape),
and reads the process's peak RSS (getrusage; under QEMU the emulator's own memory is included,
the same for every checkpoint) before and after the load, and the largest anonymous and file-backed
RSS polled during it (/proc/self/status: the file part is the checkpoint's mapped pages). Then a few
tokens are generated to show the loaded model runs. Nothing here decides pass/fail.

``--torch-without-kleidiai`` makes torch's ``_dyn_quant_pack_4bit_weight`` return its float32
reference format, as a torch built without KleidiAI does (docs/kleidiai.md 1.6): a host where
int4pack's plugin must refuse a packed checkpoint. (vLLM's aarch64 builds do not start on a CPU
without dotprod at all: QEMU's cortex-a72 dies with SIGILL while importing them.)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

T0 = time.perf_counter()


def _peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # KB on Linux


def _status_mb(*keys: str) -> dict[str, float]:
    """Current VmRSS / RssAnon / RssFile (MB) of this process (under QEMU: of the emulator)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key in keys:
                    out[key] = round(int(val.split()[0]) / 1024, 1)
    except OSError:
        pass
    return out


class _Sampler:
    """The largest anonymous and file-backed RSS seen while a block runs (polled every 50 ms): the
    anonymous part is memory the load needs; the file part is the checkpoint's mapped pages, which
    the kernel can drop under pressure."""

    def __init__(self):
        self.peak: dict[str, float] = {}
        self._stop = None

    def __enter__(self):
        import threading

        self._stop = threading.Event()

        def run():
            while True:
                for k, v in _status_mb("RssAnon", "RssFile").items():
                    self.peak[k] = max(self.peak.get(k, 0.0), v)
                if self._stop.wait(0.05):
                    return

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _in_moe_method() -> bool:
    """Whether the caller runs inside a method of a vLLM MoE quant method (FusedMoEMethodBase)."""
    f = sys._getframe(2)
    while f is not None:
        obj = f.f_locals.get("self")
        if obj is not None and any(c.__name__ == "FusedMoEMethodBase" for c in type(obj).__mro__):
            return True
        f = f.f_back
    return False


class LoadStats:
    """Counters around vLLM's model load, for one model at a time (``reset`` between models)."""

    def __init__(self):
        self.shapes: dict[tuple[int, int], int] = {}
        self.moe_shapes: dict[tuple[int, int], int] = {}  # packed from inside a MoE quant method
        self.load_seconds = None
        self.rss_before_load_mb = None
        self.peak_rss_mb = None
        self.anon_before_load_mb = None
        self.sampled: dict[str, float] = {}

    def reset(self) -> None:
        self.__init__()

    def install(self) -> None:
        import torch
        from vllm.model_executor.model_loader.base_loader import BaseModelLoader

        stats = self
        load = BaseModelLoader.load_model

        def timed_load(loader, *a, **k):
            stats.rss_before_load_mb = _peak_rss_mb()
            stats.anon_before_load_mb = _status_mb("RssAnon").get("RssAnon")
            t = time.perf_counter()
            sampler = _Sampler()
            try:
                with sampler:
                    return load(loader, *a, **k)
            finally:
                stats.load_seconds = round(time.perf_counter() - t, 2)
                stats.peak_rss_mb = _peak_rss_mb()
                stats.sampled = sampler.peak

        BaseModelLoader.load_model = timed_load
        pack = torch.ops.aten._dyn_quant_pack_4bit_weight

        class _CountedPack:  # vLLM looks the op up on torch.ops.aten at every call
            def __call__(self, *a, **k):
                key = (int(a[4]), int(a[5])) if len(a) >= 6 else (k.get("in_features"), k.get("out_features"))
                stats.shapes[key] = stats.shapes.get(key, 0) + 1
                if _in_moe_method():
                    stats.moe_shapes[key] = stats.moe_shapes.get(key, 0) + 1
                return pack(*a, **k)

            def __getattr__(self, n):
                return getattr(pack, n)

        setattr(torch.ops.aten, "_dyn_quant_pack_4bit_weight", _CountedPack())

    def result(self, model_dir: str) -> dict:
        """The counters for the model just loaded: experts = w13 matrices ([2I, H]) packed by a MoE
        method; the shapes (K x N) of every pack call (int4pack's plugin packs 13x64 probes to check
        torch's layout; attention's fused qkv can have the w13 shape too)."""
        cfg = json.load(open(os.path.join(model_dir, "config.json")))
        tc = cfg.get("text_config") or cfg
        h, inter = tc["hidden_size"], tc.get("moe_intermediate_size") or tc["intermediate_size"]
        return {"load_seconds": self.load_seconds, "rss_before_load_mb": self.rss_before_load_mb,
                "peak_rss_mb": self.peak_rss_mb, "anon_before_load_mb": self.anon_before_load_mb,
                "peak_anon_rss_mb": self.sampled.get("RssAnon"), "peak_file_rss_mb": self.sampled.get("RssFile"),
                "experts_packed_at_load": self.moe_shapes.get((h, 2 * inter), 0),
                "matrices_packed_at_load": sum(self.shapes.values()),
                "packed_shapes": {f"{k}x{n}": c for (k, n), c in sorted(self.shapes.items())}}


def _without_kleidiai() -> None:
    import torch

    pack = torch.ops.aten._dyn_quant_pack_4bit_weight

    class _ReferenceFormat:  # the op's other attributes stay the real op's
        def __call__(self, weight, scales, bias, block_size, in_features, out_features):
            parts = [weight.reshape(-1).float(), scales.reshape(-1).float()]
            return torch.cat(parts + ([bias.reshape(-1).float()] if bias is not None else []))

        def __getattr__(self, n):
            return getattr(pack, n)

    setattr(torch.ops.aten, "_dyn_quant_pack_4bit_weight", _ReferenceFormat())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--json", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--torch-without-kleidiai", action="store_true",
                    help="torch's packer writes its float32 reference format, as without KleidiAI")
    a = ap.parse_args()
    out: dict = {"model_dir": a.model, "dtype": a.dtype}
    try:
        t = time.perf_counter()
        import vllm
        import vllm._C  # noqa: F401  registers torch.ops._C.*
        from vllm import LLM, SamplingParams

        out.update(vllm=vllm.__version__, import_vllm_s=round(time.perf_counter() - t, 1), rss_after_import_mb=_peak_rss_mb())
        stats = LoadStats()
        stats.install()
        if a.torch_without_kleidiai:
            _without_kleidiai()
        t = time.perf_counter()
        llm = LLM(model=a.model, dtype=a.dtype, enforce_eager=True, skip_tokenizer_init=True, max_model_len=64,
                  max_num_seqs=1, max_num_batched_tokens=64, seed=0)
        out["init_s"] = round(time.perf_counter() - t, 1)
        out["quantization"] = llm.llm_engine.model_config.quantization
        out.update(stats.result(a.model))
        sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)
        res = llm.generate([{"prompt_token_ids": [3, 17, 42, 99, 128, 200, 7, 64]}], sp, use_tqdm=False)[0].outputs[0]
        out["token_ids"] = list(res.token_ids)
        out["logprobs"] = [{int(k): float(v.logprob) for k, v in d.items()} for d in res.logprobs or []]
    except BaseException as e:  # reported as data; the x86 side decides
        import traceback

        out["error"] = f"{type(e).__name__}: {e}"[:2000]
        out["traceback"] = traceback.format_exc()[-4000:]
    out["process_s"] = round(time.perf_counter() - T0, 1)
    with open(a.json, "w") as f:
        json.dump(out, f)
    print("VLLM_ARM_LOAD", json.dumps({k: v for k, v in out.items() if k not in ("logprobs", "traceback")}), flush=True)
    sys.stdout.flush()
    os._exit(1 if "error" in out else 0)  # skip vLLM's slow interpreter teardown under emulation


if __name__ == "__main__":
    main()
