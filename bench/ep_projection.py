#!/usr/bin/env python3
"""DeepSeek-V3 (671B, Q4_K_M) decode across N machines with Colibri's expert
parallelism, on paper: tokens/s projected from a machine's weight-read rate
and the all-reduce's cost, and what bounds each case.

  .venv/bin/python bench/ep_projection.py --read-gbs 300 --allreduce-fixed-us 60 [--json OUT]

The model of one decode token (batch 1):
- every rank reads the replicated part (attention, routers, the shared
  expert, the three dense blocks, the LM head) and its share of the routed
  experts; with a balanced placement each rank reads about 1/N of the 8
  routed experts of every MoE layer (expert_placement; contiguous blocks
  only on average);
- read time = bytes / read rate (--read-gbs: the rate a whole machine's
  cores decode Q4_K-class weights at, which is the lesser of its memory
  bandwidth x ~0.9 and cores x per-core kernel rate: Colibri's int8 q4_k
  decode ran 19-21 GB/s a core on AMD Zen 4, `colibri_qdot_bench`);
- one all-reduce per MoE layer (58) of d_model = 7168 floats: gloo's ring
  sends 2 (N - 1) messages of 4 d_model / N bytes each way, each message
  costing the measured fixed latency (--allreduce-fixed-us, from
  bench/allreduce_latency.py: the software and the hop, loopback or veth)
  plus its bytes at the link's rate, plus the network's one-way latency
  (--hop-us, a switch hop: 5-20 us on Ethernet);
- compute and communication do not overlap (the next layer needs the sum).

Byte counts (Q4_K_M: q4_K gate/up at 4.5 bits, q6_K down at 6.5625 bits,
attention and dense blocks about 5 bits, head q6_K), per token: routed
experts 58 x 8 x 28.4 MB = 13.2 GB; replicated 9.9 GB (shared experts 1.6,
attention 61 x 112 MB = 6.9, dense blocks 0.7, head 0.8).
"""

import argparse
import json

D_MODEL = 7168
MOE_LAYERS = 58
LAYERS = 61
EXPERT_PARAMS = 3 * 7168 * 2048
EXPERT_BYTES = 2 * 7168 * 2048 * 4.5 / 8 + 7168 * 2048 * 6.5625 / 8
ROUTED_PER_TOKEN = MOE_LAYERS * 8 * EXPERT_BYTES
SHARED = MOE_LAYERS * EXPERT_BYTES
ATTENTION = LAYERS * (7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168) * 5 / 8
DENSE = 3 * 3 * 7168 * 18432 * 5 / 8
HEAD = 129280 * 7168 * 6.5625 / 8
REPLICATED = SHARED + ATTENTION + DENSE + HEAD


def project(n, read_gbs, link_gbit, fixed_us, hop_us):
    read_s = (REPLICATED + ROUTED_PER_TOKEN / n) / (read_gbs * 1e9)
    if n == 1:
        comm_s = 0.0
    else:
        msg = 4 * D_MODEL / n
        per_msg = fixed_us * 1e-6 + hop_us * 1e-6 + msg * 8 / (link_gbit * 1e9)
        comm_s = MOE_LAYERS * 2 * (n - 1) * per_msg
    total = read_s + comm_s
    bound = "weights (replicated part %.0f%%)" % (100 * REPLICATED / (REPLICATED + ROUTED_PER_TOKEN / n))
    if comm_s > read_s:
        bound = "all-reduce latency"
    return {"machines": n, "link_gbit": link_gbit, "read_ms": read_s * 1e3, "allreduce_ms": comm_s * 1e3,
            "tokens_per_s": 1.0 / total, "bound": bound}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--read-gbs", type=float, required=True, help="one machine's weight-read rate, GB/s")
    ap.add_argument("--allreduce-fixed-us", type=float, required=True,
                    help="fixed cost of one ring message (measured: bench/allreduce_latency.py)")
    ap.add_argument("--hop-us", type=float, default=10.0, help="the network's one-way latency per message")
    ap.add_argument("--json")
    a = ap.parse_args()
    print("per token: routed experts %.1f GB, replicated %.1f GB (experts %.1f MB each)"
          % (ROUTED_PER_TOKEN / 1e9, REPLICATED / 1e9, EXPERT_BYTES / 1e6))
    one = project(1, a.read_gbs, 0, 0, 0)
    print("1 machine: %.2f tokens/s (%.0f ms of reads); the whole model needs %.0f GB of RAM"
          % (one["tokens_per_s"], one["read_ms"], (256 * EXPERT_BYTES * MOE_LAYERS + REPLICATED) / 1e9))
    rows = [one]
    print("| machines | link | reads ms | all-reduces ms | tokens/s | vs 1 machine | bound |")
    print("|---|---|---|---|---|---|---|")
    for n in (2, 4, 8):
        for link in (10, 25, 100):
            r = project(n, a.read_gbs, link, a.allreduce_fixed_us, a.hop_us)
            rows.append(r)
            print("| %d | %d GbE | %.1f | %.1f | %.2f | %.2fx | %s |" % (n, link, r["read_ms"], r["allreduce_ms"],
                                                                       r["tokens_per_s"],
                                                                       r["tokens_per_s"] / one["tokens_per_s"],
                                                                       r["bound"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
