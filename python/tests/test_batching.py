"""colibri.batching: continuous batching over a from_pretrained model gives
each sequence what generate gives it alone."""

import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

sys.path.insert(0, os.path.dirname(__file__))
from test_from_pretrained import SHAPES, rel_l2, write  # noqa: E402

import colibri.torch as ct  # noqa: E402
from colibri.batching import Engine  # noqa: E402

PROMPT_LENGTHS = (5, 9, 3, 12)
NEW = 10


def _alone(model, prompts):
    """generate's greedy tokens and raw logits, one prompt at a time."""
    tokens, logits = [], []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)
            tokens.append(out.sequences[0, len(p):].tolist())
            logits.append(torch.stack(out.logits)[:, 0])
    return tokens, logits


def _recording(engine):
    """Keeps the logits each sequence's tokens were chosen from."""
    seen = {}
    emit = engine._emit

    def recorded(seq, logits):
        seen.setdefault(id(seq), []).append(logits.clone())
        emit(seq, logits)

    engine._emit = recorded
    return seen


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_sequences_joining_and_leaving_match_generate_alone(tmp_path, name):
    """Four prompts of different lengths join a running batch at different
    steps (and leave when done, some at their end-of-text token): each
    one's greedy tokens equal generate's for it alone, and its logits agree
    to float32 rounding. The decode steps ran batched where the model has
    colibri.decode's direct step (rows > steps: several sequences a step)."""
    path, _ = write(tmp_path, name)
    model = ct.from_pretrained(path, threads=2)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 318, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    want_tokens, want_logits = _alone(model, prompts)

    engine = Engine(model, max_batch=4)
    seen = _recording(engine)
    seqs = [engine.submit(prompts[0], NEW), engine.submit(prompts[1], NEW)]
    engine.step()
    engine.step()
    seqs.append(engine.submit(prompts[2], NEW))
    engine.step()
    seqs.append(engine.submit(prompts[3], NEW))
    while engine.step():
        pass
    for seq, tokens, logits in zip(seqs, want_tokens, want_logits):
        assert seq.tokens == tokens, (name, seq.tokens, tokens)
        assert seq.finish_reason == ("stop" if tokens[-1] in engine.eos else "length")
        got = torch.stack(seen[id(seq)])
        assert rel_l2(got, logits) < 1e-5, (name, rel_l2(got, logits))
    if model.model.__dict__.get("_colibri_decode_step") is not None:
        assert engine.batched_rows > engine.steps, (engine.batched_rows, engine.steps)


def test_one_sequence_is_generate_to_the_bit(tmp_path):
    """Alone in the engine, a sequence's decode steps are run()'s calls:
    its logits equal generate's exactly."""
    path, _ = write(tmp_path, "qwen3moe")
    model = ct.from_pretrained(path, threads=2)
    prompt = list(range(40, 47))
    want_tokens, want_logits = _alone(model, [prompt])
    engine = Engine(model)
    seen = _recording(engine)
    seq = engine.submit(prompt, NEW)
    while engine.step():
        pass
    assert seq.tokens == want_tokens[0]
    step = model.model.__dict__.get("_colibri_decode_step")
    if step is not None and step.batch_steps:
        assert torch.equal(torch.stack(seen[id(seq)]), want_logits[0])


def test_sampling_is_seeded_and_cancel_frees_the_slot(tmp_path):
    path, _ = write(tmp_path, "qwen3moe")
    model = ct.from_pretrained(path, threads=2)
    engine = Engine(model, max_batch=2)
    prompt = list(range(60, 66))
    a = engine.submit(prompt, 12, temperature=0.9, top_p=0.9, seed=5, stop_tokens=[])
    b = engine.submit(prompt, 12, temperature=0.9, top_p=0.9, seed=5, stop_tokens=[])
    c = engine.submit(prompt, 12, temperature=0.9, top_p=0.9, seed=6, stop_tokens=[])
    while engine.step():
        pass
    assert a.tokens == b.tokens and len(a.tokens) == 12
    assert c.tokens != a.tokens
    # A top_p this small keeps only the most likely token: greedy.
    greedy = engine.submit(prompt, 12, stop_tokens=[])
    narrow = engine.submit(prompt, 12, temperature=1.5, top_p=1e-6, seed=1, stop_tokens=[])
    while engine.step():
        pass
    assert narrow.tokens == greedy.tokens

    long = engine.submit(prompt, 200, stop_tokens=[])
    engine.step()
    engine.step()
    assert engine.busy == 1
    long.cancel()
    engine.step()
    assert engine.busy == 0 and long.finish_reason == "cancelled" and long._cache is None


def test_requests_the_model_cannot_run_are_refused(tmp_path):
    path, _ = write(tmp_path, "qwen3moe")
    model = ct.from_pretrained(path, threads=2)
    engine = Engine(model, context_length=32)
    with pytest.raises(ValueError, match="exceed the context of 32 tokens"):
        engine.submit(list(range(20)), 13)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit([1, 320], 4)
    with pytest.raises(ValueError, match="empty"):
        engine.submit([], 4)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.submit([1], 0)
    with pytest.raises(ValueError, match="max_batch"):
        Engine(model, max_batch=0)
    assert engine.busy == 0
    seq = engine.submit(list(range(20)), 12)  # exactly the context
    while engine.step():
        pass
    assert len(seq.tokens) <= 12 and seq.finish_reason in ("length", "stop")


def test_a_failing_step_ends_its_sequences_with_the_error_and_the_engine_goes_on(tmp_path):
    path, _ = write(tmp_path, "qwen3moe")
    model = ct.from_pretrained(path, threads=2)
    engine = Engine(model)
    seq = engine.submit([5, 6, 7], 8)
    engine.step()  # prefilled, one token
    decode = engine._decode

    def broken(batch):
        raise RuntimeError("colibri_infer failed")

    engine._decode = broken
    engine.step()
    assert seq.finish_reason == "error" and "colibri_infer failed" in seq.error and engine.busy == 0
    engine._decode = decode
    again = engine.submit([5, 6, 7], 8, stop_tokens=[])
    while engine.step():
        pass
    assert again.finish_reason == "length" and len(again.tokens) == 8
