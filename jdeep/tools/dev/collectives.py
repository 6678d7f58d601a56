"""Collective volume of a sharded step, read from its compiled program: what `jdeep info --mesh` prints per decode
step and per prefill chunk next to the bytes per device.

`hlo_collectives(text)` reads the text of a compiled, SPMD-partitioned program (`jax.jit(f).lower(...).compile()
.as_text()`: the per-device module, holding both the MoE's explicit `shard_map` collectives and those XLA's
partitioner inserted) and returns per collective kind (all-reduce, all-gather, reduce-scatter, all-to-all,
collective-permute) how many times it runs per call of the program and the bytes it moves per device:

    executions  walked through the call graph from ENTRY: an op in a `while` body counts its known trip count
                (`backend_config={"known_trip_count":{"n":...}}`, what XLA states for `lax.scan` loops: the layers
                of a scan segment), nested whiles multiply, a while's condition runs trips + 1 times; called
                computations (call, fusion, async wrappers, reducers) count once per call; of a `conditional`'s
                branches the one with the most link bytes counts (one branch runs). Async pairs count once (the
                -start op; -done and -update are skipped). A while without a known trip count counts once and is
                reported in `unknown_trips` (where it runs collectives).
    payload     the operand bytes per device, exactly as the HLO states them (every element of a tuple-shaped,
                several-operand collective; an all-gather's operand is the local shard, a reduce-scatter's the
                whole input).
    link        the bytes a device sends over its links under the standard algorithms, n = the replica group
                size (from replica_groups: the explicit {{..},..}, the iota [g,n]<=[N] or the mesh-axes
                mesh[...] {axes} form; empty = all devices): all-reduce (ring) 2(n-1)/n x payload, all-gather
                (n-1)/n x output = (n-1) x payload, reduce-scatter (n-1)/n x payload, all-to-all (pairwise)
                (n-1)/n x payload, collective-permute the full payload.
    time        link bytes / link bandwidth (GB/s per device link; latency and overlap with compute not modelled).

`step_collectives(config, mesh, ...)` builds one decode step (B sequences, 1 token) and one prefill chunk (B, S)
from abstract arguments (no weights: the parameter tree as jdeep.load(..., mesh=) shards it, routed experts padded
to the expert axis; weights as the checkpoint stores them; tokens replicated, the state by sequence slot) and
compiles both for the mesh. That needs as many devices as the mesh has: with fewer, `measure` runs it in a
subprocess (`python -m jdeep.tools.dev.collectives`, a JSON request on stdin, the JSON result on stdout) with
XLA_FLAGS=--xla_force_host_platform_device_count=N on CPU. The partitioning is XLA's SPMD partitioner's (backend-independent);
the passes after it (combiners, async scheduling) are the compiling backend's, and another backend may merge
several ops into one run. The scan mode compiles one layer body per scan
segment, whatever the depth; measured on a 2-core CPU for both programs: V4-Flash on data=1,tensor=4,expert=16
18-24 s, V4-Pro on the same mesh 16 s, V4.1-Flash on data=2,expert=8 37 s (peak ~1.3 GB of host memory), the
4-layer golden model 6-9 s per 8-device mesh. `jdeep info --mesh` is otherwise instant, so it measures only when
asked (`--collectives`, `--link-gbps` or `--prefill-len`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from ...config import ModelConfig
from ...model.cache import ProgramCache
from ...model.model import compiled_step
from ...numerics import Numerics
from ...param_spec import tree_path
from ...plan import build_plan
from ...sharding import Layout, make_mesh, parse_mesh
from .info import param_shares
from .programs import Target, step_inputs

__all__ = ["KINDS", "DEFAULT_LINK_GBPS", "DEFAULT_PREFILL_LEN", "Volume", "hlo_collectives", "link_bytes",
           "step_collectives", "step_args", "measure", "collectives_table", "result_to_json",
           "result_from_json"]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# GB/s per device link. No trn2 figure in the project's Neuron notes: a round placeholder of the order of one
# NeuronLink / NVLink lane group per device; pass the real one with --link-gbps.
DEFAULT_LINK_GBPS = 100.0
DEFAULT_PREFILL_LEN = 256    # the Engine's default prefill chunk

_ITEM_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16, "bf16": 16, "s32": 32,
              "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLED = re.compile(r"\b(body|condition|to_apply|calls)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}|(?:true|false)_computation=%?([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[^}]*\})")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


@dataclass
class Volume:
    """One collective kind in one program: executions per call and bytes per device summed over them."""

    count: int = 0
    payload: float = 0.0      # operand bytes
    link: float = 0.0         # bytes sent over the device's links (module docstring)

    def add(self, other: "Volume", times: int = 1) -> None:
        self.count += other.count * times
        self.payload += other.payload * times
        self.link += other.link * times


def _shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape (a tuple counts every element; token and empty shapes are 0)."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        bits = _ITEM_BITS.get(dtype) or {"f8": 8, "f4": 4}.get(dtype[:2])
        if bits is None:
            continue
        sizes = [int(d.lstrip("<=")) for d in dims.split(",") if d.strip()]
        total += math.prod(sizes) * bits / 8
    return total


def link_bytes(kind: str, payload: float, n: int) -> float:
    """Bytes one device sends for a collective of `payload` operand bytes over a group of n (module docstring)."""
    if kind == "collective-permute":
        return payload
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (n - 1) / n * payload
    if kind == "all-gather":
        return (n - 1) * payload
    return (n - 1) / n * payload


def _group_size(attrs: str, n_devices: int) -> int:
    """Devices per replica group: {{0,1},{2,3}} lists them, [g,n]<=[N]... is an iota of g groups of n, and
    mesh['a'=2,'b'=4] {'b'} names the mesh axes a group spans (a sub-axis 'b':(k)m spans m of them)."""
    m = _GROUPS_MESH.search(attrs)
    if m:
        sizes = {a: int(n) for a, n in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        n = 1
        for axis, sub in re.findall(r"'([^']+)'(?::\(\d+\)(\d+))?", m.group(2)):
            n *= int(sub) if sub else sizes[axis]
        return n
    m = _GROUPS_IOTA.search(attrs)
    if m:
        return int(m.group(1).split(",")[-1])
    m = _GROUPS_LIST.search(attrs)
    if m:
        ids = [x for x in m.group(1).strip("{}").split(",") if x.strip()]
        return len(ids) or n_devices
    return n_devices


def _split_shape(rest: str) -> tuple[str, str]:
    """'SHAPE opcode(...), attrs' -> (SHAPE, 'opcode(...), attrs'); tuple shapes hold spaces and parentheses."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[:i + 1], rest[i + 1:].lstrip()
    shape, _, tail = rest.partition(" ")
    return shape, tail


