#!/usr/bin/env python3
"""Emulated side of scripts/vllm_arm_e2e.py: load one checkpoint in vLLM's CPU backend and report.

Runs under the aarch64 interpreter that tools/arm64emu/vllm_setup.sh builds:

    /tmp/arm64emu/bin/python3-arm64-vllm0.19.1 tests/vllm/probe.py MODEL_DIR=res.json [MODEL2=res2.json ...]

It only uses vLLM's public entry point (``LLM``, token ids in, greedy) plus ``apply_model`` to
look at what every layer got after loading: the quantisation method, the dense kernel, and the
dtype/shape of the packed weights (so the x86 side can check them against the KleidiAI size
formula), and counts the calls of the W4A8 MoE op, the dynamic-4bit linear kernel and the
``_dyn_quant_matmul_4bit`` op during generation; what the load cost (tests/vllm/load_stats.py:
seconds, peak RSS, experts packed). Full-vocabulary logprobs of the prompt and of every generated token are written
out so the x86 side can compare them with its own float reference. Several models can share
one process (vLLM is imported once, the engine is torn down between them). Nothing here decides
pass/fail; the x86 side does.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time
import traceback

T0 = time.perf_counter()

# CPU backend settings for a 2-core emulated machine (values already in the environment win)
_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: qemu-user cannot spawn itself
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # apply_model with a local function
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TORCH_COMPILE_DISABLE": "1",  # no aarch64 compiler in the sysroot for inductor
}


def _dt(t) -> str:
    return str(t.dtype).replace("torch.", "")


def _describe(model) -> dict:
    """Per module with a quant_method: method, scheme, kernel, packed tensors and sizes."""
    import torch

    out = {}
    for name, m in model.named_modules():
        qm = getattr(m, "quant_method", None)
        if qm is None:
            continue
        d = {"module": type(m).__name__, "quant_method": type(qm).__name__}
        inner = getattr(qm, "old_quant_method", None) or getattr(qm, "fused_experts", None)
        if inner is not None and type(inner).__name__ != d["quant_method"]:
            d["inner"] = type(inner).__name__
        ecls = getattr(qm, "experts_cls", None)  # vLLM >= 0.2x: the experts class the MoE oracle chose
        if isinstance(ecls, type):
            d["experts_class"] = ecls.__name__
            d["experts_module"] = ecls.__module__
        sch = getattr(m, "scheme", None)
        if sch is not None:
            d["scheme"] = type(sch).__name__
            ker = getattr(sch, "kernel", None)
            if ker is not None:
                d["kernel"] = type(ker).__name__
            if hasattr(sch, "group_size"):
                d["group_size"] = sch.group_size
        for attr in ("input_size_per_partition", "output_size_per_partition", "hidden_size",
                     "intermediate_size_per_partition", "global_num_experts", "local_num_experts", "group_size"):
            v = getattr(m, attr, None)
            if isinstance(v, int) and attr not in d:
                d[attr] = v
        for pn in ("w13_weight_packed", "w2_weight_packed", "weight_packed", "weight",
                   "w13_weight", "w2_weight"):
            p = getattr(m, pn, None)
            if isinstance(p, torch.Tensor):
                d[pn] = [_dt(p), list(p.shape)]
        out[name] = d
    return out


def _rank_info(model) -> dict:
    """This worker's rank, the parameters it holds (name: dtype, shape) and its memory: with tensor or
    pipeline parallelism each rank is its own process and reports its own."""
    import resource

    import torch

    info: dict = {"pid": os.getpid()}
    try:
        from vllm.distributed import parallel_state as ps

        info["tp_rank"] = ps.get_tensor_model_parallel_rank()
        info["pp_rank"] = ps.get_pp_group().rank_in_group
    except Exception as e:  # noqa: BLE001  reported, not fatal
        info["rank_error"] = f"{type(e).__name__}: {e}"
    params = {n: [_dt(p), list(p.shape)] for n, p in model.named_parameters()}
    info["params"] = params
    info["dynamo_disabled"] = bool(torch._dynamo.config.disable)  # the model ran without TorchDynamo
    info["compiled"] = getattr(model, "_compiled_call_impl", None) is not None  # nn.Module.compile()
    info["param_bytes"] = int(sum(p.numel() * p.element_size() for p in model.parameters()))
    info["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile"):
                    info[key] = round(int(val.split()[0]) / 1024, 1)
    except OSError:
        pass
    return info


def _worker_calls(model) -> dict:
    """In a worker process (tensor or pipeline parallel ranks run the model there, not in this
    process): wrap the W4A8 ops with counters once, return their counts so far."""
    import torch

    st = getattr(torch, "_int4pack_probe_calls", None)
    if st is None:
        st = {"moe_op": 0, "dyn_quant_matmul": 0, "dynamic4bit_linear": 0}
        torch._int4pack_probe_calls = st

        def counted(key, fn):
            class _Counted:
                def __call__(self, *a, **k):
                    st[key] += 1
                    return fn(*a, **k)

                def __getattr__(self, n):
                    return getattr(fn, n)

            return _Counted()

        setattr(torch.ops._C, "dynamic_4bit_int_moe", counted("moe_op", torch.ops._C.dynamic_4bit_int_moe))
        setattr(torch.ops.aten, "_dyn_quant_matmul_4bit",
                counted("dyn_quant_matmul", torch.ops.aten._dyn_quant_matmul_4bit))
        from vllm.model_executor.kernels.linear.mixed_precision import dynamic_4bit as d4

        fn = d4.Dynamic4bitLinearKernel.apply_weights

        def apply_weights(*a, **k):
            st["dynamic4bit_linear"] += 1
            return fn(*a, **k)

        d4.Dynamic4bitLinearKernel.apply_weights = apply_weights
    return dict(st)


_STATE: dict = {}


def _count_plugin_steps(calls: dict, routes: list) -> None:
    """Where int4pack's plugin is installed: its experts run in steps (an activation vLLM's MoE op
    cannot apply, vllm_plugin/_experts.py) are counted as ``moe_steps`` and their experts recorded
    as the op's are, so the routing check sees every MoE layer whichever path ran it."""
    try:
        from int4pack.vllm_plugin import _methods
    except ImportError:  # no plugin in this site: vLLM's own methods only
        return
    fn = _methods.experts_in_steps

    def steps(x, topk_ids, *a, **k):
        calls["moe_steps"] += 1
        routes.append([sorted(r) for r in topk_ids.tolist()])
        return fn(x, topk_ids, *a, **k)

    _methods.experts_in_steps = steps


