"""What `shipyard serve` counts, exposed at GET /metrics in the Prometheus text format.

One registry per app (prometheus-client's default registry is process-global, and a test or a
process serving two apps would mix their counts). Gauges read the engine when scraped (queue depth,
slots, KV cache in use), so nothing is sampled on the hot path; counters and histograms are
updated when a request ends (tokens, time to first token, time per output token) and when a
response starts (responses by status, so errors by status are `status=~"4..|5.."`). The prefix
cache's and speculation's counters are read from the engine when scraped, where they are on.

The names follow vLLM's where the quantity is the same (`..._prompt_tokens_total`,
`..._time_to_first_token_seconds`), under the `shipyard_` prefix, so a dashboard built for one
needs only the prefix changed.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Seconds: a CPU serving a tiny model answers in milliseconds, a large model on a busy server in tens
# of seconds; the buckets cover both.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

CONTENT_TYPE = CONTENT_TYPE_LATEST
"""The Content-Type of `ServeMetrics.render` (Prometheus text format 0.0.4)."""


class ServeMetrics:
    """The counters of one server over one engine."""

    def __init__(self, engine, swapper=None):
        """`swapper`: the server's `hot_swap.Swapper`, whose swaps are counted (None: none happen)."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        if swapper is not None:
            r.register(_SwapCounts(swapper))
        if engine.prefix is not None:
            r.register(_PrefixCounts(engine.prefix))
        if engine.speculate:
            r.register(_SpeculationCounts(engine))
        Gauge("shipyard_queue_depth", "Requests waiting for a free slot", registry=r).set_function(
            engine.pending
        )
        Gauge("shipyard_active_slots", "Requests holding a decode slot", registry=r).set_function(
            engine.active
        )
        Gauge("shipyard_free_slots", "Decode slots free", registry=r).set_function(
            lambda: engine.max_batch - engine.active()
        )
        Gauge("shipyard_max_slots", "Decode slots in all (--max-batch)", registry=r).set(engine.max_batch)
        Gauge(
            "shipyard_kv_cache_tokens", "KV cache positions the running requests hold", registry=r
        ).set_function(engine.kv_tokens)
        Gauge(
            "shipyard_kv_cache_usage_ratio", "Fraction of the KV cache the running requests hold", registry=r
        ).set_function(lambda: engine.kv_tokens() / (engine.max_batch * engine.max_len))
        self.prompt_tokens = Counter(
            "shipyard_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter(
            "shipyard_generation_tokens", "Tokens generated for finished requests", registry=r
        )
        self.requests = Counter(
            "shipyard_requests", "Generation requests (one per prompt and sample) by how they ended",
            ["finish"], registry=r,
        )  # fmt: skip
        self.responses = Counter(
            "shipyard_http_responses", "HTTP responses by route and status", ["path", "status"], registry=r
        )
        self.ttft = Histogram(
            "shipyard_time_to_first_token_seconds", "From a request's arrival to its first token",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            "shipyard_time_per_output_token_seconds", "Mean time between a request's tokens after the first",
            buckets=TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        self.latency = Histogram(
            "shipyard_request_latency_seconds", "From a request's arrival to its last token",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip

    def request_done(
        self, prompt_tokens: int, tokens: int, finish: str, arrived: float, first: float | None, last: float
    ) -> None:
        """One generation request ended (`arrived`, `first` and `last` token: perf_counter seconds)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(tokens)
        self.requests.labels(finish=finish).inc()
        self.latency.observe(last - arrived)
        if first is not None:
            self.ttft.observe(first - arrived)
            if tokens > 1:
                self.tpot.observe((last - first) / (tokens - 1))

    def response(self, path: str, status: int) -> None:
        self.responses.labels(path=path, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SwapCounts:
    """shipyard_weight_swaps_total{result="ok"|"refused"}, read from the swapper when scraped (a swap
    runs in a worker thread or the `--watch` poller, never on the request path)."""

    def __init__(self, swapper):
        self.swapper = swapper

    def describe(self):
        return [CounterMetricFamily("shipyard_weight_swaps", "Weight swaps by result", labels=["result"])]

    def collect(self):
        family = CounterMetricFamily("shipyard_weight_swaps", "Weight swaps by result", labels=["result"])
        for result, n in sorted(self.swapper.counts.items()):
            family.add_metric([result], n)
        yield family


class _PrefixCounts:
    """The prefix cache's counters (inference/prefix_cache.py), read from its index when scraped:
    lookups and hits (admissions), hit tokens (prompt tokens whose K/V came from the cache), saved
    tokens (prefill positions not computed), blocks evicted, and the prompt tokens it holds now and
    can hold."""

    _COUNTERS = (
        ("lookups", "Prompts looked up in the prefix cache (one per prefill)"),
        ("hits", "Prompts prefilled from a cached prefix"),
        ("hit_tokens", "Prompt tokens whose keys and values came from the prefix cache"),
        ("saved_tokens", "Prefill positions the prefix cache saved computing"),
        ("evicted", "Blocks the full prefix cache gave to a new prefix (least recently used first)"),
    )

    def __init__(self, index):
        self.index = index

    def describe(self):
        return list(self._families())

    def collect(self):
        return self._families()

    def _families(self):
        for name, doc in self._COUNTERS:
            family = CounterMetricFamily(f"shipyard_prefix_cache_{name}", doc)
            family.add_metric([], getattr(self.index, name))
            yield family
        yield GaugeMetricFamily(
            "shipyard_prefix_cache_tokens",
            "Prompt tokens the prefix cache holds",
            value=self.index.held_tokens(),
        )
        yield GaugeMetricFamily(
            "shipyard_prefix_cache_capacity_tokens", "Prompt tokens the prefix cache can hold",
            value=self.index.blocks * self.index.chunk,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "shipyard_prefix_cache_entries", "Prompts of up to 2,048 tokens the prefix cache is sized for (--prefix-cache)",
            value=self.index.entries,
        )  # fmt: skip


class _SpeculationCounts:
    """Speculative decoding's draft tokens checked and kept (inference/speculation.py), read from the
    engine when scraped; vLLM's names under `shipyard_`."""

    def __init__(self, engine):
        self.engine = engine

    def describe(self):
        return list(self.collect())

    def collect(self):
        for name, doc, value in (
            ("spec_decode_num_draft_tokens", "Draft tokens checked", self.engine.drafted),
            ("spec_decode_num_accepted_tokens", "Draft tokens the model agreed with", self.engine.accepted),
        ):
            family = CounterMetricFamily(f"shipyard_{name}", doc)
            family.add_metric([], value)
            yield family
