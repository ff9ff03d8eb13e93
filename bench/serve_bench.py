#!/usr/bin/env python3
"""Serving throughput and latency: python -m colibri.serve against
llama.cpp's llama-server on the same GGUF, the same clients, interleaved.

  .venv/bin/python bench/serve_bench.py --gguf FILE \\
      [--llama-server build/llamacpp-bench/build/bin/llama-server] [--threads 2] \\
      [--clients 1,2,4,8] [--requests 2] [--prompt 32] [--max-tokens 64] [--rounds 2] [--json OUT]

For each round, each server (started fresh, on loopback, `--max-batch` /
`-np` as many slots as the most clients, a context of 512 tokens a slot)
and each client count C: C threads each send `--requests` streaming
/v1/completions one after another (a prompt of `--prompt` random token ids
of its own, greedy, `max_tokens` tokens with `ignore_eos`, so every request
generates exactly that many on both servers). Reported per C: tokens/s
summed over the clients (all generated tokens / wall time from the first
request to the last answer), the median time to first token, and the p50
and p99 of the inter-token latency (the gaps between a stream's
consecutive token events, all streams together). A warm-up request runs
before timing. llama-server: `-t THREADS -np C_max -c 512*C_max
--no-warmup` (continuous batching is its default).
"""

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _wait_healthy(port, proc, timeout=600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited with %s" % proc.returncode)
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            r = c.getresponse()
            r.read()
            if r.status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("no /health in %d s" % timeout)


def _stream(port, prompt, max_tokens):
    """One streaming completion; returns (start, [event times]) where each
    event is a chunk carrying tokens (llama-server sends one a token; so
    does Colibri unless a token's text is held back mid-character, which
    the count of usage tokens corrects below)."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "ignore_eos": True, "stream_options": {"include_usage": True}})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.perf_counter()
    c.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError("HTTP %d: %s" % (r.status, r.read()[:500]))
    events, tokens = [], None
    buf = b""
    while True:
        chunk = r.read1(65536) if hasattr(r, "read1") else r.read(1)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            line, buf = buf.split(b"\n\n", 1)
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            now = time.perf_counter()
            msg = json.loads(line[6:])
            if msg.get("usage"):
                tokens = msg["usage"].get("completion_tokens", tokens)
            if msg.get("choices"):
                events.append(now)
    c.close()
    return start, events, tokens


def _run_clients(port, n_clients, requests, prompt_len, max_tokens, vocab, seed):
    rng = random.Random(seed)
    prompts = [[[rng.randrange(10, vocab - 10) for _ in range(prompt_len)] for _ in range(requests)]
               for _ in range(n_clients)]
    results = [[] for _ in range(n_clients)]
    errors = []
    barrier = threading.Barrier(n_clients)

    def client(i):
        barrier.wait()
        try:
            for p in prompts[i]:
                results[i].append(_stream(port, p, max_tokens))
        except Exception as e:  # reported, not hidden
            errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n_clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(errors[0])
    tokens, gaps, ttft = 0, [], []
    for per_client in results:
        for start, events, used in per_client:
            tokens += used if used is not None else len(events)
            ttft.append(events[0] - start)
            gaps += [b - a for a, b in zip(events, events[1:])]
    gaps.sort()

    def pct(q):
        return gaps[min(len(gaps) - 1, int(q * len(gaps)))] * 1e3

    return {"clients": n_clients, "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "ttft_ms_median": statistics.median(ttft) * 1e3, "itl_ms_p50": pct(0.50), "itl_ms_p99": pct(0.99)}


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gguf_vocab(path):
    import gguf
    r = gguf.GGUFReader(path)
    field = r.fields.get("tokenizer.ggml.tokens")
    return len(field.data) if field is not None else 1000


def _server(engine, args, slots):
    port = _free_port()
    if engine == "colibri":
        cmd = [sys.executable, "-m", "colibri.serve", args.gguf, "--port", str(port), "--threads", str(args.threads),
               "--max-batch", str(slots), "--ctx-size", "512", "--log-level", "warning"]
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    else:
        cmd = [args.llama_server, "-m", args.gguf, "--port", str(port), "-t", str(args.threads), "-np", str(slots),
               "-c", str(512 * slots), "--no-warmup", "--log-disable"]
        env = dict(os.environ)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        _wait_healthy(port, proc)
    except Exception:
        proc.kill()
        raise
    return proc, port


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--llama-server", default=os.path.join(ROOT, "build/llamacpp-bench/build/bin/llama-server"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--engines", default="colibri,llama.cpp")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    vocab = _gguf_vocab(args.gguf)
    rows = []
    for rnd in range(args.rounds):
        for engine in args.engines.split(","):
            proc, port = _server(engine, args, max(counts))
            try:
                _run_clients(port, 1, 1, args.prompt, 8, vocab, seed=99)  # warm-up
                for n in counts:
                    r = _run_clients(port, n, args.requests, args.prompt, args.max_tokens, vocab, seed=rnd * 100 + n)
                    r.update(engine=engine, round=rnd)
                    rows.append(r)
                    print("round %d %-9s %d clients: %7.1f tokens/s, TTFT %7.1f ms, ITL p50 %6.1f ms p99 %6.1f ms"
                          % (rnd, engine, n, r["tokens_per_s"], r["ttft_ms_median"], r["itl_ms_p50"],
                             r["itl_ms_p99"]), flush=True)
            finally:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    print("\n| clients | Colibri tokens/s | llama-server tokens/s | ratio | Colibri ITL p50 / p99 ms | "
          "llama-server ITL p50 / p99 ms |")
    print("|---|---|---|---|---|---|")
    for n in counts:
        def med(engine, key):
            vals = [r[key] for r in rows if r["engine"] == engine and r["clients"] == n]
            return statistics.median(vals) if vals else float("nan")
        c, l = med("colibri", "tokens_per_s"), med("llama.cpp", "tokens_per_s")
        print("| %d | %.1f | %.1f | %.2fx | %.1f / %.1f | %.1f / %.1f |" % (
            n, c, l, c / l if l else float("nan"), med("colibri", "itl_ms_p50"), med("colibri", "itl_ms_p99"),
            med("llama.cpp", "itl_ms_p50"), med("llama.cpp", "itl_ms_p99")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"file": args.gguf, "threads": args.threads, "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
