#!/usr/bin/env python3
"""The collective an expert-parallel MoE layer waits on: torch.distributed's
all_reduce (SUM, gloo) of one block output, between 2 ranks on loopback or
on two "hosts" (network namespaces joined by a veth pair, as
python/tests/test_expert_parallel.py makes them; needs root and iproute2).

  .venv/bin/python bench/allreduce_latency.py --d-model 2048 --rows 1,128 [--netns] [--json OUT]

Per (rows, dtype): the median of --iters calls after a warm-up, in
microseconds (p90 too), and the payload (each rank sends about 2 (N - 1) / N
of it in a ring). A decode token's MoE block output is [1, d_model]; a prefill
chunk's [rows, d_model].
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

RANK = r"""
import json, os, statistics, sys, time, torch, torch.distributed as dist
rank, d, rows, iters, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
dist.init_process_group("gloo", init_method=os.environ["INIT"], rank=rank, world_size=2)
res = {}
for r in [int(x) for x in rows.split(",")]:
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        x = torch.ones(r, d, dtype=dtype)
        for _ in range(50):
            dist.all_reduce(x)
        t = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            t.append(time.perf_counter() - t0)
        res["%dx%d %s" % (r, d, name)] = {"us": statistics.median(t) * 1e6, "p90_us": sorted(t)[int(0.9 * len(t))] * 1e6,
                                         "payload_bytes": x.numel() * x.element_size()}
if rank == 0:
    json.dump(res, open(out, "w"))
dist.destroy_process_group()
"""


def run(args, netns, out_dir):
    script = os.path.join(out_dir, "rank.py")
    with open(script, "w") as f:
        f.write(RANK)
    out = os.path.join(out_dir, "res.json")
    made, procs = [], []
    tag = str(os.getpid() % 100000)
    ns, veth, net = ["cbb%sa" % tag, "cbb%sb" % tag], ["cbw%sa" % tag, "cbw%sb" % tag], "10.251.%d" % (os.getpid() % 250)

    def ip(*a):
        subprocess.run(["ip"] + list(a), check=True, capture_output=True, timeout=30)

    try:
        if netns:
            for n in ns:
                ip("netns", "add", n)
                made.append(n)
            ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
            for i in (0, 1):
                ip("link", "set", veth[i], "netns", ns[i])
                ip("-n", ns[i], "addr", "add", "%s.%d/24" % (net, i + 1), "dev", veth[i])
                ip("-n", ns[i], "link", "set", veth[i], "up")
                ip("-n", ns[i], "link", "set", "lo", "up")
        for i in (0, 1):
            env = dict(os.environ, INIT="tcp://%s:29533" % ("%s.1" % net if netns else "127.0.0.1"))
            if netns:
                env["GLOO_SOCKET_IFNAME"] = veth[i]
            cmd = [sys.executable, script, str(i), str(args.d_model), args.rows, str(args.iters), out]
            if netns:
                cmd = ["ip", "netns", "exec", ns[i]] + cmd
            procs.append(subprocess.Popen(cmd, env=env))
        for p in procs:
            if p.wait(timeout=600) != 0:
                raise RuntimeError("a rank failed")
    finally:
        for n in made:
            subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=30)
    return json.load(open(out))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--rows", default="1,128")
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--netns", action="store_true", help="also across a veth pair between two network namespaces")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.netns and (os.geteuid() != 0 or shutil.which("ip") is None):
        ap.error("--netns needs root and iproute2")
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "d_model": args.d_model}
    for where in (["loopback", "veth"] if args.netns else ["loopback"]):
        with tempfile.TemporaryDirectory() as d:
            results[where] = run(args, where == "veth", d)
        for k, v in results[where].items():
            print("%-8s %-16s median %7.1f us  p90 %7.1f us  payload %d bytes" % (where, k, v["us"], v["p90_us"],
                                                                       v["payload_bytes"]))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