def _triton_overrides_once() -> None:
    """vllm-cpu 0.32.0 without Triton registers C++ stand-ins for its Triton kernels when a worker
    starts (platforms/cpu.py:685 register_triton_kernel_overrides), and rebinds every copy of them by
    scanning all of sys.modules (triton_utils/dispatcher.py:139 ``vars(value).get("kernel")``). With
    the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) the model class is already
    imported by then (ModelConfig asks the multimodal registry for it), and Kimi-K2.5's class pulls in
    numba, whose ``llvmlite.binding.ffi.lib`` answers any attribute, ``__dict__`` included, with a
    function wrapper: the scan stops with ``AttributeError: '_lib_fn_wrapper' object has no attribute
    'get'``. In vLLM's default setup the engine core is a fresh process whose worker registers them
    before the model is loaded; here they are registered once, now, before any model class is
    imported, and later calls in this process do nothing (the kernels are already replaced; a second
    scan would only wrap the wrappers)."""
    from vllm.platforms import current_platform

    cls = type(current_platform)
    if not hasattr(cls, "register_triton_kernel_overrides"):  # vLLM 0.19: no such step
        return
    current_platform.register_triton_kernel_overrides()
    cls.register_triton_kernel_overrides = classmethod(lambda c: None)


def counted(calls: dict, key: str, fn):
    """``fn`` counting its calls in ``calls[key]``, with ``fn``'s signature: the plugin reads the
    W4A8 MoE method's (whether its apply_monolithic takes input_ids), which a bare ``*a, **k``
    wrapper would hide (vLLM DeepSeek-V4's hash-routed layers then refused as "no token ids")."""
    @functools.wraps(fn)
    def wrapper(*a, **k):
        calls[key] += 1
        return fn(*a, **k)
    return wrapper


