"""Prometheus text exposition: counters with labels, gauges read at render time, cumulative histograms."""

from __future__ import annotations

from jdeep.serve.metrics import Counter, Gauge, Histogram, Registry


def test_render_follows_the_text_format():
    r = Registry()
    c = r.add(Counter("x_requests_total", "Requests", ("endpoint", "status")))
    c.inc(1, "/v1/completions", "200")
    c.inc(2, "/v1/completions", "200")
    c.inc(1, 'we"ird\n', "400")
    plain = r.add(Counter("x_tokens_total", "Tokens"))
    value = [3]
    r.add(Gauge("x_slots_used", "Slots", lambda: value[0]))
    h = r.add(Histogram("x_latency_seconds", "Latency", buckets=(0.1, 1.0)))
    for x in (0.05, 0.1, 0.5, 7.0):
        h.observe(x)
    value[0] = 5
    lines = r.render().splitlines()
    assert lines[:2] == ["# HELP x_requests_total Requests", "# TYPE x_requests_total counter"]
    assert 'x_requests_total{endpoint="/v1/completions",status="200"} 3' in lines
    assert 'x_requests_total{endpoint="we\\"ird\\n",status="400"} 1' in lines
    assert "x_tokens_total 0" in lines and plain.values == {(): 0.0}
    assert "# TYPE x_slots_used gauge" in lines and "x_slots_used 5" in lines
    assert ['x_latency_seconds_bucket{le="0.1"} 2', 'x_latency_seconds_bucket{le="1"} 3',
            'x_latency_seconds_bucket{le="+Inf"} 4'] == [ln for ln in lines if "_bucket" in ln]
    assert "x_latency_seconds_sum 7.65" in lines and "x_latency_seconds_count 4" in lines
