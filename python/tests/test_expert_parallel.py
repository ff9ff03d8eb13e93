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


def _rank(rank, world, path, init, out_dir):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        import colibri.torch as ct

        model = ct.from_pretrained(path, threads=1, expert_parallel=True)
        ids = torch.randint(0, 318, (1, 9), generator=torch.Generator().manual_seed(5))
        with torch.inference_mode():
            logits = model(ids).logits
            seq = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        cmodels = {id(m): m for m in _colibri_models(model)}
        mapped = sum(m.stats.bytes_mapped for m in cmodels.values())
        torch.save({"logits": logits, "seq": seq, "mapped": mapped}, os.path.join(out_dir, "rank%d.pt" % rank))
    finally:
        dist.destroy_process_group()


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
    import colibri.torch as ct

    whole = ct.from_pretrained(path, threads=1)
    ids = torch.randint(0, 318, (1, 9), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        want = whole(ids).logits
        want_seq = whole.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    whole_mapped = sum(m.stats.bytes_mapped for m in _colibri_models(whole))
    init = "file://" + str(tmp_path / "rendezvous")
    mp.start_processes(_rank, args=(2, path, init, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    for rank in (0, 1):
        got = torch.load(str(tmp_path / ("rank%d.pt" % rank)))
        assert rel_l2(got["logits"], want) < 1e-4, (name, rank, rel_l2(got["logits"], want))
        assert torch.equal(got["seq"], want_seq), (name, rank)
        assert got["mapped"] < 0.7 * whole_mapped, (name, rank, got["mapped"], whole_mapped)


def test_expert_parallel_needs_a_process_group(tmp_path):
    import colibri.torch as ct

    path, _ = write(tmp_path, "qwen3moe")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    with pytest.raises(ValueError, match="torch.distributed initialised"):
        ct.from_pretrained(path, expert_parallel=True)
