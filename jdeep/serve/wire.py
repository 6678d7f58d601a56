"""The engine commands process 0 sends the other processes of a multi-process server (serve/lockstep.py), as JSON.

A command is a JSON list: ["add", request_id, request] (a validated Request: its token ids, sampling parameters and
stop ids), ["abort", request_id, finish_reason, error] or ["abort_all"]. JSON keeps every value exact (floats
round-trip through their repr) and, unlike pickle, runs nothing on the receiving side: the store that carries it is
reachable over the network. Image prompts do not travel (their span rows are the vision tower's output, which only
process 0 computed): `request_to_wire` refuses them by name."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..runtime.requests import Request, RequestError
from ..runtime.sampling import SamplingParams

__all__ = ["request_to_wire", "request_from_wire", "apply_command"]

_PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def request_to_wire(r: Request) -> dict[str, Any]:
    """A validated Request as JSON-ready values; RequestError for an image prompt."""
    if r.images:
        raise RequestError("image prompts are not served by a multi-process server yet (the vision tower runs on "
                           "process 0 only): send text, or serve the model from one process", "messages")
    return {"ids": np.asarray(r.ids).tolist(), "params": dataclasses.asdict(r.params), "stop_ids": list(r.stop_ids)}


def _tuples(v: Any) -> Any:
    """JSON lists back into the tuples SamplingParams holds (logit_bias: a tuple of (id, bias) pairs)."""
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def request_from_wire(d: dict[str, Any]) -> Request:
    """The Request `request_to_wire` wrote; ValueError when the fields are not SamplingParams' (the processes run
    different jdeep versions)."""
    unknown = set(d["params"]) - _PARAM_FIELDS
    if unknown:
        raise ValueError(f"sampling fields {sorted(unknown)} are unknown to this process's jdeep: every process of a "
                         "multi-process server must run the same jdeep version")
    params = SamplingParams(**{k: _tuples(v) for k, v in d["params"].items()})
    return Request(np.asarray(d["ids"], np.int32), params, tuple(d["stop_ids"]))


def apply_command(engine, cmd: list) -> None:
    """Apply one command to an Engine as process 0 applied it to its own."""
    kind = cmd[0]
    if kind == "add":
        engine.add_request(request_from_wire(cmd[2]), request_id=cmd[1])
    elif kind == "abort":
        engine.abort(cmd[1], cmd[2], cmd[3])
    elif kind == "abort_all":
        for rid, out in list(engine.outputs.items()):
            if not out.finished:
                engine.abort(rid)
    else:
        raise ValueError(f"unknown engine command {kind!r} from process 0")
