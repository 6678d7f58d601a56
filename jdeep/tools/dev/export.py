"""`jdeep export`: the StableHLO of every program jdeep compiles, for compiling elsewhere (neuronx-cc on a
Neuron host) or for inspection.

For each program (graphs.model_programs) the output folder gets

    <name>.mlir            StableHLO text
    <name>.mlirbc          StableHLO MLIR bytecode (what a PJRT plugin compiles)
    <name>.jax_exported    jax.export's serialisation (reload with jax.export.deserialize and .call it)

and manifest.json (schema "jdeep.export/2"):

    {"schema", "jax_version", "model": {"config", "dtype", "compile_mode", "host_embedding", "numerics"},
     "programs": [{"name", "files": {...}, "bucket": {"batch", "seq", "step", "max_len"},
                   "inputs": [{"path", "shape", "dtype", "donated"}], "outputs": [{"path", "shape", "dtype"}],
                   "aliases": {input index: output index}, "platforms", "kernels": [index into "kernels"]}],
     "kernels": [{"func_name", "file", "traced_path", "grid", "platform_target", "input_names", "output_names",
                  "sha256"}]}

Programs traced on Neuron call NKI kernels (custom calls that name each compiled kernel by its absolute path on the
tracing host, tools/dev/kernel_artifacts.py): each kernel's file is copied into the folder at `file`
(<hash folder>/<name>), where neuronx-cc launched from the export folder finds it on any host.

Programs take and return flat lists of arrays: argument i is `inputs[i]`, whose path is its place in the
step's argument tree (e.g. "[1]['segments'][0][0]['window']"; argument tree 0 is the parameters, 1 the
decode state, donated and aliased to its outputs). `call_exported` rebuilds the trees.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Sequence

import jax
import numpy as np

from .kernel_artifacts import NKI_TARGET, copy_artifacts, kernel_refs
from .programs import Program

__all__ = ["export_programs", "load_exported", "call_exported", "SCHEMA"]

SCHEMA = "jdeep.export/2"
_READABLE = ("jdeep.export/1", SCHEMA)        # /1: the same without kernels


def _leaves(tree) -> list[dict]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [{"path": jax.tree_util.keystr(p), "shape": list(x.shape), "dtype": np.dtype(x.dtype).name}
            for p, x in flat]


def _aliases(text: str) -> dict[int, int]:
    """{argument index: output index} from the `tf.aliasing_output` attributes of @main's arguments."""
    main = text[text.index("func.func public @main"):].split("\n", 1)[0]
    out = {}
    for i, arg in enumerate(re.split(r"%arg\d+: ", main)[1:]):
        m = re.search(r"tf\.aliasing_output = (\d+)", arg)
        if m:
            out[i] = int(m.group(1))
    return out


def export_programs(programs: Sequence[Program], out_dir: str, model_info: dict) -> dict:
    """Write every program and the manifest into out_dir; returns the manifest."""
    os.makedirs(out_dir, exist_ok=True)
    entries = []
    kernels: dict[str, int] = {}               # traced path -> index in the manifest's kernels
    refs = []
    for p in programs:
        # exported with a flat calling convention: argument i is manifest input i, output j manifest output j
        leaves, treedef = jax.tree_util.tree_flatten(p.args)
        donated = [a.donated for a in jax.tree_util.tree_leaves(p.lower().args_info)]

        def flat(*xs, fn=p.fn, treedef=treedef):
            return jax.tree_util.tree_leaves(fn(*jax.tree_util.tree_unflatten(treedef, xs)))

        jitted = jax.jit(flat, donate_argnums=tuple(i for i, d in enumerate(donated) if d))
        # NKI kernels are custom calls jax.export cannot vouch for; their compiled files travel with the export
        exp = jax.export.export(jitted, disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(NKI_TARGET)])(
            *leaves)
        text = jitted.lower(*leaves).as_text()
        program_kernels = []
        for ref in kernel_refs(text, p.name):
            if ref.binary not in kernels:
                kernels[ref.binary] = len(refs)
                refs.append(ref)
            program_kernels.append(kernels[ref.binary])
        files = {"mlir": f"{p.name}.mlir", "mlirbc": f"{p.name}.mlirbc", "jax_exported": f"{p.name}.jax_exported"}
        with open(os.path.join(out_dir, files["mlir"]), "w") as f:
            f.write(text)
        with open(os.path.join(out_dir, files["mlirbc"]), "wb") as f:
            f.write(exp.mlir_module_serialized)
        with open(os.path.join(out_dir, files["jax_exported"]), "wb") as f:
            f.write(exp.serialize())
        inputs = _leaves(p.args)
        for entry, d in zip(inputs, donated):
            entry["donated"] = bool(d)
        entries.append({"name": p.name, "files": files, "bucket": p.bucket, "inputs": inputs,
                        "outputs": _leaves(jax.eval_shape(p.fn, *p.args)), "aliases": _aliases(text),
                        "input_tree": str(treedef),
                        "platforms": list(exp.platforms), "kernels": program_kernels})
    manifest = {"schema": SCHEMA, "jax_version": jax.__version__, "model": model_info, "programs": entries,
                "kernels": copy_artifacts(refs, out_dir)}
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def model_info(target) -> dict:
    """The manifest's "model" section for a graphs.Target."""
    return {"config": target.config.to_dict(), "dtype": np.dtype(target.dtype).name,
            "compile_mode": target.compile_mode, "host_embedding": target.host_embedding,
            "numerics": {k: (list(v) if isinstance(v, tuple) else v)
                         for k, v in dataclasses.asdict(target.numerics).items()}}


def load_exported(out_dir: str) -> tuple[dict, dict]:
    """(manifest, {program name: jax.export.Exported}) of an export folder."""
    with open(os.path.join(out_dir, "manifest.json")) as f:
        manifest = json.load(f)
    if manifest.get("schema") not in _READABLE:
        raise ValueError(f"{out_dir}: not a jdeep export (schema {manifest.get('schema')!r}, expected {SCHEMA})")
    programs = {}
    for entry in manifest["programs"]:
        with open(os.path.join(out_dir, entry["files"]["jax_exported"]), "rb") as f:
            programs[entry["name"]] = jax.export.deserialize(bytearray(f.read()))
    return manifest, programs


def call_exported(exported, fn, *args):
    """Run an exported program on the argument trees of its live twin `fn` (whose output tree it rebuilds)."""
    out_tree = jax.tree_util.tree_structure(jax.eval_shape(fn, *args))
    return jax.tree_util.tree_unflatten(out_tree, exported.call(*jax.tree_util.tree_leaves(args)))