def _operands(call: str) -> tuple[str, str]:
    """'opcode(a, b), attrs' -> ('a, b', 'attrs')."""
    start = call.index("(")
    depth = 0
    for i in range(start, len(call)):
        depth += call[i] == "("
        depth -= call[i] == ")"
        if depth == 0:
            return call[start + 1:i], call[i + 1:]
    return call[start + 1:], ""


def _parse(text: str) -> tuple[dict[str, list[tuple[str, str, str, str]]], str | None, int]:
    """Computations of an HLO module: name -> [(opcode, shape, operands, attrs)], the ENTRY's name, and the
    module's device count (num_partitions x replica_count)."""
    comps: dict[str, list] = {}
    entry, current, shapes = None, None, {}
    n_devices = 1
    for key in ("num_partitions", "replica_count"):
        m = re.search(rf"\b{key}=(\d+)", text.split("\n", 1)[0])
        n_devices *= int(m.group(1)) if m else 1
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m and "=" not in line.split("(", 1)[0]:
            current, shapes = m.group(2), {}
            comps[current] = []
            if m.group(1):
                entry = current
            continue
        m = _INSTRUCTION.match(line) if current is not None else None
        if m is None:
            continue
        shape, call = _split_shape(m.group(2))
        opcode = call.split("(", 1)[0].strip()
        operands, attrs = _operands(call) if "(" in call else ("", "")
        shapes[m.group(1)] = shape
        operand_shapes = " ".join(shapes.get(name, "") for name in re.findall(r"%([\w.\-]+)", operands))
        comps[current].append((opcode, shape, operand_shapes, attrs))
    return comps, entry, n_devices


