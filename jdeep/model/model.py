"""The loaded-model handle: config, layer plan, parameters and the compiled step of each compile mode.

`Model.step_fn(all_logits, rows)` is the one way to get a step, `step(params, state, tokens, positions,
engram=None) -> (logits, state)`, whichever compile mode (scan.py: one program; regions.py: a host loop over
per-kind programs) and placement (host-resident embedding, a device mesh) the model uses. Programs live in
the process-wide cache (cache.PROGRAMS), shared by every Model with the same architecture and numerics.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from ..arenas import is_packed
from .spec import ModelSpec
from ..config import ModelConfig
from ..numerics import Numerics
from ..plan import LayerPlan
from ..platforms import COMPILE_MODES
from ..state import empty_state, init_state, put_slot_window, slot_window
from .cache import PROGRAMS, ProgramCache
from .regions import regions_step
from .scan import model_step

__all__ = ["Model", "compiled_step", "compiled_rows_step", "DTYPES", "as_jax_dtype"]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def compiled_step(config: ModelConfig, plan: LayerPlan, numerics: Numerics, all_logits: bool, layout=None,
                  cache: ProgramCache = PROGRAMS) -> Callable:
    """One jitted scan-mode step per (architecture, numerics, logits mode, layout), state donated."""
    def make():
        def step(*args):     # -> (logits, state)
            return tuple(model_step(*args, config=config, plan=plan, numerics=numerics, all_logits=all_logits,
                                    layout=layout)[:2])

        return jax.jit(step, donate_argnums=(1,))

    return cache.get(("step", config, plan, numerics, all_logits, layout), make)


def compiled_rows_step(config: ModelConfig, plan: LayerPlan, numerics: Numerics, all_logits: bool, rows: int,
                       layout=None, cache: ProgramCache = PROGRAMS) -> Callable:
    """A step over a window of `rows` sequence slots of a larger state (a batch-size bucket): slots [start,
    start + rows) of every state leaf ([R, B, ...]) are sliced out, stepped and written back in place (state
    donated); the other slots are neither read nor changed. `start` (keyword, a traced int32 scalar, clamped) makes
    one program serve every window of this size; None means the first `rows` slots. Tokens, positions and logits
    have `rows` rows."""
    def make():
        fn = functools.partial(model_step, config=config, plan=plan, numerics=numerics, all_logits=all_logits,
                               layout=layout)

        def step(params, state, tokens, positions, engram=None, embeds=None, start=None):
            logits, sub = fn(params, slot_window(state, rows, start), tokens, positions, engram, embeds)[:2]
            state = put_slot_window(state, sub, start)
            return logits, (state if layout is None else layout.constrain_state(state))

        return jax.jit(step, donate_argnums=(1,))

    return cache.get(("rows_step", config, plan, numerics, all_logits, rows, layout), make)


class HostEmbedStep:
    """A step whose token embedding is gathered on the host: `step(params, state, tokens, positions,
    engram=None, embeds=None)` looks tokens up in `table` (numpy [V, d]) and passes the rows to the device step as
    `embeds` (unless given: a chunk with image rows, model/vision.py), so the device holds no embedding table.
    Tokens are fetched to the host (a sync per step)."""

    def __init__(self, step: Callable, table: np.ndarray):
        self.step, self.table = step, table

    def embeds(self, tokens) -> jax.Array:
        ids = np.clip(np.asarray(tokens), 0, self.table.shape[0] - 1)
        return jax.device_put(self.table[ids], jax.devices()[0])

    def __call__(self, params, state, tokens, positions, engram=None, embeds=None, start=None):
        embeds = self.embeds(tokens) if embeds is None else embeds
        window = () if start is None else (start,)
        return self.step(params, state, tokens, positions, engram, embeds, *window)


@dataclass
class Model:
    """A loaded model: config, layer plan, device params and the compiled step functions.

    compile_mode: "scan" (one program per step, layers under lax.scan) or "regions" (a host loop over
    layers calling per-kind programs, regions.py). host_embed: the token embedding table kept on the host
    (numpy [V, d]; params then hold no "embed"). sampler_device: a jax.Device the sampler runs on instead of
    the model's (on Neuron the host CPU: the plugin's threefry RNG is incomplete, graphcheck S18); logits go
    there and the sampled tokens come back through the host."""

    config: ModelConfig
    plan: LayerPlan
    params: dict
    dtype: Any
    numerics: Numerics = Numerics()
    engram: Any = None   # jdeep.io.engram_tables.EngramHost for models with Engram layers
    tokenizer: Any = None  # jdeep.io.tokenizer.Tokenizer when the checkpoint folder has a tokenizer.json
    compile_mode: str = "scan"
    host_embed: Any = None
    sampler_device: Any = None   # where sampling runs (None: with the model; on Neuron the CPU backend)
    layout: Any = None           # jdeep.sharding.Layout of a model sharded over a device mesh
    vision: Any = None           # jdeep.model.vision.VisionTower of a V4.1 checkpoint with a vision tower

    @functools.cached_property
    def spec(self) -> ModelSpec:
        """What this model's compiled programs depend on besides the weights (model/spec.py): their cache key (built
        once: programs are looked up by it on every step; a changed model is a new Model, dataclasses.replace)."""
        return ModelSpec.of(self)

    def __post_init__(self):
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode must be one of {', '.join(COMPILE_MODES)}, got {self.compile_mode!r}")
        if self.compile_mode == "regions" and is_packed(self.params):
            raise ValueError("packed parameters (pack_params) run only in the scan compile mode")
        if self.layout is not None and (self.host_embed is not None or self.sampler_device is not None):
            raise ValueError("a model on a device mesh keeps the embedding and the sampler on the mesh (host "
                             "embedding and a host sampler are single-device)")

    @property
    def host_loop(self) -> bool:
        """Whether decode steps must be driven from the host (regions mode or host-resident embedding)."""
        return self.compile_mode == "regions" or self.host_embed is not None or self.sampler_device is not None

    def to_sampler(self, tree: Any) -> Any:
        """Arrays moved to the sampler's device (the model's device when sampling runs with the model; replicated
        over the mesh for a sharded model). Always committed device arrays, like the outputs of the programs they
        are fed to next to: a host array there would compile each program a second time."""
        if self.layout is not None:
            return self.layout.put_tree(tree)
        return jax.device_put(tree, self.sampler_device or jax.devices()[0])

    def commit(self, tree: Any) -> Any:
        """Host batch-first arrays ([B, ...]) for a loop carry (inputs that later calls take from program outputs):
        committed device arrays on the model's device (sharded by sequence slot over the mesh, where the programs
        constrain their carry outputs so), like the outputs that replace them, so the first call and the later ones
        run one compiled program (an uncommitted array would compile it a second time)."""
        if self.layout is not None:
            return self.layout.put_batch(tree)
        return jax.device_put(tree, jax.devices()[0])

    def put(self, x: Any) -> jax.Array:
        """A host array (or a tree of them) as a step input: committed to the model's device (as the programs' other inputs are, so a
        program compiled ahead of time for them is the one a call finds: runtime/lowering.placed), or replicated
        over the mesh (every process of a multi-process run passes the same value)."""
        return jax.device_put(x, jax.devices()[0]) if self.layout is None else self.layout.put_tree(x)

    def fetch(self, x: jax.Array) -> np.ndarray:
        """A device array on the host, also when it spans the devices of several processes."""
        if getattr(x, "is_fully_addressable", True):
            return np.asarray(x)
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    def step_fn(self, all_logits: bool, rows: int | None = None) -> Callable:
        """`step(params, state, tokens, positions, engram=None) -> (logits, state)`, state donated. With `rows`,
        the step runs only a window of `rows` sequence slots: the first ones, or from the keyword `start` (an int32
        scalar; one program for every start). In the scan mode without host embedding
        this is a jax.jit (it has .lower); otherwise a host-side callable."""
        if self.compile_mode == "regions":
            fn = regions_step(self.config, self.plan, self.numerics, all_logits, rows, self.layout)
        elif rows is None:
            fn = compiled_step(self.config, self.plan, self.numerics, all_logits, self.layout)
        else:
            fn = compiled_rows_step(self.config, self.plan, self.numerics, all_logits, rows, self.layout)
        return fn if self.host_embed is None else HostEmbedStep(fn, self.host_embed)

    def new_history(self, batch: int) -> Any:
        """Host-side per-sequence Engram histories (None for models without Engram)."""
        return None if self.engram is None else self.engram.history(batch)

    def engram_inputs(self, history: Any, tokens: np.ndarray, positions: np.ndarray) -> tuple | None:
        """The `engram` argument of a step over tokens / positions int [B, S] (positions -1 = padding after
        the real tokens): the table rows gathered on the host; advances `history`. None without Engram.
        Image tokens (config.image_token_id) are dead for Engram: they block the n-gram look-back."""
        if self.engram is None:
            return None
        tokens = np.asarray(tokens)
        dead = None if self.config.image_token_id is None else tokens == self.config.image_token_id
        codes, scales = self.engram.rows(history, tokens, np.sum(np.asarray(positions) >= 0, axis=1), dead)
        return self.put(codes), self.put(scales)

    def init_state(self, batch: int, max_len: int) -> list:
        """Empty decode state for `batch` sequences of up to `max_len` tokens (see state.py); on a mesh, created
        sharded over `data` by sequence slot."""
        if self.layout is None:
            return init_state(self.config, self.plan, batch, max_len, self.dtype, self.numerics)
        return _sharded_init_state(self.config, self.plan, batch, max_len, self.dtype, self.numerics, self.layout)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size


def _sharded_init_state(config, plan, batch, max_len, dtype, numerics, layout) -> dict:
    """The empty state created directly in its shards (no full copy on one device)."""
    def make_program():
        def make():
            return empty_state(config, plan, batch, max_len, dtype, numerics)

        return jax.jit(make, out_shardings=layout.state_shardings(jax.eval_shape(make)))

    return PROGRAMS.get(("init_state", config, plan, batch, max_len, dtype, numerics, layout), make_program)()


def as_jax_dtype(dtype: Any) -> Any:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    return jnp.dtype(dtype).type
