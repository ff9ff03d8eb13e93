#!/usr/bin/env python3
"""A decode step at a long context: colibri.torch.from_pretrained with
attention="colibri" (colibri_attention and colibri_rope) or "model"
(transformers' own attention and rope), one process per setting.

  COLIBRI_LIBRARY=build/libcolibri.so .venv/bin/python bench/long_context.py FILE colibri|model CONTEXT

Prefills CONTEXT random tokens (one forward, logits_to_keep=1, with the
cache), then times 24 one-token steps through the cache; prints the prefill
time and the median step.
"""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import colibri.torch as ct  # noqa: E402


def main():
    if len(sys.argv) != 4 or sys.argv[2] not in ("colibri", "model"):
        sys.exit(__doc__)
    path, attn, ctx = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model = ct.from_pretrained(path, threads=2, attention=attn)
    ids = torch.randint(0, min(1000, model.config.vocab_size), (1, ctx), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        t = time.perf_counter()
        model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        prefill = time.perf_counter() - t
        steps = []
        for _ in range(24):
            t = time.perf_counter()
            model(ids[:, :1], past_key_values=cache, use_cache=True, logits_to_keep=1)
            steps.append(time.perf_counter() - t)
    steps.sort()
    step = steps[len(steps) // 2]
    print("%s, context %d: prefill %.2f s (%.0f tokens/s), decode step median %.2f ms (%.1f tokens/s)"
          % (attn, ctx, prefill, ctx / prefill, step * 1e3, 1 / step))


if __name__ == "__main__":
    main()
