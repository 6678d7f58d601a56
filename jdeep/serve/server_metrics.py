"""The server's metric set (GET /metrics): HTTP requests by route and status, requests turned away (429) and timed
out, tokens, finish reasons, latency histograms, the engine's gauges (slots, waiting requests, steps) and what its
scheduler put in each iteration (decode tokens, prefill tokens, the queue time of each admitted request)."""

from __future__ import annotations

import time
from typing import Iterable

from ..model.cache import PROGRAMS
from .async_engine import AsyncEngine
from ..runtime.engine import IterationStats
from .metrics import Counter, CounterFn, Gauge, Histogram, Registry

__all__ = ["ServerMetrics", "Latency"]


class ServerMetrics:
    """Every metric the server exports; `render()` is the body of GET /metrics."""

    def __init__(self, aengine: AsyncEngine):
        r = self.registry = Registry()
        st = aengine.stats
        self.requests = r.add(Counter("jdeep_requests_total", "HTTP requests by route and status code",
                                      ("endpoint", "status")))
        self.rejected = r.add(Counter("jdeep_requests_rejected_total",
                                      "Generation requests turned away with 429 (too many waiting for a slot)"))
        self.disconnects = r.add(Counter("jdeep_client_disconnects_total",
                                         "Requests whose client went away before their answer was complete (while "
                                         "sending the body, waiting, or streaming; not server errors: their status "
                                         "in jdeep_requests_total is 499, or 200 for a stream already answering)"))
        self.timeouts = r.add(Counter("jdeep_request_timeouts_total",
                                      "Generation requests cancelled at the server's request timeout"))
        self.finished = r.add(Counter("jdeep_request_finished_total", "Generation requests by finish reason",
                                      ("finish_reason",)))
        self.prompt_tokens = r.add(Counter("jdeep_prompt_tokens_total", "Prompt tokens processed"))
        self.generation_tokens = r.add(Counter("jdeep_generation_tokens_total", "Tokens generated"))
        self.ttft = r.add(Histogram("jdeep_time_to_first_token_seconds", "Request arrival to its first token"))
        self.itl = r.add(Histogram("jdeep_inter_token_latency_seconds", "Time between a request's tokens"))
        self.e2e = r.add(Histogram("jdeep_e2e_request_latency_seconds", "Request arrival to its last token"))
        self.step = r.add(Histogram("jdeep_engine_step_seconds", "Duration of one engine step"))
        r.add(Gauge("jdeep_slots_total", "Sequence slots in the engine's pool", lambda: st.slots))
        r.add(Gauge("jdeep_slots_used", "Slots held by running requests", lambda: st.running))
        r.add(Gauge("jdeep_requests_waiting", "Requests accepted and waiting for a slot", lambda: aengine.n_waiting))
        limit = aengine.max_waiting
        r.add(Gauge("jdeep_requests_waiting_limit", "Waiting requests beyond which new ones get 429 (-1: no limit)",
                    lambda: -1 if limit is None else limit))
        r.add(Gauge("jdeep_engine_steps_total", "Engine steps run", lambda: st.steps))
        r.add(Gauge("jdeep_warming", "1 while the engine thread compiles its programs before serving", lambda: int(st.warming)))
        r.add(Gauge("jdeep_warmup_programs", "Programs the warm-up compiles (the engine's inventory)", lambda: st.total))
        r.add(Gauge("jdeep_warmup_programs_compiled", "Programs the warm-up has compiled so far", lambda: st.compiled))
        r.add(Gauge("jdeep_warmup_seconds", "Seconds the warm-up took (so far, while warming)",
                    lambda: st.compile_seconds))
        r.add(CounterFn("jdeep_programs_compiled_total", "Executables compiled by jdeep's programs in this process "
                        "(warm-up's and those compiled on first use: prompt-logprob variants)", PROGRAMS.n_compiled))
        r.add(CounterFn("jdeep_engine_restarts_total", "Times the engine thread failed outside a step and restarted "
                        "the engine (the requests in flight then failed)", lambda: st.restarts))
        lockstep = aengine.lockstep
        mesh = (lambda: lockstep.status()) if lockstep is not None else (
            lambda: {"processes": 1, "by_process": [{"in_step": st.error is None}]})
        r.add(Gauge("jdeep_mesh_processes", "Processes running the engine in lockstep (multi-process serving)",
                    lambda: mesh()["processes"]))
        r.add(Gauge("jdeep_mesh_processes_in_step", "Processes with a fresh heartbeat within a step of process 0",
                    lambda: sum(p["in_step"] for p in mesh()["by_process"])))
        r.add(Gauge("jdeep_mesh_failed", "1 once a process of the mesh died, stalled or fell out of step",
                    lambda: int(st.error is not None)))
        tokens = [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
        self.iteration_decode = r.add(Histogram("jdeep_iteration_decode_tokens",
                                                "Tokens decoded in one engine iteration (one per running request)",
                                                tokens))
        self.iteration_prefill = r.add(Histogram("jdeep_iteration_prefill_tokens",
                                                 "Prompt tokens prefilled in one engine iteration", tokens))
        self.queue_time = r.add(Histogram("jdeep_request_queue_time_seconds",
                                          "Time a request waited for a sequence slot"))
        r.add(Gauge("jdeep_max_num_batched_tokens", "Token positions one engine iteration may compute",
                    lambda: aengine.engine.max_num_batched_tokens))
        aengine.on_step = self.step.observe          # from the engine thread (histograms take a lock)
        aengine.engine.on_iteration = self._iteration
        cache = aengine.engine.prefix_cache
        if cache is not None:       # counters the engine thread advances; read as they are (ints, no lock needed)
            pc = cache.stats
            for name, what, read in [("hits", "Prompts that started from a cached prefix", lambda: pc.hits),
                                     ("misses", "Prompts that found no cached prefix", lambda: pc.misses),
                                     ("hit_tokens", "Prompt tokens served from cached prefixes", lambda: pc.hit_tokens),
                                     ("evictions", "Snapshots evicted (least recently used)", lambda: pc.evictions)]:
                r.add(CounterFn(f"jdeep_prefix_cache_{name}_total", what, read))
            r.add(Gauge("jdeep_prefix_cache_bytes", "Device bytes of the cached prefix snapshots", lambda: pc.bytes))
            r.add(Gauge("jdeep_prefix_cache_budget_bytes", "The prefix cache's byte budget", lambda: cache.budget))
            r.add(Gauge("jdeep_prefix_cache_entries", "Cached prefix snapshots", lambda: pc.entries))

    def _iteration(self, it: IterationStats) -> None:
        self.iteration_decode.observe(it.decode_tokens)
        self.iteration_prefill.observe(it.prefill_tokens)
        for q in it.queue_times:
            self.queue_time.observe(q)

    def render(self) -> str:
        """The Prometheus text of every metric."""
        return self.registry.render()


class Latency:
    """TTFT / ITL / end-to-end latency of one HTTP request, and its tokens and finish reasons when it ends."""

    def __init__(self, metrics: ServerMetrics):
        self.m, self.t0, self.last = metrics, time.monotonic(), None

    def tokens(self, n: int, at: float) -> None:
        """n tokens arrived at time.monotonic() `at`."""
        if n == 0:
            return
        if self.last is None:
            self.m.ttft.observe(at - self.t0)
        else:
            for _ in range(n):
                self.m.itl.observe((at - self.last) / n)
        self.last = at

    def done(self, prompt_tokens: int, completion_tokens: int, reasons: Iterable[str]) -> None:
        """The request ended: its token counts and each choice's finish reason."""
        self.m.e2e.observe(time.monotonic() - self.t0)
        self.m.prompt_tokens.inc(prompt_tokens)
        self.m.generation_tokens.inc(completion_tokens)
        for r in reasons:
            self.m.finished.inc(1, r)
            if r == "timeout":
                self.m.timeouts.inc()
