"""Whole-model prompt processing and text generation speed in llama-bench's
conventions, so a Colibri figure sits beside llama.cpp's:

  python -m colibri.bench MODEL [-p 512] [-n 128] [-r 5] [-t THREADS] [-o md|json|csv]

MODEL is what colibri.torch.from_pretrained opens (a GGUF file or a
checkpoint directory). As llama-bench measures them: `ppP` is one forward
over P prompt tokens from an empty cache (random token ids; the last
position's logits), `tgN` is N tokens generated one at a time from an empty
context (here one random token, then greedy `generate`), each repeated `-r`
times after a warm-up; tokens/s is the mean over the repetitions of
tokens / seconds, with their standard deviation. Columns as llama-bench's
markdown table: model, size (the file's bytes), params, backend, threads,
test, t/s. (`colibri bench` in the CLI times MoE layers alone, not whole
models.)
"""

import argparse
import csv
import io
import json
import math
import os
import statistics
import sys
import time


def _file_bytes(path):
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                   if os.path.isfile(os.path.join(path, f)))
    return os.path.getsize(path)


def _n_params(path):
    """Elements of every tensor the file (or the checkpoint's safetensors
    shards) stores, as llama-bench counts a model's parameters; None when
    they cannot be counted (a GGUF without the gguf package)."""
    if os.path.isdir(path):
        total = 0
        for f in sorted(os.listdir(path)):
            if not f.endswith(".safetensors"):
                continue
            with open(os.path.join(path, f), "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n))
            for name, t in header.items():
                if name != "__metadata__":
                    total += math.prod(t["shape"])
        return total
    try:
        from gguf import GGUFReader
    except ImportError:
        return None
    return sum(int(t.n_elements) for t in GGUFReader(path).tensors)


def _stats(samples):
    """llama-bench's avg_ts and stddev_ts."""
    avg = statistics.fmean(samples)
    return avg, (statistics.stdev(samples) if len(samples) > 1 else 0.0)


def run(model_path, prompt=(512,), gen=(128,), repetitions=5, threads=0, model=None):
    """A list of llama-bench-like records: model_filename, model_type,
    model_size, model_n_params, backends, n_threads, n_prompt, n_gen,
    avg_ts, stddev_ts, samples_ts. `model`: an already opened model of
    model_path (else from_pretrained opens one)."""
    import torch

    if repetitions < 1:
        raise ValueError("repetitions must be >= 1, got %r" % (repetitions,))
    if model is None:
        import colibri.torch as ct
        model = ct.from_pretrained(model_path, threads=threads)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    params = _n_params(model_path)
    base = dict(model_filename=os.path.basename(os.path.normpath(model_path)), model_type=model.config.model_type,
                model_size=_file_bytes(model_path), model_n_params=params, backends="Colibri",
                n_threads=threads or len(os.sched_getaffinity(0)))
    records = []
    with torch.inference_mode():
        for p in prompt:
            ids = torch.randint(0, vocab, (1, p), generator=g)
            model(ids, logits_to_keep=1)  # warm-up
            samples = []
            for _ in range(repetitions):
                t = time.perf_counter()
                model(ids, logits_to_keep=1)
                samples.append(p / (time.perf_counter() - t))
            avg, std = _stats(samples)
            records.append(dict(base, n_prompt=p, n_gen=0, avg_ts=avg, stddev_ts=std, samples_ts=samples))
        for n in gen:
            first = torch.randint(0, vocab, (1, 1), generator=g)

            def generate():
                t = time.perf_counter()
                model.generate(first, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
                return n / (time.perf_counter() - t)

            generate()  # warm-up
            samples = [generate() for _ in range(repetitions)]
            avg, std = _stats(samples)
            records.append(dict(base, n_prompt=0, n_gen=n, avg_ts=avg, stddev_ts=std, samples_ts=samples))
    return records


def _size(b):
    return "%.2f GiB" % (b / 2 ** 30) if b >= 2 ** 30 else "%.2f MiB" % (b / 2 ** 20)


def _params(n):
    if n is None:
        return "n/a"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return "%.2f %s" % (n / scale, unit)
    return str(n)


def format_records(records, output="md"):
    """llama-bench's -o md / json / csv."""
    if output == "json":
        return json.dumps(records, indent=1)
    if output == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=[k for k in records[0] if k != "samples_ts"] + ["samples_ts"])
        w.writeheader()
        for r in records:
            w.writerow(dict(r, samples_ts=";".join("%.3f" % s for s in r["samples_ts"])))
        return buf.getvalue().rstrip("\n")
    if output != "md":
        raise ValueError("output must be md, json or csv, got %r" % (output,))
    rows = ["| model | size | params | backend | threads | test | t/s |",
            "| ----- | ---: | -----: | ------- | ------: | ---: | --: |"]
    for r in records:
        test = "pp%d" % r["n_prompt"] if r["n_prompt"] else "tg%d" % r["n_gen"]
        rows.append("| %s | %s | %s | %s | %d | %s | %.2f ± %.2f |" % (
            r["model_type"], _size(r["model_size"]), _params(r["model_n_params"]), r["backends"], r["n_threads"],
            test, r["avg_ts"], r["stddev_ts"]))
    return "\n".join(rows)


def _sizes(text, flag):
    try:
        values = [int(v) for v in text.split(",") if v != ""]
    except ValueError:
        raise argparse.ArgumentTypeError("%s takes comma-separated token counts, got %r" % (flag, text)) from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError("%s: token counts must be >= 0, got %r" % (flag, text))
    return [v for v in values if v > 0]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m colibri.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="GGUF file or checkpoint directory (colibri.torch.from_pretrained)")
    ap.add_argument("-p", "--n-prompt", default="512", type=lambda s: _sizes(s, "-p"), help="prompt sizes (512)")
    ap.add_argument("-n", "--n-gen", default="128", type=lambda s: _sizes(s, "-n"), help="tokens to generate (128)")
    ap.add_argument("-r", "--repetitions", type=int, default=5, help="repetitions of each test (5)")
    ap.add_argument("-t", "--threads", type=int, default=0, help="Colibri threads (0 = one per core)")
    ap.add_argument("-o", "--output", choices=("md", "json", "csv"), default="md")
    a = ap.parse_args(argv)
    if a.repetitions < 1 or a.threads < 0:
        ap.error("-r must be >= 1 and -t >= 0")
    if not a.n_prompt and not a.n_gen:
        ap.error("nothing to run: -p and -n are both empty")
    try:
        records = run(a.model, a.n_prompt, a.n_gen, a.repetitions, a.threads)
    except (OSError, ValueError) as e:
        print("colibri bench: %s" % e, file=sys.stderr)
        return 1
    print(format_records(records, a.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
