"""Expert parallelism across processes: colibri.torch.from_pretrained(path,
expert_parallel=True) under torch.distributed (gloo on loopback), each rank
holding a share of the GGUF's experts, against one process."""

import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_from_pretrained import rel_l2, write  # noqa: E402

NEW = 8


def _rank(rank, world, path, init, out_dir, placement=None, max_resident=None):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        import colibri.torch as ct

        model = ct.from_pretrained(path, threads=1, expert_parallel=True, expert_placement=placement,
                                   max_resident=max_resident)
        ids = torch.randint(0, 318, (1, 9), generator=torch.Generator().manual_seed(5))
        with torch.inference_mode():
            logits = model(ids).logits
            seq = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        cmodels = {id(m): m for m in _colibri_models(model)}
        mapped = sum(m.stats.bytes_mapped for m in cmodels.values())
        slots = sum(m.stats.cache_slots for m in cmodels.values())
        misses = sum(m.stats.cache_misses for m in cmodels.values())
        torch.save({"logits": logits, "seq": seq, "mapped": mapped, "slots": slots, "misses": misses},
                   os.path.join(out_dir, "rank%d.pt" % rank))
    finally:
        dist.destroy_process_group()


def _single_process(path):
    """The whole model in one process, its logits for the ranks' 9-token
    prompt and its NEW greedy tokens: what every rank must reproduce."""
    import colibri.torch as ct

    whole = ct.from_pretrained(path, threads=1)
    ids = torch.randint(0, 318, (1, 9), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        return whole, whole(ids).logits, whole.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)


def _colibri_models(model):
    from colibri.metrics import colibri_models

    return colibri_models(model)