def hlo_collectives(text: str) -> dict[str, Any]:
    """Per kind (KINDS) a Volume of the compiled module `text`, plus "unknown_trips": whiles without a known trip
    count (counted once)."""
    comps, entry, n_devices = _parse(text)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text: pass a compiled program's .as_text()")
    memo: dict[str, tuple[dict[str, Volume], int]] = {}

    def totals(name: str) -> tuple[dict[str, Volume], int]:
        if name in memo:
            return memo[name]
        memo[name] = ({k: Volume() for k in KINDS}, 0)     # a cycle would be malformed HLO: count it once
        out, unknown = {k: Volume() for k in KINDS}, 0
        for opcode, shape, operand_shapes, attrs in comps.get(name, ()):
            if opcode.endswith(("-done", "-update")):
                continue
            kind = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
            if kind in KINDS:
                payload = _shape_bytes(operand_shapes)
                n = _group_size(attrs, n_devices)
                out[kind].add(Volume(1, payload, link_bytes(kind, payload, n)))
            if opcode == "conditional":
                names = [b.strip().lstrip("%") for many, one in _BRANCHES.findall(attrs)
                         for b in (many.split(",") if many else [one]) if b.strip()]
                options = [totals(b) for b in names] or [({k: Volume() for k in KINDS}, 0)]
                best = max(options, key=lambda o: sum(v.link for v in o[0].values()))
                for k in KINDS:
                    out[k].add(best[0][k])
                unknown += best[1]
                continue
            m = _TRIPS.search(attrs) if opcode == "while" else None
            trips = int(m.group(1)) if m else 1
            for role, called in _CALLED.findall(attrs):
                sub, sub_unknown = totals(called)
                times = trips + 1 if role == "condition" else trips
                for k in KINDS:
                    out[k].add(sub[k], times)
                unknown += sub_unknown + (opcode == "while" and m is None and any(sub[k].count for k in KINDS))
        memo[name] = (out, unknown)
        return memo[name]

    volumes, unknown = totals(entry)
    return {**volumes, "unknown_trips": unknown}


# ------------------------------------------------------------------------------------------ the step programs
def _key_path(kp) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in kp)


def step_args(config: ModelConfig, layout: Layout, numerics: Numerics, dtype: Any, batch: int, seq: int,
              max_len: int) -> tuple:
    """Abstract (params, state, tokens, positions, engram, embeds) of a step on `layout`'s mesh, placed as a model
    loaded with jdeep.load(..., mesh=) places them (routed experts padded to the expert axis)."""
    target = Target(config, build_plan(config), numerics, dtype)
    params, state, ids, positions, engram, embeds = step_inputs(target, batch, seq, max_len)
    shares = {tree_path(s.key): s for s in param_shares(config, layout, dtype)}

    def place_param(kp, leaf):
        share = shares[_key_path(kp)]
        return jax.ShapeDtypeStruct(share.shape, leaf.dtype, sharding=NamedSharding(layout.mesh, share.spec))

    def place(leaf, sharding):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    params = jax.tree_util.tree_map_with_path(place_param, params)
    state = jax.tree_util.tree_map(place, state, layout.state_shardings(state))
    ids, positions = (place(a, layout.replicated) for a in (ids, positions))
    if engram is not None:
        engram = tuple(place(a, layout.replicated) for a in engram)
    return params, state, ids, positions, engram, embeds


def step_collectives(config: ModelConfig, mesh: Any, batch: int = 1, max_len: int = 8192,
                     prefill_len: int = DEFAULT_PREFILL_LEN, dtype: Any = np.float32,
                     packed_kv: bool = False, devices: list | None = None) -> dict[str, Any]:
    """Compile one decode step (batch x 1 token) and one prefill chunk (batch x prefill_len) of `config` on `mesh`
    over `devices` (default: all of this process's, as many as the mesh has) and read their collectives:
    {"decode": {kind: Volume, ...}, "prefill": {...}, "compile_s": seconds}."""
    layout = Layout.for_model(make_mesh(mesh, devices), config.moe_inter_dim)
    # as jdeep.load places a model on a mesh: no native CPU products (a custom call XLA cannot partition)
    numerics = Numerics.for_config(config, None, packed_kv=packed_kv).portable()
    plan = build_plan(config)
    fn = compiled_step(config, plan, numerics, False, layout, cache=ProgramCache())
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    for name, seq in (("decode", 1), ("prefill", prefill_len)):
        args = step_args(config, layout, numerics, dtype, batch, seq, max_len)
        out[name] = hlo_collectives(fn.lower(*args).compile().as_text())
    out["compile_s"] = time.perf_counter() - t0
    return out