def _setup() -> dict:
    """Import vLLM once per process and wrap (not replace) the W4A8 entry points with call counters."""
    if _STATE:
        return _STATE
    t = time.perf_counter()
    import torch
    import vllm
    import vllm._C  # noqa: F401  registers torch.ops._C.*
    from vllm.model_executor.kernels.linear.mixed_precision import dynamic_4bit as d4

    try:  # vLLM >= 0.2x: one module per MoE scheme
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
            compressed_tensors_moe_w4a8_int8 as ctm,
        )
    except ImportError:  # vLLM 0.19: every MoE scheme in compressed_tensors_moe.py
        from vllm.model_executor.layers.quantization.compressed_tensors import compressed_tensors_moe as ctm

    # vLLM inspects each model class in a fresh interpreter (to keep CUDA out of the parent) and
    # caches the answer; under QEMU that child is another full vLLM import (minutes). There is no
    # CUDA here: inspect in this process instead.
    from vllm.model_executor.models import registry

    registry._run_in_subprocess = lambda fn: fn()
    _triton_overrides_once()

    calls = {"moe_op": 0, "moe_steps": 0, "w4a8_moe_apply": 0, "dynamic4bit_linear": 0, "dyn_quant_matmul": 0}
    routes: list = []  # the experts each MoE op call was given, one [tokens][top-k] list per call

    def counting(key, fn):
        return counted(calls, key, fn)

    meth = ctm.CompressedTensorsW4A8Int8MoEMethod
    for attr in ("apply_monolithic", "apply"):
        if attr in vars(meth):
            setattr(meth, attr, counting("w4a8_moe_apply", vars(meth)[attr]))
            break
    d4.Dynamic4bitLinearKernel.apply_weights = counting("dynamic4bit_linear", d4.Dynamic4bitLinearKernel.apply_weights)
    op = torch.ops._C.dynamic_4bit_int_moe

    class _CountedOp:
        def __call__(self, *a, **k):
            calls["moe_op"] += 1
            ids = k["topk_ids"] if "topk_ids" in k else a[1]
            routes.append([sorted(r) for r in ids.tolist()])  # sets: the kernel's order does not matter
            return op(*a, **k)

        def __getattr__(self, n):
            return getattr(op, n)

    setattr(torch.ops._C, "dynamic_4bit_int_moe", _CountedOp())
    matmul = torch.ops.aten._dyn_quant_matmul_4bit  # the dense W4A8 linears' op, whoever calls it

    class _CountedMatmul:
        def __call__(self, *a, **k):
            calls["dyn_quant_matmul"] += 1
            return matmul(*a, **k)

        def __getattr__(self, n):
            return getattr(matmul, n)

    setattr(torch.ops.aten, "_dyn_quant_matmul_4bit", _CountedMatmul())
    _count_plugin_steps(calls, routes)
    from load_stats import LoadStats  # this folder: load seconds, peak RSS, experts packed at load

    load_stats = LoadStats()
    load_stats.install()
    _STATE.update(calls=calls, routes=routes, load_stats=load_stats, import_vllm_s=round(time.perf_counter() - t, 1), vllm=vllm.__version__,
                  torch=torch.__version__, moe_op_schema=str(op.default._schema))
    return _STATE


# Pipeline parallelism needs a compilation mode other than NONE. vllm-cpu 0.32.0's rank > 0 receives
# the previous rank's hidden states into a buffer that only the dummy run makes
# (v1/worker/gpu_model_runner.py:5800-5806); the CPU runner's only caller of it, warming_up_model,
# returns at once when the compilation mode is NONE (v1/worker/cpu_model_runner.py:84-86), which
# enforce_eager=True and TORCH_COMPILE_DISABLE=1 both select (config/vllm.py:1691, 1711), so the
# first step stops at ``assert self.intermediate_tensors is not None`` (gpu_model_runner.py:3174).
# STOCK_TORCH_COMPILE compiles nothing on CPU: the model's decorators leave the model as it is in
# that mode (compilation/decorators.py:400-406, the runner is to compile it) and CPUModelRunner's
# load_model does not (cpu_model_runner.py:62-79; only the GPU runner's calls model.compile), and
# the CPU platform rewrites only VLLM_COMPILE (platforms/cpu.py:356). So the model runs eagerly, as
# with enforce_eager, and the warm-up dummy run makes the buffer. TorchDynamo stays off in every
# process (the sampler's torch.compile'd helper would need a C++ compiler): it was read from
# TORCH_COMPILE_DISABLE=1 when torch was imported here, and the wrapper sets it again for each rank
# it spawns; only vLLM's config check must not see it, in this process.
PP_COMPILATION = {"enforce_eager": False, "mode": "STOCK_TORCH_COMPILE", "backend": "eager", "cudagraph_mode": "NONE"}


