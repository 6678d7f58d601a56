"""A smoke run of scripts/serve_soak.py's request mix (30 requests: completions and chats, streamed and not,
clients leaving mid-stream, bad requests) against an in-process server on a one-layer random model: every reply
is one of the expected outcomes, none unexpected."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import pathlib
import sys

import pytest

import jdeep
from jdeep.runtime.engine import Engine
from jdeep.serve.server import ServerSettings, background_server

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "serve_soak.py"


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("serve_soak", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["serve_soak"] = mod            # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def test_the_soak_mix_gets_only_expected_outcomes(soak, tmp_path):
    vocab = soak.write_model("one-layer", str(tmp_path))
    engine = Engine(jdeep.load(tmp_path), max_num_seqs=4, max_len=64, prefill_chunk=16)
    plan = soak.make_plan(30, "soak", vocab, max_len=64, max_tokens=4, max_prompt=20, seed=1, bad_share=0.3,
                          disconnect_share=0.15)
    assert {p.kind for p in plan} == {"completion", "chat", "disconnect", "bad"}
    with background_server(engine, ServerSettings("soak")) as (url, _):
        out = asyncio.run(soak.drive(url, plan, concurrency=8))
    c = out["counts"]
    assert c["unexpected"] == 0, out["unexpected_examples"]
    assert c["bad"] == sum(p.kind == "bad" for p in plan) and c["completed"] > 0
    assert sum(c.values()) == len(plan)
    assert soak.rss_mib(os.getpid()) > 0                           # the RSS reading the soak reports
