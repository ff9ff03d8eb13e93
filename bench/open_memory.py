#!/usr/bin/env python3
"""Memory of opening a whole model with colibri.torch.from_pretrained, on
files of at least 4 GB: the peak RSS growth of a fresh process (VmHWM after
the call less VmHWM before it, after importing colibri.torch and
transformers, which the table gives apart: about 0.3 GiB) against

  gguf        the file's size (goal: at most 1.1x the file + 300 MiB);
  checkpoint  a bf16 safetensors directory opened with dtype= (quantised as
              read): the packed model Colibri ends up holding plus the
              largest tensor read (goal: at most that).

  COLIBRI_LIBRARY=build/libcolibri.so .venv/bin/python bench/open_memory.py \\
      [--work build/bench-work/open-memory] [--gb 5.0] [--dtype q8_0]

The files are written once (random weights; Qwen3-MoE shape, 2048 wide,
128 experts of 768) and kept in --work.
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "python", "tests"))

CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[3])
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
start = hwm()
import colibri.torch as ct
import transformers  # the model classes' modules load at from_pretrained
from transformers import AutoConfig, AutoModelForCausalLM
before = hwm()
kw = json.loads(sys.argv[2])
m = ct.from_pretrained(sys.argv[1], threads=2, lock=False, **kw)
packed = 0
import colibri.nn as cnn
for mod in m.modules():
    if isinstance(mod, cnn.Linear):
        packed += mod.nbytes
    if isinstance(mod, cnn.Embedding):
        packed += mod._rows.numel()
reports = m._colibri_report if isinstance(m._colibri_report, list) else [m._colibri_report]
packed += sum(r.colibri_bytes for r in reports)
print(json.dumps({"start": start, "before": before, "after": hwm(), "packed": packed}))
"""

BLOCKS = 8  # of 2048 x 128 experts x 768: 1.2 GB of bf16 experts each


def write_gguf(path, gb):
    from gguf_fixtures import write_model_gguf

    n = max(1, int(round(gb * 1e9 / (128 * 3 * 768 * 2048 * 2 + 4 * 2048 * 4096 * 2))))
    write_model_gguf(path, "qwen3moe", n_blocks=n, d_model=2048, n_experts=128, top_k=8, d_ff=768, n_heads=32,
                     n_kv_heads=4, head_dim=128, vocab=8192, expert_types=("bf16", "bf16", "bf16"),
                     attn_type="bf16", embd_type="bf16", head_type="bf16", reference=False)


def write_checkpoint(path, gb):
    """A bf16 Qwen3-MoE checkpoint in the hub's layout, tensor by tensor
    (no model is built: a 4 GB one would take 8 GB to make)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    per_block = 128 * 3 * 768 * 2048 * 2 + 4 * 2048 * 4096 * 2
    n = max(1, int(round(gb * 1e9 / per_block)))
    cfg = transformers.Qwen3MoeConfig(vocab_size=8192, hidden_size=2048, intermediate_size=6144,
                                      moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                      norm_topk_prob=True, num_hidden_layers=n, num_attention_heads=32,
                                      num_key_value_heads=4, head_dim=128, decoder_sparse_step=1,
                                      mlp_only_layers=[], tie_word_embeddings=False)
    os.makedirs(path, exist_ok=True)
    cfg.save_pretrained(path)
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    index = {}
    shard = {"model.embed_tokens.weight": w(8192, 2048), "lm_head.weight": w(8192, 2048),
             "model.norm.weight": torch.ones(2048, dtype=torch.bfloat16)}
    name = "model-00000.safetensors"
    save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
    index.update({k: name for k in shard})
    for b in range(n):
        p = "model.layers.%d." % b
        shard = {p + "input_layernorm.weight": torch.ones(2048, dtype=torch.bfloat16),
                 p + "post_attention_layernorm.weight": torch.ones(2048, dtype=torch.bfloat16),
                 p + "self_attn.q_proj.weight": w(4096, 2048), p + "self_attn.k_proj.weight": w(512, 2048),
                 p + "self_attn.v_proj.weight": w(512, 2048), p + "self_attn.o_proj.weight": w(2048, 4096),
                 p + "self_attn.q_norm.weight": torch.ones(128, dtype=torch.bfloat16),
                 p + "self_attn.k_norm.weight": torch.ones(128, dtype=torch.bfloat16),
                 p + "mlp.gate.weight": w(128, 2048)}
        for e in range(128):
            q = p + "mlp.experts.%d." % e
            shard[q + "gate_proj.weight"] = w(768, 2048)
            shard[q + "up_proj.weight"] = w(768, 2048)
            shard[q + "down_proj.weight"] = w(2048, 768)
        name = "model-%05d.safetensors" % (b + 1)
        save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
        index.update({k: name for k in shard})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": index}, f)


def largest_tensor(path):
    from safetensors import safe_open

    best = 0
    for n in os.listdir(path):
        if n.endswith(".safetensors"):
            with safe_open(os.path.join(path, n), "pt") as f:
                for k in f.keys():
                    sl = f.get_slice(k)
                    count = 1
                    for d in sl.get_shape():
                        count *= d
                    best = max(best, count * 2)  # bf16
    return best


def dir_size(path):
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".safetensors"))


def measure(path, kw):
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", CHILD, path, json.dumps(kw), os.path.join(HERE, "..", "python")],
                         capture_output=True, text=True, env=env, timeout=3600)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default=os.path.join(HERE, "..", "build", "bench-work", "open-memory"))
    ap.add_argument("--gb", type=float, default=5.0)
    ap.add_argument("--dtype", default="q8_0")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    gguf = os.path.join(a.work, "qwen3moe-bf16.gguf")
    ck = os.path.join(a.work, "qwen3moe-bf16-checkpoint")
    if not os.path.exists(gguf):
        t = time.time()
        write_gguf(gguf, a.gb)
        print("wrote %s in %.0f s" % (gguf, time.time() - t), file=sys.stderr)
    if not os.path.exists(os.path.join(ck, "model.safetensors.index.json")):
        t = time.time()
        write_checkpoint(ck, a.gb)
        print("wrote %s in %.0f s" % (ck, time.time() - t), file=sys.stderr)
    G = 2.0**30
    r = measure(gguf, {})
    size = os.path.getsize(gguf)
    growth = r["after"] - r["before"]
    print("imports (colibri.torch, transformers): %.2f GiB of RSS" % ((r["before"] - r["start"]) / G))
    print("| source | size | peak RSS growth | ratio | goal |\n|---|---|---|---|---|")
    print("| GGUF, bf16 experts | %.2f GiB | %.2f GiB | %.2fx the file | <= 1.1x + 300 MiB = %.2f GiB |"
          % (size / G, growth / G, growth / size, (1.1 * size + 300 * 2**20) / G))
    r = measure(ck, {"dtype": a.dtype})
    size = dir_size(ck)
    growth = r["after"] - r["before"]
    largest = largest_tensor(ck)
    print("| checkpoint, bf16, dtype=%s | %.2f GiB | %.2f GiB | %.2fx the packed model (%.2f GiB) | <= packed + "
          "largest tensor = %.2f GiB |" % (a.dtype, size / G, growth / G, growth / r["packed"], r["packed"] / G,
                                           (r["packed"] + largest) / G))


if __name__ == "__main__":
    main()