# options a model class needs on vLLM's CPU platform, by model type (text or outer): GLM-5.3-Flash
# and Kimi-K3 are hybrid (linear attention beside MLA). vLLM's hybrid hook sets mamba_block_size to
# the block size while prefix caching is on by default (model_executor/models/config.py:701), then
# the CPU platform turns prefix caching off for MLA (platforms/cpu.py:526), and the config check
# refuses the pair ("--mamba-block-size can only be set with --enable-prefix-caching",
# engine/arg_utils.py:2838). Asking for no prefix caching from the start makes the hook take
# max_model_len instead (config.py:709); one prompt, served once, reuses no prefix anyway.
MODEL_ENGINE_OPTIONS = {t: {"enable_prefix_caching": False} for t in ("glm5_next", "kimi_k3")}
# environment a model class needs there: Kimi-K3's class (its NVIDIA implementation, which vLLM picks
# on every non-ROCm platform) imports the CuTe DSL GEMM + all-reduce (cutlass) at construction
# unless VLLM_KIMI_K3_GEMM_AR=0 (models/kimi_k3/nvidia/model.py:184), a multi-GPU fusion
MODEL_ENV = {"kimi_k3": {"VLLM_KIMI_K3_GEMM_AR": "0"}}


def model_engine_options(cfg: dict, table: dict = MODEL_ENGINE_OPTIONS) -> dict:
    """The LLM(...) options (or, ``table`` MODEL_ENV, the environment) named for this config's model type."""
    types = (cfg.get("model_type"), (cfg.get("text_config") or {}).get("model_type"))
    return next((dict(table[t]) for t in types if t in table), {})


def engine_options(pp: int) -> dict:
    """LLM(...) options of the compilation: enforce_eager as everywhere in the lane, except with
    pipeline ranks (see PP_COMPILATION)."""
    if pp <= 1:
        return {"enforce_eager": True}
    from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode

    os.environ.pop("TORCH_COMPILE_DISABLE", None)  # torch has read it; spawned ranks get it from the wrapper
    return {"enforce_eager": False, "compilation_config": CompilationConfig(
        mode=CompilationMode[PP_COMPILATION["mode"]], backend=PP_COMPILATION["backend"],
        cudagraph_mode=CUDAGraphMode[PP_COMPILATION["cudagraph_mode"]])}


def run(model_dir: str, prompt: list[int], max_tokens: int, dtype: str, tp: int = 1, pp: int = 1) -> dict:
    st = _setup()
    from vllm import LLM, SamplingParams

    res: dict = {k: st[k] for k in ("import_vllm_s", "vllm", "torch", "moe_op_schema")}
    calls = st["calls"]
    for k in calls:
        calls[k] = 0
    st["load_stats"].reset()
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    vocab = (cfg.get("text_config") or cfg)["vocab_size"]
    t = time.perf_counter()
    par = {}
    if tp * pp > 1:  # each rank its own worker process (spawned through the qemu wrapper)
        par = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "distributed_executor_backend": "mp"}
    res["tensor_parallel_size"], res["pipeline_parallel_size"] = tp, pp
    res["engine_options"] = {"enforce_eager": True} if pp <= 1 else dict(PP_COMPILATION)
    par.update(model_engine_options(cfg))
    res["engine_options"].update(model_engine_options(cfg))
    env = model_engine_options(cfg, MODEL_ENV)
    if env:  # this model's start only: the next input in this process gets the environment back
        res["engine_options"]["env"] = env
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
    if "vision_config" in cfg:  # token ids in, no images: the text model only (its multimodal processor
        # needs a tokenizer, which skip_tokenizer_init leaves out: multimodal/processing/processor.py:1047)
        par["language_model_only"] = res["engine_options"]["language_model_only"] = True
    llm = None
    try:  # an engine that fails while it starts is torn down here too, not by the next model's start
        llm = LLM(model=model_dir, dtype=dtype, skip_tokenizer_init=True, max_model_len=128,
                  max_num_seqs=2, max_num_batched_tokens=128, max_logprobs=vocab, seed=0, **engine_options(pp),
                  **par)
        res["init_s"] = round(time.perf_counter() - t, 1)
        cc = getattr(getattr(llm.llm_engine, "vllm_config", None), "compilation_config", None)
        res["compilation_mode"] = getattr(getattr(cc, "mode", None), "name", None)
        res["quantization"] = llm.llm_engine.model_config.quantization
        i4p = sys.modules.get("int4pack")  # the plugin's package, where vLLM loaded it from
        if i4p is not None:
            res["int4pack"] = {"file": i4p.__file__, "version": getattr(i4p, "__version__", None)}
        # peak RSS: the process's, so models loaded before in the same process count (--isolate)
        res.update(st["load_stats"].result(model_dir))
        layers: dict = {}
        for part in llm.apply_model(_describe):  # pipeline ranks each describe their own layers
            for k, v in part.items():
                layers.setdefault(k, v)
        res["layers"] = layers
        res["ranks"] = llm.apply_model(_rank_info)  # one entry per worker: what each rank holds
        if tp * pp > 1:
            llm.apply_model(_worker_calls)
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=vocab,
                            prompt_logprobs=vocab)
        st["routes"].clear()  # from here: the generation's MoE calls only (not the engine's warm-up)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": list(prompt)}], sp, use_tqdm=False)
        res["generate_s"] = round(time.perf_counter() - t, 2)
        res["calls"] = dict(calls)
        if tp * pp == 1:  # in one process the calls come layer by layer, step by step
            res["routes"] = list(st["routes"])
        if tp * pp > 1:  # the ranks ran the model: their counts, summed
            per = llm.apply_model(_worker_calls)
            res["calls_per_rank"] = per
            res["calls"] = {k: sum(c.get(k, 0) for c in per) for k in per[0]}
        o = outs[0]
        res["max_tokens"] = max_tokens
        res["token_ids"] = list(o.outputs[0].token_ids)
        res["logprobs"] = [{int(k): float(v.logprob) for k, v in d.items()} for d in (o.outputs[0].logprobs or [])]
        res["prompt_logprobs"] = [None if d is None else {int(k): float(v.logprob) for k, v in d.items()}
                                  for d in (o.prompt_logprobs or [])]
    finally:
        llm = None
        _release()
        for k, v in (saved if env else {}).items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return res