@pytest.mark.parametrize("name", ["qwen2moe", "deepseek2", "gpt-oss"])
def test_two_ranks_give_the_single_process_model(tmp_path, name):
    """Two ranks (each half the experts, the shared expert on rank 0, one
    all-reduce per MoE block) give one process's logits within 1e-4 and its
    greedy tokens, on both ranks, through the module path (prefill) and the
    direct decode step (generate); each rank packs about half the expert
    bytes."""
    pytest.importorskip("prometheus_client")
    path, _ = write(tmp_path, name)
    whole, want, want_seq = _single_process(path)
    whole_mapped = sum(m.stats.bytes_mapped for m in _colibri_models(whole))
    init = "file://" + str(tmp_path / "rendezvous")
    mp.start_processes(_rank, args=(2, path, init, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    for rank in (0, 1):
        got = torch.load(str(tmp_path / ("rank%d.pt" % rank)))
        assert rel_l2(got["logits"], want) < 1e-4, (name, rank, rel_l2(got["logits"], want))
        assert torch.equal(got["seq"], want_seq), (name, rank)
        assert got["mapped"] < 0.7 * whole_mapped, (name, rank, got["mapped"], whole_mapped)


def test_a_placement_from_a_routing_trace_gives_the_single_process_model(tmp_path):
    """expert_placement: a trace recorded on the whole model, balanced over
    two ranks (colibri.placement.balanced) instead of contiguous halves:
    the same logits and tokens as one process, each rank still packing
    about half the expert bytes."""
    pytest.importorskip("prometheus_client")
    from colibri import placement, routing

    path, _ = write(tmp_path, "qwen2moe")
    whole, want, want_seq = _single_process(path)
    with torch.inference_mode():
        with routing.record_trace(whole) as trace:
            whole.generate(torch.randint(0, 318, (1, 12), generator=torch.Generator().manual_seed(9)),
                           max_new_tokens=16, do_sample=False, pad_token_id=0)
    # Blocks routed in Colibri are recorded through colibri_route: 12
    # prompt tokens and 15 decode steps in each of the 2 MoE layers.
    assert trace.n_tokens() == 2 * (12 + 15), trace
    whole_mapped = sum(m.stats.bytes_mapped for m in _colibri_models(whole))
    trace_path = str(tmp_path / "routing.ctrace")
    trace.save(trace_path)
    p = placement.balanced(trace, 2)
    c = placement.contiguous(trace.n_layers, trace.n_experts, 2, counts=p.counts)
    assert p.imbalance() <= c.imbalance(), (p.describe(), c.describe())
    assert not (p.masks == c.masks).all()  # this trace moves experts
    init = "file://" + str(tmp_path / "rendezvous")
    mp.start_processes(_rank, args=(2, path, init, str(tmp_path), trace_path), nprocs=2, join=True,
                       start_method="spawn")
    for rank in (0, 1):
        got = torch.load(str(tmp_path / ("rank%d.pt" % rank)))
        assert rel_l2(got["logits"], want) < 1e-4, (rank, rel_l2(got["logits"], want))
        assert torch.equal(got["seq"], want_seq), rank
        assert got["mapped"] < 0.7 * whole_mapped, (rank, got["mapped"], whole_mapped)


def test_two_ranks_with_a_memory_budget_give_the_single_process_model(tmp_path):
    """expert_parallel with max_resident: each rank keeps a quarter of its
    share resident and reads the rest on demand; the sum is still one
    process's model."""
    pytest.importorskip("prometheus_client")
    path, _ = write(tmp_path, "qwen2moe")
    whole, want, want_seq = _single_process(path)
    init = "file://" + str(tmp_path / "rendezvous")
    mp.start_processes(_rank, args=(2, path, init, str(tmp_path), None, "25%"), nprocs=2, join=True,
                       start_method="spawn")
    for rank in (0, 1):
        got = torch.load(str(tmp_path / ("rank%d.pt" % rank)))
        assert rel_l2(got["logits"], want) < 1e-4, (rank, rel_l2(got["logits"], want))
        assert torch.equal(got["seq"], want_seq), rank
        # A quarter of the share (4 of 8 experts x 2 layers) is 2 slots; the rest were read.
        assert 0 < got["slots"] <= 2 and got["misses"] > 0, (rank, got["slots"], got["misses"])


def test_balanced_placement_keeps_the_expert_counts_and_evens_the_slots():
    from colibri import placement, routing

    # One layer, slots 10, 9, 1, 1: contiguous halves carry 19 and 2; the
    # balanced placement gives expert 0 to rank 0, 1 to rank 1, 2 to rank 1
    # (then at 9 against 10), 3 to rank 0: 11 and 10.
    t = routing.RoutingTrace(1, 4, 1)
    for e, n in enumerate((10, 9, 1, 1)):
        for _ in range(n):
            t.append(0, [e])
    p = placement.balanced(t, 2)
    assert p.masks[:, 0].tolist() == [[True, False, False, True], [False, True, True, False]]
    assert p.rank_slots().tolist() == [[11], [10]]
    c = placement.contiguous(1, 4, 2, counts=p.counts)
    assert c.rank_slots().tolist() == [[19], [2]]
    assert "balanced over 2 ranks: routed slots 52.4% / 47.6%" in p.describe(), p.describe()
    # A skewed synthetic trace over 4 ranks: 4 experts a rank a layer, every
    # expert on one rank, the busiest rank nearer the mean than contiguous's.
    t = routing.synthetic_trace(3, 16, 4, 300, skew=1.2, seed=3)
    p = placement.balanced(t, 4)
    assert (p.masks.sum(axis=2) == 4).all() and (p.masks.sum(axis=0) == 1).all()
    c = placement.contiguous(3, 16, 4, counts=p.counts)
    assert p.imbalance() < c.imbalance(), (p.describe(), c.describe())
    assert abs(p.shares().sum() - 1.0) < 1e-12
    assert placement.balanced(t, 4).digest() == p.digest() != c.digest()
    with pytest.raises(ValueError, match="17 ranks for 16 experts"):
        placement.balanced(t, 17)
    masks = p.masks.copy()
    masks[1, 0, 0] = not masks[1, 0, 0]
    with pytest.raises(ValueError, match="expert 0 of layer 0 is held by"):
        placement.ExpertPlacement(masks)


def test_expert_parallel_needs_a_process_group(tmp_path):
    import colibri.torch as ct

    path, _ = write(tmp_path, "qwen3moe")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    with pytest.raises(ValueError, match="torch.distributed initialised"):
        ct.from_pretrained(path, expert_parallel=True)


def _disagreeing_rank(rank, world, paths, exact, init, out_dir):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        import colibri.torch as ct

        try:
            ct.from_pretrained(paths[rank], threads=1, expert_parallel=True, exact_prefill=exact[rank])
            msg = "opened"
        except ValueError as e:
            msg = str(e)
        with open(os.path.join(out_dir, "rank%d.txt" % rank), "w") as f:
            f.write(msg)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", ["options", "file"])
def test_ranks_given_different_files_or_options_refuse_at_open(tmp_path, case):
    """Ranks compare a digest of the file's header and size and the options
    that change the numbers before opening: each raises ValueError naming
    the difference (exact_prefill on one rank only; another file)."""
    path, _ = write(tmp_path, "qwen2moe")
    other = path
    exact = (False, case == "options")
    if case == "file":
        (tmp_path / "other").mkdir()
        other, _ = write(tmp_path / "other", "qwen3moe")
    init = "file://" + str(tmp_path / "rendezvous")
    mp.start_processes(_disagreeing_rank, args=(2, (path, other), exact, init, str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    field = "exact_prefill" if case == "options" else "file (digest of its header and size)"
    for rank in (0, 1):
        msg = (tmp_path / ("rank%d.txt" % rank)).read_text()
        assert "expert_parallel ranks must open the same file with the same options" in msg, msg
        assert "rank %d (this one) and rank %d of 2 differ in %s" % (rank, 1 - rank, field) in msg, msg


def _faulty_rank(rank, world, path, fault, init, out_dir):
    import time

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    import colibri.torch as ct

    model = ct.from_pretrained(path, threads=1, expert_parallel=True, expert_parallel_timeout=3)
    done = os.path.join(out_dir, "rank0.txt")
    if rank == 1:
        # Dead: gone at once. Silent: alive, answering nothing, until rank 0
        # has reported (or a minute has passed).
        if fault == "silent":
            t0 = time.monotonic()
            while not os.path.exists(done) and time.monotonic() - t0 < 60:
                time.sleep(0.1)
        os._exit(0)
    ids = torch.randint(0, 318, (1, 9), generator=torch.Generator().manual_seed(5))
    t0 = time.monotonic()
    try:
        with torch.inference_mode():
            model(ids)
        msg = "no error"
    except Exception as e:  # gloo raises RuntimeError (or its DistBackendError subclass)
        msg = "%s: %s" % (type(e).__name__, e)
    with open(done + ".tmp", "w") as f:
        f.write("%.3f\n%s" % (time.monotonic() - t0, msg))
    os.rename(done + ".tmp", done)
    os._exit(0)  # the group's teardown would wait on the peer


@pytest.mark.parametrize("fault", ["dead", "silent"])
def test_a_dead_or_silent_peer_makes_the_others_raise(tmp_path, fault):
    """A peer that exited fails the next all-reduce with an error; one that
    is alive but answers nothing fails it once expert_parallel_timeout (3 s
    here) has passed, while that peer still waits (it leaves only once rank
    0 has reported): no rank hangs."""
    path, _ = write(tmp_path, "qwen2moe")
    init = "file://" + str(tmp_path / "rendezvous")
    mp.start_processes(_faulty_rank, args=(2, path, fault, init, str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    seconds, msg = (tmp_path / "rank0.txt").read_text().split("\n", 1)
    assert msg != "no error"
    assert "Error" in msg.split(":")[0], msg
    if fault == "silent":
        assert float(seconds) >= 2.5, (seconds, msg)  # it waited for the peer, then gave up
        assert "timed out" in msg.lower() or "timeout" in msg.lower(), msg


_NETNS_RANK = r"""
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, os.environ["COLIBRI_TEST_DIR"])
rank, path, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=os.environ["COLIBRI_INIT"], rank=rank, world_size=2)
import colibri.torch as ct
model = ct.from_pretrained(path, threads=1, expert_parallel=True)
ids = torch.randint(0, 318, (1, 9), generator=torch.Generator().manual_seed(5))
with torch.inference_mode():
    logits = model(ids).logits
    seq = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
torch.save({"logits": logits, "seq": seq}, out)
dist.destroy_process_group()
"""


def test_two_hosts_joined_by_a_veth_pair(tmp_path):
    """Two "hosts": network namespaces joined by a veth pair (no loopback
    between them), a rank in each, gloo over the pair's addresses: one
    process's logits and tokens on both. Needs root and iproute2."""
    import shutil
    import subprocess

    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (ip netns)")
    path, _ = write(tmp_path, "qwen2moe")
    whole, want, want_seq = _single_process(path)
    tag = "%d" % (os.getpid() % 100000)
    ns = ["cb%sa" % tag, "cb%sb" % tag]
    veth = ["cbv%sa" % tag, "cbv%sb" % tag]
    net = "10.%d.%d" % (200 + os.getpid() % 50, os.getpid() % 250)

    def ip(*args):
        subprocess.run(["ip"] + list(args), check=True, capture_output=True, timeout=30)

    made = []
    try:
        for n in ns:
            ip("netns", "add", n)
            made.append(n)
        ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for i in (0, 1):
            ip("link", "set", veth[i], "netns", ns[i])
            ip("-n", ns[i], "addr", "add", "%s.%d/24" % (net, i + 1), "dev", veth[i])
            ip("-n", ns[i], "link", "set", veth[i], "up")
            ip("-n", ns[i], "link", "set", "lo", "up")
        script = tmp_path / "rank.py"
        script.write_text(_NETNS_RANK)
        procs = []
        # The ranks import the colibri this process imported (ctest puts it
        # on sys.path, not on PYTHONPATH).
        import colibri

        python_path = os.pathsep.join([os.path.dirname(os.path.dirname(colibri.__file__))]
                                      + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
        for i in (0, 1):
            env = dict(os.environ, COLIBRI_TEST_DIR=os.path.dirname(__file__), GLOO_SOCKET_IFNAME=veth[i],
                       COLIBRI_INIT="tcp://%s.1:29517" % net, PYTHONPATH=python_path)
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns[i], sys.executable, str(script), str(i), path,
                                           str(tmp_path / ("rank%d.pt" % i))], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT))
        outs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
        for p, out in zip(procs, outs):
            assert p.returncode == 0, out[-3000:]
    finally:
        for n in made:
            subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=30)
    for rank in (0, 1):
        got = torch.load(str(tmp_path / ("rank%d.pt" % rank)))
        assert rel_l2(got["logits"], want) < 1e-4, (rank, rel_l2(got["logits"], want))
        assert torch.equal(got["seq"], want_seq), rank


def _transformers_ep_rank(rank, world, directory, port, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group("gloo")
    try:
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        import colibri.experts_backend as cb

        cb.register()
        model = AutoModelForCausalLM.from_pretrained(
            directory, distributed_config=DistributedConfig(tp_size=world, ep_size=world, tp_plan={}),
            experts_implementation=cb.NAME, dtype=torch.float32).eval()
        ids = torch.randint(0, 320, (1, 7), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            logits = model(ids).logits
        experts = model.model.layers[0].mlp.experts
        local = getattr(experts.gate_up_proj, "_local_tensor", experts.gate_up_proj)
        torch.save({"logits": logits, "local_experts": int(local.shape[0]), "num_experts": int(experts.num_experts),
                    "status": cb.status(model)}, os.path.join(out_dir, "tf%d.pt" % rank))
    finally:
        dist.destroy_process_group()


def test_transformers_own_expert_parallelism_with_the_colibri_backend(tmp_path):
    """transformers 5's DistributedConfig(tp_size=2, ep_size=2, tp_plan={})
    under gloo on CPU with experts_implementation="colibri": each rank holds
    4 of the 8 experts (a DTensor shard), transformers routes, marks other
    ranks' slots with its sentinel and sums the ranks' outputs; Colibri
    computes each rank's experts. One process's eager logits within 1e-4."""
    pytest.importorskip("accelerate")  # transformers' distributed loading needs it
    import socket

    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        pytest.skip("this transformers has no DistributedConfig")
    if "ep_size" not in DistributedConfig.__dataclass_fields__:
        pytest.skip("this transformers' DistributedConfig has no ep_size")
    cfg = AutoConfig.for_model("qwen3_moe", vocab_size=320, hidden_size=128, intermediate_size=256,
                               moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                               max_position_embeddings=128)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(str(tmp_path / "model"))
    ids = torch.randint(0, 320, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_transformers_ep_rank, args=(2, str(tmp_path / "model"), port, str(tmp_path)), nprocs=2,
                       join=True, start_method="spawn")
    for rank in (0, 1):
        got = torch.load(str(tmp_path / ("tf%d.pt" % rank)))
        assert got["local_experts"] == 4 and got["num_experts"] == 4, got
        assert all(impl == "colibri" for _, impl, _ in got["status"]), got["status"]
        assert rel_l2(got["logits"], want) < 1e-4, (rank, rel_l2(got["logits"], want))
