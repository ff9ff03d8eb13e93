"""Prometheus metrics of a served model (colibri.serve's /metrics), with
prometheus_client: the server's requests, tokens and latencies, the
batching engine's steps, and the library's own counters read from every
Colibri model a transformers model routes its MoE layers through
(colibri_stats and colibri_model_kernels) at each scrape.
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

# Seconds: time to first token spans prefill (tens of ms to seconds); the
# inter-token latency of a decode step is milliseconds.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1)
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


def colibri_models(model):
    """The distinct Colibri models behind a from_pretrained (or accelerate)
    model's MoE layers, in layer order."""
    seen, out = set(), []
    for module in model.modules():
        routed = module.__dict__.get("_colibri_routed")
        cmodel = routed[0] if routed is not None else None
        if cmodel is None:
            state = module.__dict__.get("_colibri_state")  # accelerate()'s blocks
            cmodel = getattr(getattr(state, "experts", None), "colibri_model", None)
        if cmodel is not None and id(cmodel) not in seen:
            seen.add(id(cmodel))
            out.append(cmodel)
    return out


class _LibraryCollector:
    """colibri_stats of each Colibri model, summed, at scrape time."""

    _COUNTERS = (
        ("infer_calls", "MoE layer calls computed"),
        ("expert_swaps", "experts swapped in under a memory budget"),
        ("cache_hits", "expert cache hits (max_resident)"),
        ("cache_misses", "expert cache misses (max_resident)"),
        ("cache_evictions", "expert cache evictions (max_resident)"),
        ("expert_reads", "experts read from the file on demand"),
        ("bytes_read", "bytes read from the file on demand"),
    )
    _GAUGES = (
        ("bytes_mapped", "packed expert bytes in memory"),
        ("bytes_locked", "packed bytes locked in memory (mlock)"),
        ("bytes_huge_pages", "packed bytes on huge pages"),
        ("resident_bytes", "expert bytes resident under a memory budget"),
    )

    def __init__(self, models):
        self.models = models

    def describe(self):
        return []

    def collect(self):
        stats = [m.stats for m in self.models]
        for name, doc in self._COUNTERS:
            yield CounterMetricFamily("colibri_library_" + name, doc, value=sum(getattr(s, name) for s in stats))
        for name, doc in self._GAUGES:
            yield GaugeMetricFamily("colibri_library_" + name, doc, value=sum(getattr(s, name) for s in stats))
        info = InfoMetricFamily("colibri_kernels", "the kernels each Colibri model runs", labels=["model"])
        for i, m in enumerate(self.models):
            info.add_metric([str(i)], {"kernels": m.kernels})
        yield info


class ServerMetrics:
    """The server's metrics in a registry of their own."""

    def __init__(self, model=None, engine=None):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("colibri_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("colibri_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("colibri_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("colibri_time_to_first_token_seconds", "request received to its first token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("colibri_inter_token_latency_seconds", "time between a stream's tokens",
                             buckets=_ITL_BUCKETS, registry=r)
        self.duration = Histogram("colibri_request_duration_seconds", "request received to its last token",
                                  buckets=_TTFT_BUCKETS, registry=r)
        self.batch = Histogram("colibri_decode_batch_size", "sequences in one decode step",
                               buckets=_BATCH_BUCKETS, registry=r)
        self.step = Histogram("colibri_decode_step_seconds", "one batched decode step", buckets=_ITL_BUCKETS,
                              registry=r)
        self.finished = Counter("colibri_requests_finished", "generations ended, by reason", ["reason"],
                                registry=r)
        if engine is not None:
            running = Gauge("colibri_requests_running", "sequences admitted or waiting", registry=r)
            running.set_function(lambda: engine.busy)
        if model is not None:
            r.register(_LibraryCollector(colibri_models(model)))

    def on_finish(self, seq):
        self.finished.labels(seq.finish_reason).inc()

    def on_step(self, rows, seconds):
        self.batch.observe(rows)
        self.step.observe(seconds)