def _release() -> None:
    """Tear the engine down so the next model can start in this process (as vLLM's own tests do)."""
    import gc

    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception:  # noqa: BLE001  best effort; a failed next start is reported by that run
        pass
    gc.collect()


def probe_inputs(items: list[str], prompt: list[int], max_tokens: int, dtype: str, tp: int = 1, pp: int = 1) -> int:
    """Probe each MODEL_DIR=OUT_JSON in turn, writing its JSON; the number that failed. One failed
    input never decides the next: the failure's traceback holds the half-started engine (its frames
    reference it), so the frames are cleared and the engine torn down (``_release``) before the next
    input starts; left to the garbage collector, its teardown would run in the middle of the next
    model's engine and destroy that engine's process groups (vLLM: "pipeline model parallel group is
    not initialized")."""
    failed = 0
    for item in items:
        model_dir, _, out = item.partition("=")
        if not out:
            raise SystemExit(f"{item}: expected MODEL_DIR=OUT_JSON")
        t0 = time.perf_counter()
        R = {"machine": platform.machine(), "python": sys.version.split()[0], "qemu_cpu": os.environ.get("QEMU_CPU"),
             "model_dir": model_dir, "dtype": dtype, "prompt": list(prompt)}
        try:
            R.update(run(model_dir, R["prompt"], max_tokens, dtype, tp, pp))
        except BaseException as e:  # report the failure as data; the x86 side decides
            R["error"] = f"{type(e).__name__}: {e}"[:2000]
            R["traceback"] = traceback.format_exc()[-4000:]
            R.update({k: _STATE[k] for k in ("vllm", "torch", "moe_op_schema", "import_vllm_s") if k in _STATE})
            failed += 1
            traceback.clear_frames(e.__traceback__)
            del e
            _release()
        R["model_s"] = round(time.perf_counter() - t0, 1)
        R["process_s"] = round(time.perf_counter() - T0, 1)
        with open(out, "w") as f:
            json.dump(R, f)
        print("VLLM_ARM_PROBE", json.dumps({k: R.get(k) for k in ("model_dir", "error", "token_ids", "calls",
                                                                   "init_s", "model_s")}), flush=True)
    return failed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", metavar="MODEL_DIR=OUT_JSON",
                    help="one or more checkpoint folders, each with the JSON file to write (one vLLM import)")
    ap.add_argument("--prompt", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tensor-parallel", type=int, default=1, help="LLM(tensor_parallel_size=N)")
    ap.add_argument("--pipeline-parallel", type=int, default=1, help="LLM(pipeline_parallel_size=N)")
    a = ap.parse_args()
    for k, v in _ENV.items():
        os.environ.setdefault(k, v)
    failed = probe_inputs(a.models, [int(x) for x in a.prompt.split(",") if x], a.max_tokens, a.dtype,
                          a.tensor_parallel, a.pipeline_parallel)
    sys.stdout.flush()
    os._exit(1 if failed else 0)  # skip vLLM's slow interpreter teardown under emulation


if __name__ == "__main__":
    main()
