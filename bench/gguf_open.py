"""Opening a GGUF directly against its converted model directory, at a real
model's shape: a Qwen3-MoE-shaped (E=128, k=8, d_model=2048, d_ff=768) or,
with --shape mixtral, Mixtral-shaped (E=8, k=2, 4096x14336) Q4_K_M GGUF
written by the gguf package, with llama.cpp's per-block down
types (Q6_K in some blocks, Q4_K in the others), then

  - open time and peak RSS of `colibri info` on the GGUF and on the directory
    `colibri convert --gguf` writes (each in a fresh process),
  - `colibri bench` p50 at T=1 and T=128 (random routing, --seed 3) on
    both, same run (the bytes are the same, so the times should agree),
  - each layer's error against float64 on the experts as the gguf package
    dequantises them.

  .venv/bin/python bench/gguf_open.py --colibri build [--layers 4] [--work build/bench-work/gguf]

Prints a Markdown table; numbers depend on the machine (the CPU is named).
"""

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "python"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "python" / "tests"))


def cpu_name():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def use_more_bits(i, n):
    """llama.cpp's Q4_K_M rule for which blocks' down matrices get Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--colibri", default="build", help="build directory with libcolibri.so and tools/colibri")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--shape", choices=["qwen3-moe", "mixtral"], default="qwen3-moe",
                    help="qwen3-moe: E=128 k=8 2048x768 (qwen3moe naming); mixtral: E=8 k=2 4096x14336 (llama naming)")
    ap.add_argument("--work", default="build/bench-work/gguf")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    build = pathlib.Path(a.colibri).resolve()
    os.environ.setdefault("COLIBRI_LIBRARY", str(build / "libcolibri.so"))
    cli = str(build / "tools" / "colibri")
    import gguf_fixtures as gf

    work = pathlib.Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    arch, E, k, D, F = {"qwen3-moe": ("qwen3moe", 128, 8, 2048, 768), "mixtral": ("llama", 8, 2, 4096, 14336)}[a.shape]
    path = work / f"{arch}-e{E}-d{D}-f{F}-l{a.layers}-q4_k_m.gguf"
    downs = ["q6_k" if use_more_bits(i, a.layers) else "q4_k" for i in range(a.layers)]
    if not path.exists():
        t0 = time.time()
        gf.write_moe_gguf(str(path), arch, n_blocks=a.layers, n_experts=E, top_k=k, d_model=D, d_ff=F,
                          dtype="q4_k", down_dtype=downs[0], block_down_dtypes=downs, seed=1, reference=False)
        print(f"wrote {path} ({path.stat().st_size / 2**20:.0f} MiB) in {time.time() - t0:.0f} s", file=sys.stderr)
    directory = work / (path.stem + "-dir")
    if not (directory / "colibri.json").exists():
        subprocess.run([cli, "convert", "--gguf", str(path), "--out", str(directory)], check=True, capture_output=True)

    rows = []
    for name, model in (("GGUF", path), ("directory", directory)):
        # Peak RSS of one process that opens the model (and exits); the
        # second of two opens, so both read from the page cache.
        probe = ("import resource, subprocess, sys;"
                 "p = subprocess.run(sys.argv[1:], capture_output=True, text=True, check=True);"
                 "print(p.stdout);"
                 "print('PEAK', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
        for _ in range(2):
            r = subprocess.run([sys.executable, "-c", probe, cli, "info", "--model", str(model), "--threads",
                                str(a.threads)], capture_output=True, text=True, check=True)
        peak = int(r.stdout.rsplit("PEAK", 1)[1]) * 1024
        load = next(line for line in r.stdout.splitlines() if line.startswith("load time")).split()[2]
        packed = next(line for line in r.stdout.splitlines() if line.startswith("weights"))
        times = {}
        for T, iters in ((1, 400), (128, 10)):
            b = subprocess.run([cli, "bench", "--model", str(model), "--tokens", str(T), "--top-k", str(k), "--seed", "3",
                                "--iters", str(iters), "--warmup", str(max(2, iters // 10)), "--threads",
                                str(a.threads), "--no-verify", "--json"], capture_output=True, text=True, check=True)
            times[T] = json.loads(b.stdout)
        rows.append((name, float(load), peak, packed, times))

    # Accuracy at this shape: a few tokens through every layer with caller
    # routing, against float64 on the experts the gguf package dequantises.
    import gguf
    import colibri

    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    rng = np.random.default_rng(9)
    errors = []
    with colibri.Model(str(path), threads=a.threads) as m:
        for layer in range(a.layers):
            x = rng.standard_normal((4, D)).astype(np.float32)
            ids = np.stack([rng.choice(E, k, replace=False) for _ in range(4)]).astype(np.int32)
            w = rng.uniform(0.05, 0.3, (4, k)).astype(np.float32)
            got = m.infer(x, ids, w, layer=layer).astype(np.float64)
            want = np.zeros_like(got)

            def expert(name, e):
                t = tensors[f"blk.{layer}.{name}.weight"]
                return gguf.quants.dequantize(np.asarray(t.data[e]), t.tensor_type).astype(np.float64)

            for t_ in range(4):
                for j in range(k):
                    e = int(ids[t_, j])
                    g, u, d = expert("ffn_gate_exps", e), expert("ffn_up_exps", e), expert("ffn_down_exps", e)
                    gx, ux = g @ x[t_], u @ x[t_]
                    want[t_] += w[t_, j] * (d @ (gx / (1.0 + np.exp(-gx)) * ux))
            errors.append(float(np.linalg.norm(got - want) / np.linalg.norm(want)))

    file_mib = path.stat().st_size / 2**20
    print(f"CPU: {cpu_name()}, {a.threads} threads; {a.layers} {a.shape}-shaped layers (E={E}, k={k}, {D}x{F}), Q4_K gate/up, "
          f"down {', '.join(downs)} by block; GGUF {file_mib:.0f} MiB\n")
    print("| source | open s | peak RSS MiB | decode T=1 p50 ms | prefill T=128 p50 ms |")
    print("|---|---|---|---|---|")
    for name, load, peak, packed, times in rows:
        p50 = [times[T].get("p50_ms", times[T].get("latency_ms", {}).get("p50")) for T in (1, 128)]
        print(f"| {name} | {load:.2f} | {peak / 2**20:.0f} | {p50[0]} | {p50[1]} |")
    print(f"\nRelative L2 against float64 on the gguf package's dequantised experts (4 tokens x {k} experts, "
          f"caller routing, int8 activations), per layer: {', '.join(f'{e:.2e}' for e in errors)}")


if __name__ == "__main__":
    main()
