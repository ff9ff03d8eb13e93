#!/usr/bin/env python3
"""One layer's attention over a KV cache, as transformers calls it: the
"colibri-sdpa" / "colibri-eager" implementation that from_pretrained
installs (colibri.attention: one C call, colibri_attention) against the
model's own (transformers' sdpa_attention_forward for Qwen3-MoE,
gpt-oss's eager_attention_forward with its sinks), interleaved, median
microseconds per call; PyTorch at --torch-threads, Colibri at --threads.

  COLIBRI_LIBRARY=build/libcolibri.so .venv/bin/python bench/attention.py \\
      [--threads 2] [--torch-threads 1] [--contexts 64,512,2048,8192] \\
      [--tokens 1,4,16,64] [--json OUT.json]

Shapes: Qwen3-30B-A3B (32 query heads, 4 KV heads of 128) and gpt-oss-20b
(64 query heads, 8 KV heads of 64, sinks). Each row: T query tokens, the
last T of `context` cached positions, causal, with the mask transformers
sends (none at T = 1). Columns: the model's own implementation, the
installed one (the C kernel, or the model's own past
colibri.attention.MAX_QUERY_TOKENS when that is set), and the C kernel
called directly; rel_l2 of the C kernel's output against the model's own.
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

import torch  # noqa: E402

SHAPES = {
    "qwen3moe": dict(heads=32, kv_heads=4, dim=128, sinks=False),
    "gpt-oss": dict(heads=64, kv_heads=8, dim=64, sinks=True),
}


class Attn(torch.nn.Module):
    def __init__(self, heads, kv_heads, sinks):
        super().__init__()
        self.num_key_value_groups = heads // kv_heads
        if sinks:
            self.sinks = torch.nn.Parameter(torch.randn(heads), requires_grad=False)


def timed(f, seconds=0.3):
    f()
    times = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 5:
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--contexts", default="64,512,2048,8192")
    p.add_argument("--tokens", default="1,4,16,64")
    p.add_argument("--json")
    a = p.parse_args()
    torch.set_num_threads(a.torch_threads)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

    import colibri.attention as ca

    rows = []
    for shape, s in SHAPES.items():
        module = Attn(s["heads"], s["kv_heads"], s["sinks"]).eval()
        if s["sinks"]:
            # Where the installed implementation finds the model's eager function.
            module.__class__ = type("GptOssAttention", (Attn,), {"__module__": gpt_oss_eager.__module__})
        ours = ca._interface("eager" if s["sinks"] else "sdpa")
        module.__dict__["_colibri_threads"] = a.threads
        for S in map(int, a.contexts.split(",")):
            for T in map(int, a.tokens.split(",")):
                if T > S:
                    continue
                g = torch.Generator().manual_seed(S + T)
                q = torch.randn(1, T, s["heads"], s["dim"], generator=g).transpose(1, 2)
                k = torch.randn(1, s["kv_heads"], S, s["dim"], generator=g)
                v = torch.randn(1, s["kv_heads"], S, s["dim"], generator=g)
                scale = s["dim"] ** -0.5
                # The masks transformers sends: none at T == 1 (causal), else
                # bool (sdpa) or float (eager) rows, query t seeing up to S - T + t.
                visible = torch.arange(S)[None, :] <= torch.arange(S - T, S)[:, None]
                if s["sinks"]:
                    mask = torch.zeros(1, 1, T, S).masked_fill_(~visible, torch.finfo(torch.float32).min)
                    own = lambda: gpt_oss_eager(module, q, k, v, mask, scaling=scale, s_aux=module.sinks)  # noqa: E731
                    col = lambda: ours(module, q, k, v, mask, scaling=scale, s_aux=module.sinks)  # noqa: E731
                    own_name = "eager"
                else:
                    mask = None if T == 1 else visible[None, None]
                    own = lambda: sdpa_attention_forward(module, q, k, v, mask, scaling=scale)  # noqa: E731
                    col = lambda: ours(module, q, k, v, mask, scaling=scale)  # noqa: E731
                    own_name = "sdpa"
                sinks = module.sinks if s["sinks"] else None
                kernel = lambda: ca.attention(q, k, v, scale=scale, mask=mask, sinks=sinks,  # noqa: E731
                                              threads=a.threads)
                with torch.inference_mode():
                    want, got = own()[0], kernel()
                    err = float((got - want).norm() / want.norm())
                    t_own, t_col, t_kernel = [], [], []
                    for _ in range(3):
                        t_own.append(timed(own))
                        t_col.append(timed(col))
                        t_kernel.append(timed(kernel))
                row = dict(shape=shape, context=S, tokens=T, model_impl=own_name, model_us=min(t_own),
                           installed_us=min(t_col), kernel_us=min(t_kernel), c_kernel=ca.MAX_QUERY_TOKENS is None or T <= ca.MAX_QUERY_TOKENS,
                           rel_l2=err)
                rows.append(row)
                print("%-9s S=%-5d T=%-3d %-5s %9.1f us  installed %9.1f us (%5.2fx, %s)  C kernel %9.1f us "
                      "(%5.2fx)  rel_l2 %.1e"
                      % (shape, S, T, own_name, row["model_us"], row["installed_us"],
                         row["model_us"] / row["installed_us"], "C" if row["c_kernel"] else "model's",
                         row["kernel_us"], row["model_us"] / row["kernel_us"], err), flush=True)
    if a.json:
        from colibri import _lib

        info = dict(threads=a.threads, torch_threads=a.torch_threads, cpu=_cpu_name(),
                    date=time.strftime("%Y-%m-%d"), library=_lib.library_path())
        with open(a.json, "w") as f:
            json.dump(dict(info=info, rows=rows), f, indent=1)


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