def result_to_json(result: dict) -> dict:
    """A `step_collectives` result as plain JSON values (Volumes as dicts)."""
    return {k: ({kk: asdict(vv) if isinstance(vv, Volume) else vv for kk, vv in v.items()} if isinstance(v, dict)
                else v) for k, v in result.items()}


def result_from_json(raw: dict) -> dict:
    """The inverse of `result_to_json`."""
    return {k: ({kk: Volume(**vv) if isinstance(vv, dict) else vv for kk, vv in v.items()} if isinstance(v, dict)
                else v) for k, v in raw.items()}


def measure(config: ModelConfig, mesh: Any, batch: int = 1, max_len: int = 8192,
            prefill_len: int = DEFAULT_PREFILL_LEN, dtype: Any = np.float32, packed_kv: bool = False) -> dict:
    """`step_collectives` here, on the first devices, when this process has at least the mesh's number of devices,
    else in a CPU subprocess with that many host devices."""
    sizes = parse_mesh(mesh)
    n = math.prod(sizes.values())
    if jax.device_count() >= n:
        return step_collectives(config, sizes, batch, max_len, prefill_len, dtype, packed_kv, jax.devices()[:n])
    request = {"config": config.to_dict(), "mesh": sizes, "batch": batch, "max_len": max_len,
               "prefill_len": prefill_len, "dtype": np.dtype(dtype).name, "packed_kv": packed_kv}
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}").strip())
    proc = subprocess.run([sys.executable, "-m", "jdeep.tools.dev.collectives"], input=json.dumps(request), env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"measuring the collectives on {n} CPU devices failed:\n{proc.stderr[-4000:]}")
    return result_from_json(json.loads(proc.stdout))


# ------------------------------------------------------------------------------------------------- the table
def collectives_table(result: dict, link_gbps: float = DEFAULT_LINK_GBPS) -> str:
    """The lines `jdeep info --mesh ... --collectives` prints: per step and collective kind the runs, payload and link
    bytes per device and the link time, and a total per step (bytes in MiB, or KiB when every figure is below a
    tenth of a MiB; time in ms, or us below a tenth of a ms)."""
    steps = {}
    for step in ("decode", "prefill"):
        rows = [(k, result[step][k]) for k in KINDS if result[step][k].count]
        total = Volume()
        for _, v in rows:
            total.add(v)
        steps[step] = rows + [("total" if rows else "none", total)]
    most = max(max(v.payload, v.link) for rows in steps.values() for _, v in rows)
    unit, scale = ("MiB", 2**20) if most >= 2**20 / 10 else ("KiB", 2**10)
    ms = most / (link_gbps * 1e6)
    t_unit, t_scale = ("ms", link_gbps * 1e6) if ms >= 0.1 or most == 0 else ("us", link_gbps * 1e3)
    lines = [f"collectives     per device per step, read from the compiled programs ({result['compile_s']:.0f} s to "
             f"compile); time = link bytes / {link_gbps:g} GB/s",
             f"{'':<16}{'collective':<20}{'runs':>6}{'payload ' + unit:>13}{'link ' + unit:>11}{t_unit:>9}"]
    for step, what in (("decode", "decode step"), ("prefill", "prefill chunk")):
        label = what
        for k, v in steps[step]:
            lines.append(f"  {label:<14}{k:<20}{v.count:>6}{v.payload / scale:>13.3f}{v.link / scale:>11.3f}"
                         f"{v.link / t_scale:>9.3f}")
            label = ""
        if result[step].get("unknown_trips"):
            lines.append(f"  {'':<14}({result[step]['unknown_trips']} loop(s) without a known trip count counted "
                         "once)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Worker: a JSON request on stdin (config as ModelConfig.to_dict, mesh sizes, batch, max_len, prefill_len,
    dtype, packed_kv), the `step_collectives` result as JSON on stdout."""
    argparse.ArgumentParser(prog="python -m jdeep.tools.dev.collectives", description=main.__doc__).parse_args(argv)
    req = json.loads(sys.stdin.read())
    result = step_collectives(ModelConfig.from_dict(req["config"]), req["mesh"], req["batch"], req["max_len"],
                              req["prefill_len"], np.dtype(req["dtype"]), req["packed_kv"])
    print(json.dumps(result_to_json(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
