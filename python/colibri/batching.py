"""Continuous batching of text generation over a from_pretrained model.

    engine = Engine(model, max_batch=8)
    seq = engine.submit([1, 2, 3], max_new_tokens=16)   # any thread
    engine.step()                                        # or engine.start()
    seq.tokens, seq.finish_reason

Requests join and leave between decode steps: each step first prefills
the sequences that arrived (each alone, on its own transformers cache, as
generate's prefill would), then runs one decode step of every running
sequence together through colibri.decode's run_batch: the projections,
norms and MoE layers run once on all rows (each weight is read once for
the whole batch), rope and attention per sequence over its own cache.
A sequence's greedy tokens are therefore what generate gives it alone,
up to the rounding of a kernel taking several rows at once (the tests
compare tokens and logits). Models without the direct decode step (or a
step it does not take: a cache past a sliding window, hooks) decode each
sequence alone through the model's forward; the batch is then a queue.

Sampling follows generate's order: temperature, then top-p, then a draw
from each sequence's own seeded generator; temperature 0 is greedy.
"""

import collections
import dataclasses
import inspect
import threading
import time
from typing import Callable, List, Optional

import torch


@dataclasses.dataclass
class Sequence:
    """One request's generation. Filled by the engine; `on_token(seq, token)`
    is called from the engine's thread for each new token and once more
    with token None when the sequence finishes."""

    prompt: List[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop_tokens: frozenset = frozenset()
    on_token: Optional[Callable] = None
    tokens: List[int] = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None  # "stop", "length", "cancelled" or "error"
    error: Optional[str] = None
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_at: Optional[float] = None
    _cache: object = None
    _generator: object = None
    _cancel: bool = False

    @property
    def done(self):
        return self.finish_reason is not None

    def cancel(self):
        """Frees the sequence's slot at the engine's next step (a client
        that went away)."""
        self._cancel = True


class Engine:
    """Runs submitted sequences `max_batch` at a time (module docstring)."""

    def __init__(self, model, max_batch=8, context_length=None):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1, got %r" % (max_batch,))
        self.model = model
        self.max_batch = int(max_batch)
        config = model.config
        self.context_length = int(context_length or getattr(config, "max_position_embeddings", 0) or 4096)
        self.eos = _eos_ids(model)
        self.step_fn = getattr(model, "model", None) and model.model.__dict__.get("_colibri_decode_step")
        # transformers 5 names the forward's cache argument `cache` (and warns
        # at `past_key_values`); 4.57 knows only `past_key_values`.
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._waiting = collections.deque()
        self._running: List[Sequence] = []
        self._cv = threading.Condition()
        self._thread = None
        self._stop = False
        self.steps = 0
        self.batched_rows = 0  # rows decoded by run_batch, for tests and metrics
        self.on_step: Optional[Callable] = None  # on_step(batch size, seconds), for metrics
        self.on_finish: Optional[Callable] = None  # on_finish(sequence), for metrics

    # ----------------------------------------------------------- requests
    def submit(self, prompt, max_new_tokens, *, temperature=0.0, top_p=1.0, seed=None, stop_tokens=None,
               on_token=None):
        """Queues a sequence; returns it. Raises ValueError for a request the
        model cannot run (empty prompt, a token outside the vocabulary, more
        tokens than the context holds): refused, never truncated."""
        prompt = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        if not prompt:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt if t < 0 or t >= vocab]
        if bad:
            raise ValueError("prompt token %d is outside the vocabulary [0, %d)" % (bad[0], vocab))
        if max_new_tokens < 1:
            raise ValueError("max_tokens must be >= 1, got %d" % max_new_tokens)
        if len(prompt) + max_new_tokens > self.context_length:
            raise ValueError("the prompt (%d tokens) and max_tokens (%d) exceed the context of %d tokens"
                             % (len(prompt), max_new_tokens, self.context_length))
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        stop = frozenset(self.eos if stop_tokens is None else stop_tokens)
        seq = Sequence(prompt, int(max_new_tokens), float(temperature), float(top_p), seed, stop, on_token)
        if seq.temperature > 0:
            seq._generator = torch.Generator()
            seq._generator.manual_seed(int(seed) if seed is not None else torch.seed())
        with self._cv:
            self._waiting.append(seq)
            self._cv.notify()
        return seq

    @property
    def busy(self):
        with self._cv:
            return len(self._running) + len(self._waiting)

    def start(self):
        """Runs steps on a thread of its own until close()."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="colibri-batching", daemon=True)
            self._thread.start()

    def close(self):
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for seq in list(self._running) + list(self._waiting):
            self._finish(seq, "cancelled")
        self._running.clear()
        self._waiting.clear()

    def _loop(self):
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not self._stop and not self._waiting and not self._running:
                        self._cv.wait()
                    if self._stop:
                        return
                self.step()

    # ------------------------------------------------------------- steps
    def step(self):
        """Admits waiting sequences (prefill), then one decode step of all
        running ones. Returns the number of sequences running or waiting."""
        with torch.inference_mode():
            self._drop_cancelled()
            while len(self._running) < self.max_batch:
                with self._cv:
                    if not self._waiting:
                        break
                    seq = self._waiting.popleft()
                if seq._cancel:
                    self._finish(seq, "cancelled")
                    continue
                self._prefill(seq)
            self._drop_cancelled()
            if self._running:
                started = time.perf_counter()
                batch = list(self._running)
                try:
                    self._decode(batch)
                except Exception as e:  # the step's sequences end with the error; the engine goes on
                    for seq in batch:
                        seq.error = "%s: %s" % (type(e).__name__, e)
                        self._finish(seq, "error")
                self.steps += 1
                if self.on_step is not None:
                    self.on_step(len(batch), time.perf_counter() - started)
            return self.busy

    def _drop_cancelled(self):
        for seq in [s for s in self._running if s._cancel]:
            self._finish(seq, "cancelled")

    def _prefill(self, seq):
        from transformers import DynamicCache
        try:
            seq._cache = DynamicCache(config=self.model.config)
            ids = torch.tensor([seq.prompt], dtype=torch.long)
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self._cache_arg: seq._cache})
            self._running.append(seq)
            self._emit(seq, out.logits[0, -1])
        except Exception as e:  # a failing request must not stop the others
            seq.error = "%s: %s" % (type(e).__name__, e)
            self._finish(seq, "error")

    def _decode(self, batch):
        ids = torch.tensor([s.tokens[-1] for s in batch], dtype=torch.long)
        logits = None
        step = self.step_fn
        caches = [s._cache for s in batch]
        if step is not None and step.fits_batch(caches):
            positions = torch.tensor([len(s.prompt) + len(s.tokens) - 1 for s in batch], dtype=torch.long)
            hidden = step.run_batch(ids, positions, caches)
            if hidden is not None:
                logits = self.model.lm_head(hidden.view(len(batch), 1, -1)).view(len(batch), -1)
                self.batched_rows += len(batch)
        if logits is None:
            rows = []
            for s, token in zip(batch, ids.tolist()):
                out = self.model(input_ids=torch.tensor([[token]]), use_cache=True, **{self._cache_arg: s._cache})
                rows.append(out.logits[0, -1])
            logits = torch.stack(rows)
        for s, row in zip(batch, logits):
            self._emit(s, row)

    def _emit(self, seq, logits):
        token = self._sample(seq, logits.float())
        now = time.perf_counter()
        if seq.first_token_at is None:
            seq.first_token_at = now
        seq.tokens.append(token)
        if seq.on_token is not None:
            seq.on_token(seq, token)
        if token in seq.stop_tokens:
            self._finish(seq, "stop")
        elif len(seq.tokens) >= seq.max_new_tokens:
            self._finish(seq, "length")

    @staticmethod
    def _sample(seq, logits):
        if seq.temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / seq.temperature, dim=-1)
        if seq.top_p < 1:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (at least one token).
            drop = torch.cumsum(sorted_probs, 0) - sorted_probs >= seq.top_p
            sorted_probs[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=seq._generator))

    def _finish(self, seq, reason):
        if seq.finish_reason is None:
            seq.finish_reason = reason
        seq._cache = None
        if seq in self._running:
            self._running.remove(seq)
        if seq.on_token is not None:
            seq.on_token(seq, None)
        if self.on_finish is not None:
            self.on_finish(seq)


def _eos_ids(model):
    ids = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return frozenset(ids)
