#!/usr/bin/env python3
"""Whole-model benchmark: real transformers 5 models, plain against
colibri.torch.accelerate(model), measured in the same process.

Two models are built with transformers' own classes from a config
(AutoModelForCausalLM.from_config; nothing is downloaded, the weights are
transformers' random initialisation, seed 0), at real widths with few layers
and a small vocabulary:

  qwen3-moe  Qwen3MoeConfig: hidden 2048, 128 experts, top-8,
             moe_intermediate_size 768, norm_topk_prob, 32 attention heads
             of 128 and 4 KV heads (Qwen3-30B-A3B's attention), 2 layers
             (--qwen3-layers), vocabulary 1024 (--vocab)
  mixtral    MixtralConfig: hidden 4096, 8 experts, top-2, intermediate
             14336, 32 heads of 128 and 8 KV heads (Mixtral-8x7B's), 1 layer
             (--mixtral-layers), vocabulary 1024

Every decoder layer is a sparse-MoE layer. For each model and dtype
(float32, bfloat16), in one child process per (model, dtype) so that one
case's memory is gone before the next starts and RSS figures are its own:

  1. plain transformers, twice: with the experts implementation transformers
     picks by itself (config._experts_implementation after from_config:
     "grouped_mm" in 5.x, when the model class supports it) and with "eager"
     (the per-expert loop), switched with model.set_experts_implementation;
  2. colibri.torch.accelerate(model) (default options: each block's own
     dtype, unless --accelerate-dtype; threads=--threads), the RSS (VmRSS
     and VmHWM from /proc/self/status) printed before and after;
  3. the accelerated model, measured the same way.

Measurements (torch.inference_mode, torch.set_num_threads(--threads)):

  prefill  one forward over --prefill-tokens (128) tokens, batch 1,
           use_cache=False: median of --prefill-reps calls after one warm-up.
  decode   model.generate(prompt of --prompt-tokens, do_sample=False,
           max_new_tokens=N, min_new_tokens=N), N = --new-tokens. A logits
           processor records a timestamp at every step; a step's time is
           the difference between consecutive stamps (one decode forward,
           its cache update and the greedy pick), the prefill of the prompt
           excluded. Decode tokens/s = 1 / median step time over
           --generate-reps generate calls after one warm-up call (the mean
           rate over all steps is in the JSON too).

How much time is spent outside the MoE layers: forward pre- and post-hooks
on every sparse-MoE block (the module holding .gate and .experts: router
plus experts) and on its .experts module take perf_counter timestamps (CPU
execution is synchronous, so a block's time is its wall time). One extra
prefill and one extra generate are run with the hooks on (the timed runs
above run without them); the MoE share is the blocks' time over the run's
time (for decode, over the steps after the first token, as above), and
"outside MoE" is the rest: attention, norms, embeddings, the LM head and
generate's own work. The hooks cost about a microsecond per call; the
accelerated blocks' hooks see the patched forwards, since accelerate()
replaces the forward and leaves __call__ (where hooks run) alone.

Each measurement first waits (up to --max-wait s) for a moment in which
other processes use less than --quiet-threshold of the machine, and records
the share they used while it ran ("others' load", /proc/stat less this
process's own CPU time, as bench/run_suite.py does).

Output: a markdown table on stdout (also --md), JSON at --out. Timings on a
shared 2-core machine are noisy; compare the ratios, which come from one
process and minutes.

  .venv/bin/python bench/whole_model.py --threads 2 --out bench/results/whole-model/whole_model.json
  .venv/bin/python bench/whole_model.py --tiny --out /tmp/wm.json   # a few seconds: does it run?

Colibri is imported from the source tree (python/), the library from
build/libcolibri.so unless COLIBRI_LIBRARY is set.
"""

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from run_suite import LoadMeter, cpu_flags, cpu_model  # noqa: E402  (the suite's load meter and CPU facts)

MODELS = ("qwen3-moe", "mixtral")
DTYPES = ("float32", "bfloat16")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated: " + ", ".join(DTYPES))
    p.add_argument("--qwen3-layers", type=int, default=2, help="decoder layers of the qwen3-moe model (2-4)")
    p.add_argument("--mixtral-layers", type=int, default=1, help="decoder layers of the mixtral model")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--prefill-tokens", type=int, default=128)
    p.add_argument("--prefill-reps", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=16, help="prompt length of the generate calls")
    p.add_argument("--new-tokens", type=int, default=32, help="N: max_new_tokens = min_new_tokens")
    p.add_argument("--generate-reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads and Colibri's threads")
    p.add_argument("--accelerate-dtype", choices=["f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "q4_k_m"],
                   help="pass dtype= to accelerate() (default: not passed, so each block keeps its own dtype)")
    p.add_argument("--quiet-threshold", type=float, default=0.2,
                   help="share of the machine other processes may use before a measurement starts")
    p.add_argument("--max-wait", type=float, default=60.0,
                   help="seconds to wait for such a quiet moment before each measurement (then measure anyway)")
    p.add_argument("--out", required=True, help="JSON results")
    p.add_argument("--md", help="also write the markdown tables here")
    p.add_argument("--tiny", action="store_true",
                   help="tiny widths and few tokens: checks that everything runs (not a measurement)")
    p.add_argument("--case", help=argparse.SUPPRESS)  # internal: MODEL:DTYPE, run in a child process
    p.add_argument("--case-out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.model_list = [m.strip() for m in a.models.split(",") if m.strip()]
    a.dtype_list = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    for m in a.model_list:
        if m not in MODELS:
            p.error("unknown model %s (known: %s)" % (m, ", ".join(MODELS)))
    for d in a.dtype_list:
        if d not in DTYPES:
            p.error("unknown dtype %s (known: %s)" % (d, ", ".join(DTYPES)))
    if a.tiny:
        a.prefill_tokens, a.prefill_reps, a.prompt_tokens = min(a.prefill_tokens, 16), 2, 4
        a.new_tokens, a.generate_reps, a.max_wait = min(a.new_tokens, 6), 1, 0.0
    return a


def log(msg):
    print("[%s] %s" % (time.strftime("%H:%M:%S"), msg), file=sys.stderr, flush=True)


def proc_status():
    """VmRSS and VmHWM of this process in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    return out


def gib(n):
    return "%.2f GiB" % (n / 2**30)


# ---------------------------------------------------------------- one case


def config_for(name, a, transformers):
    common = dict(vocab_size=a.vocab, max_position_embeddings=4096, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if a.tiny:
        if name == "qwen3-moe":
            return transformers.Qwen3MoeConfig(**common, hidden_size=128, intermediate_size=256,
                                               moe_intermediate_size=64, num_experts=16, num_experts_per_tok=4,
                                               norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=2, head_dim=32, decoder_sparse_step=1)
        return transformers.MixtralConfig(**common, hidden_size=128, intermediate_size=256, num_local_experts=4,
                                          num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=32)
    if name == "qwen3-moe":
        # Qwen3-30B-A3B's widths: 2048 hidden, 128 experts of 768, top-8
        # renormalised, 32 query heads of 128, 4 KV heads.
        return transformers.Qwen3MoeConfig(**common, hidden_size=2048, intermediate_size=6144,
                                           moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                           norm_topk_prob=True, num_hidden_layers=a.qwen3_layers,
                                           num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                           decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6)
    # Mixtral-8x7B's widths.
    return transformers.MixtralConfig(**common, hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                                      num_experts_per_tok=2, num_hidden_layers=a.mixtral_layers,
                                      num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                      rms_norm_eps=1e-5)


def moe_blocks(model):
    """(path, block) for every sparse-MoE block: a module with .gate and
    .experts (router and experts)."""
    import torch

    return [(p, m) for p, m in model.named_modules()
            if isinstance(getattr(m, "experts", None), torch.nn.Module) and hasattr(m, "gate")]


class Hooks:
    """perf_counter intervals of every MoE block call and every experts
    module call, while attached."""

    def __init__(self, blocks):
        self.blocks, self.handles = blocks, []
        self.moe, self.experts = [], []

    def __enter__(self):
        def pre(store):
            def f(mod, args, kwargs=None):
                mod.__dict__["_wm_t0"] = time.perf_counter()
            return f

        def post(store):
            def f(mod, args, out):
                store.append((mod.__dict__.pop("_wm_t0"), time.perf_counter()))
            return f

        for _, b in self.blocks:
            for mod, store in ((b, self.moe), (b.experts, self.experts)):
                self.handles.append(mod.register_forward_pre_hook(pre(store)))
                self.handles.append(mod.register_forward_hook(post(store)))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []

    @staticmethod
    def total(intervals, since=None, until=None):
        return sum(e - s for s, e in intervals if (since is None or s >= since) and (until is None or e <= until))


def run_case(a):
    """One (model, dtype): plain (default and eager experts), accelerate,
    accelerated. Returns a dict (written as JSON for the parent)."""
    name, dtype_name = a.case.split(":")
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(a.threads))
    os.environ.setdefault("COLIBRI_LIBRARY", os.path.join(ROOT, "build", "libcolibri.so"))
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    import colibri
    import colibri.torch as ct

    torch.set_num_threads(a.threads)
    dtype = getattr(torch, dtype_name)
    res = {"model": name, "dtype": dtype_name, "threads": a.threads, "torch": torch.__version__,
           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
           "transformers": transformers.__version__, "colibri_library": colibri.library_path(), "memory": {}}
    mem = res["memory"]
    mem["start"] = proc_status()

    cfg = config_for(name, a, transformers)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    res["build_s"] = time.perf_counter() - t0
    gc.collect()
    mem["after_build"] = proc_status()
    blocks = moe_blocks(model)
    n_params = sum(p.numel() for p in model.parameters())
    n_expert = sum(p.numel() for _, b in blocks for p in b.experts.parameters())
    res.update(config={k: v for k, v in cfg.to_dict().items() if isinstance(v, (int, float, str, bool, type(None)))},
               parameters=n_params, expert_parameters=n_expert,
               expert_bytes=n_expert * torch.tensor([], dtype=dtype).element_size(),
               moe_blocks=[p for p, _ in blocks], block_class=type(blocks[0][1]).__name__ if blocks else None,
               experts_class=type(blocks[0][1].experts).__name__ if blocks else None,
               attn_implementation=model.config._attn_implementation,
               default_experts_implementation=model.config._experts_implementation)
    log("%s %s: built in %.1f s, %.2f G parameters (%.2f G in experts, %s), RSS %s; %d MoE blocks (%s / %s); "
        "experts implementation by default: %s; attention: %s"
        % (name, dtype_name, res["build_s"], n_params / 1e9, n_expert / 1e9, gib(res["expert_bytes"]),
           gib(mem["after_build"]["VmRSS"]), len(blocks), res["block_class"], res["experts_class"],
           res["default_experts_implementation"], res["attn_implementation"]))

    g = torch.Generator().manual_seed(1)
    prefill_ids = torch.randint(3, a.vocab, (1, a.prefill_tokens), generator=g)
    prompt_ids = torch.randint(3, a.vocab, (1, a.prompt_tokens), generator=g)

    class Stamp(LogitsProcessor):
        def __init__(self):
            self.t = []

        def __call__(self, input_ids, scores):
            self.t.append(time.perf_counter())
            return scores

    def prefill_once():
        return model(input_ids=prefill_ids, use_cache=False).logits

    def generate_once():
        st = Stamp()
        out = model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), do_sample=False,
                             max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens,
                             logits_processor=LogitsProcessorList([st]), pad_token_id=0)
        return out[0, prompt_ids.shape[1]:].tolist(), st.t

    meter = LoadMeter()

    def measure(label):
        m = {"label": label}
        # Other processes on this shared machine: wait for a quiet moment,
        # then record how much of the machine they took meanwhile.
        m["others_before"] = meter.wait_for_quiet(a.quiet_threshold, a.max_wait) if a.max_wait > 0 else 0.0
        s0 = meter.snapshot()
        with torch.inference_mode():
            logits = prefill_once()  # warm-up
            times = []
            for _ in range(a.prefill_reps):
                t0 = time.perf_counter()
                prefill_once()
                times.append(time.perf_counter() - t0)
            m["prefill_ms"] = statistics.median(times) * 1e3
            m["prefill_ms_all"] = [t * 1e3 for t in times]
            m["prefill_tokens_per_s"] = a.prefill_tokens / statistics.median(times)
            tokens, _ = generate_once()  # warm-up
            steps, rates = [], []
            for _ in range(a.generate_reps):
                tokens, st = generate_once()
                d = [y - x for x, y in zip(st, st[1:])]
                steps += d
                rates.append(len(d) / (st[-1] - st[0]))
            m["decode_step_ms_median"] = statistics.median(steps) * 1e3
            m["decode_tokens_per_s"] = 1.0 / statistics.median(steps)
            m["decode_tokens_per_s_mean_rate"] = statistics.median(rates)
            m["decode_steps_timed"] = len(steps)
            m["tokens"] = tokens
            # MoE share, one hooked run of each.
            with Hooks(blocks) as h:
                t0 = time.perf_counter()
                prefill_once()
                t1 = time.perf_counter()
            m["prefill_hooked_ms"] = (t1 - t0) * 1e3
            m["prefill_moe_ms"] = Hooks.total(h.moe) * 1e3
            m["prefill_experts_ms"] = Hooks.total(h.experts) * 1e3
            m["prefill_moe_share"] = m["prefill_moe_ms"] / m["prefill_hooked_ms"]
            m["prefill_outside_moe_ms"] = m["prefill_hooked_ms"] - m["prefill_moe_ms"]
            with Hooks(blocks) as h:
                _, st = generate_once()
            span = st[-1] - st[0]
            moe = Hooks.total(h.moe, since=st[0], until=st[-1])
            ex = Hooks.total(h.experts, since=st[0], until=st[-1])
            n = len(st) - 1
            m["decode_hooked_step_ms"] = span / n * 1e3
            m["decode_moe_ms_per_token"] = moe / n * 1e3
            m["decode_experts_ms_per_token"] = ex / n * 1e3
            m["decode_moe_share"] = moe / span
            m["decode_outside_moe_ms_per_token"] = (span - moe) / n * 1e3
        m["other_load"] = meter.other_load(s0, meter.snapshot())
        log("  %-28s prefill %8.1f ms (MoE %3.0f%%) | decode %7.2f tok/s, %7.2f ms/token (MoE %3.0f%%, outside "
            "MoE %.2f ms/token); others' load %.0f%%" % (
                label, m["prefill_ms"], 100 * m["prefill_moe_share"], m["decode_tokens_per_s"],
                m["decode_step_ms_median"], 100 * m["decode_moe_share"], m["decode_outside_moe_ms_per_token"],
                100 * m["other_load"]))
        return m, logits.float()

    runs = []
    default_impl = res["default_experts_implementation"]
    impls = [default_impl] + (["eager"] if default_impl != "eager" else [])
    ref_logits = {}
    for impl in impls:
        model.set_experts_implementation(impl)
        assert model.config._experts_implementation == impl, model.config._experts_implementation
        m, logits = measure("transformers %s%s" % (impl, " (default)" if impl == default_impl else ""))
        m.update(engine="transformers", experts_implementation=impl, default=impl == default_impl)
        ref_logits[impl] = logits
        runs.append(m)
    if "eager" in ref_logits and default_impl in ref_logits and default_impl != "eager":
        d = ref_logits[default_impl] - ref_logits["eager"]
        res["default_vs_eager_logits_rel_l2"] = float(d.norm() / ref_logits["eager"].norm())
    model.set_experts_implementation(default_impl)

    gc.collect()
    mem["before_accelerate"] = proc_status()
    log("  RSS before accelerate(): %s (peak so far %s)" % (gib(mem["before_accelerate"]["VmRSS"]),
                                                           gib(mem["before_accelerate"]["VmHWM"])))
    t0 = time.perf_counter()
    kw = {"dtype": a.accelerate_dtype} if a.accelerate_dtype else {}
    report = ct.accelerate(model, threads=a.threads, **kw)
    res["accelerate_s"] = time.perf_counter() - t0
    gc.collect()
    mem["after_accelerate"] = proc_status()
    log("  RSS after accelerate():  %s (peak %s); accelerate() took %.1f s"
        % (gib(mem["after_accelerate"]["VmRSS"]), gib(mem["after_accelerate"]["VmHWM"]), res["accelerate_s"]))
    # glibc may keep freed memory in its heaps (RSS stays high although the
    # released PyTorch weights are free); malloc_trim(0) hands it back, which
    # tells retained-but-free memory from memory still in use.
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        mem["after_accelerate_malloc_trim"] = proc_status()
        log("  RSS after malloc_trim(0): %s" % gib(mem["after_accelerate_malloc_trim"]["VmRSS"]))
    except (OSError, AttributeError):
        pass
    res["accelerate_report"] = str(report)
    res["accelerated_blocks"] = len(report.accelerated)
    res["colibri_dtypes"] = sorted({b.dtype for b in report.accelerated})
    res["colibri_kernels"] = [m_.kernels for m_ in report.models]
    res["skipped_blocks"] = report.skipped
    log("  " + str(report).replace("\n", "\n  "))
    if not report.accelerated:
        raise RuntimeError("accelerate() recognised no MoE block: %s" % report)
    m, logits = measure("colibri accelerate (%s)" % ",".join(res["colibri_dtypes"]))
    m.update(engine="colibri", experts_implementation=None, default=False)
    ref = ref_logits[default_impl]
    m["logits_rel_l2_vs_default"] = float((logits - ref).norm() / ref.norm())
    ref_tokens = runs[0]["tokens"]
    m["greedy_tokens_same_as_default"] = sum(int(x == y) for x, y in zip(m["tokens"], ref_tokens)) / len(ref_tokens)
    m["calls_into_colibri"] = sum(getattr(getattr(b, "_colibri_state", None) or
                                          getattr(b.experts, "_colibri_state", None), "calls", 0) for _, b in blocks)
    runs.append(m)
    gc.collect()
    mem["end"] = proc_status()
    res["runs"] = runs
    return res


# ---------------------------------------------------------------- parent


def ratio(x, y):
    return x / y if x and y else None


def tables(results, a):
    lines = []
    for res in results:
        if "error" in res:
            continue
        runs = res["runs"]
        by = {r["label"]: r for r in runs}
        dflt = next(r for r in runs if r["engine"] == "transformers" and r["default"])
        eager = next((r for r in runs if r["engine"] == "transformers" and r["experts_implementation"] == "eager"),
                     None)
        for r in runs:
            r["prefill_speedup_vs_default"] = ratio(dflt["prefill_ms"], r["prefill_ms"])
            r["decode_speedup_vs_default"] = ratio(r["decode_tokens_per_s"], dflt["decode_tokens_per_s"])
            if eager:
                r["prefill_speedup_vs_eager"] = ratio(eager["prefill_ms"], r["prefill_ms"])
                r["decode_speedup_vs_eager"] = ratio(r["decode_tokens_per_s"], eager["decode_tokens_per_s"])
        del by
    head = ("| model | dtype | engine | prefill %d tok: ms | x default | x eager | prefill: in MoE | "
            "decode tok/s | x default | x eager | decode: in MoE | outside MoE, ms/token | others' load |" % a.prefill_tokens)
    lines += [head, "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def x(v):
        return "" if v is None else "%.2fx" % v

    for res in results:
        if "error" in res:
            lines.append("| %s | %s | ERROR | %s |" % (res["model"], res["dtype"], res["error"].splitlines()[-1][:200]))
            continue
        for r in res["runs"]:
            lines.append("| %s | %s | %s | %.1f | %s | %s | %.0f%% | %.2f | %s | %s | %.0f%% | %.2f | %.0f%% |" % (
                res["model"], res["dtype"], r["label"], r["prefill_ms"], x(r["prefill_speedup_vs_default"]),
                x(r.get("prefill_speedup_vs_eager")), 100 * r["prefill_moe_share"], r["decode_tokens_per_s"],
                x(r["decode_speedup_vs_default"]), x(r.get("decode_speedup_vs_eager")), 100 * r["decode_moe_share"],
                r["decode_outside_moe_ms_per_token"], 100 * r.get("other_load", 0.0)))
    lines += ["", "| model | dtype | expert weights | RSS after build | before accelerate() | after accelerate() | "
              "then after malloc_trim(0) | peak (VmHWM) | accelerated blocks | Colibri logits vs default (rel. L2) | "
              "same greedy tokens |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        if "error" in res:
            continue
        mem, acc = res["memory"], res["runs"][-1]
        trim = mem.get("after_accelerate_malloc_trim")
        lines.append("| %s | %s | %s | %s | %s | %s | %s | %s | %d | %.1e | %.0f%% |" % (
            res["model"], res["dtype"], gib(res["expert_bytes"]), gib(mem["after_build"]["VmRSS"]),
            gib(mem["before_accelerate"]["VmRSS"]), gib(mem["after_accelerate"]["VmRSS"]),
            gib(trim["VmRSS"]) if trim else "",
            gib(mem["end"]["VmHWM"]), res["accelerated_blocks"], acc["logits_rel_l2_vs_default"],
            100 * acc["greedy_tokens_same_as_default"]))
    return lines


def main(argv=None):
    a = parse_args(argv)
    if a.case:
        try:
            res = run_case(a)
        except Exception as e:  # noqa: BLE001  (reported by the parent)
            import traceback

            res = {"model": a.case.split(":")[0], "dtype": a.case.split(":")[1], "error": traceback.format_exc()}
            log("ERROR %s: %r" % (a.case, e))
        with open(a.case_out, "w") as f:
            json.dump(res, f, indent=1, default=str)
        return 0

    t_start = time.time()
    doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join([sys.argv[0]] + (sys.argv[1:] if argv is None else argv)),
           "cpu": cpu_model(), "cpus_online": len(os.sched_getaffinity(0)),
           "cpu_flags_of_interest": sorted(cpu_flags() & {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile",
                                                          "avx512_fp16"}),
           "kernel": platform.release(), "tiny": a.tiny,
           "settings": {k: getattr(a, k) for k in ("qwen3_layers", "mixtral_layers", "vocab", "prefill_tokens",
                                                   "prefill_reps", "prompt_tokens", "new_tokens", "generate_reps",
                                                   "threads", "accelerate_dtype")},
           "results": []}
    try:
        doc["git"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        doc["git"] = "unknown"
    for name in a.model_list:
        for dt in a.dtype_list:
            log("=== %s %s" % (name, dt))
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tf:
                case_out = tf.name
            cmd = [sys.executable, os.path.abspath(__file__), "--case", "%s:%s" % (name, dt), "--case-out", case_out,
                   "--out", a.out]
            for k in ("qwen3_layers", "mixtral_layers", "vocab", "prefill_tokens", "prefill_reps", "prompt_tokens",
                      "new_tokens", "generate_reps", "threads", "quiet_threshold", "max_wait"):
                cmd += ["--" + k.replace("_", "-"), str(getattr(a, k))]
            if a.accelerate_dtype:
                cmd += ["--accelerate-dtype", a.accelerate_dtype]
            if a.tiny:
                cmd.append("--tiny")
            p = subprocess.run(cmd)
            try:
                with open(case_out) as f:
                    res = json.load(f)
            except (OSError, ValueError):
                res = {"model": name, "dtype": dt, "error": "child exited with %d and wrote no result (killed for "
                                                            "memory?)" % p.returncode}
            os.unlink(case_out)
            doc["results"].append(res)
    doc["elapsed_s"] = round(time.time() - t_start, 1)
    lines = tables(doc["results"], a)
    first = next((r for r in doc["results"] if "error" not in r), {})
    title = ["# Whole models: transformers %s vs colibri.torch.accelerate%s" % (
                 first.get("transformers", "?"), " (TINY: not a measurement)" if a.tiny else ""), "",
             "%s (%d CPUs; %s), %d threads, PyTorch %s, %s, git %s, %.0f min. Command: `%s`" % (
                 doc["cpu"], doc["cpus_online"], ", ".join(doc["cpu_flags_of_interest"]), a.threads,
                 first.get("torch", "?"), doc["date"], doc["git"], doc["elapsed_s"] / 60, doc["command"]), "",
             "Batch 1. Prefill: one forward over %d tokens (median of %d). Decode: generate(do_sample=False, "
             "max_new_tokens=min_new_tokens=%d) after a %d-token prompt, 1 / median step time (median over %d "
             "calls' steps). x default / x eager: speed-up over plain transformers with its default experts "
             "implementation (%s) / with experts_implementation=eager, same process. in MoE: share of the time "
             "spent inside the sparse-MoE blocks (router + experts; forward hooks, one extra run). Attention: %s. "
             "others' load: share of the machine other processes used during the row's measurements. "
             "OMP_WAIT_POLICY: %s."
             % (a.prefill_tokens, a.prefill_reps, a.new_tokens, a.prompt_tokens, a.generate_reps,
                first.get("default_experts_implementation", "?"), first.get("attn_implementation", "?"),
                os.environ.get("OMP_WAIT_POLICY", "unset")), ""]
    md = "\n".join(title + lines) + "\n"
    errors = [r for r in doc["results"] if "error" in r]
    if errors:
        md += "\nErrors:\n\n" + "\n".join("- %s %s: %s" % (r["model"], r["dtype"], r["error"].strip().splitlines()[-1])
                                          for r in errors) + "\n"
    print(md)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    if a.md:
        with open(a.md, "w") as f:
            f.write(md)
    log("wrote %s in %.0f s" % (a.out, time.time() - t_start))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
