"""DeepSeek-V4's MTP block as a drafter (model-spec.md §4.7): what it needs of a model, its window state, and the
programs that run blocks of iterations (mtp_iteration.py) over a whole batch for jdeep.generate's speculative path
(generate.py, through mtp_drafter.MtpDrafter.block).

The compiled programs per compile mode: in the scan mode a block of n iterations is one program (a scan); in the
regions mode (RegionsPrograms) an iteration is three calls: the draft program, the regions step over the k + 1
verified positions, the finish program. Both give the same tokens and states.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from ..model.cache import PROGRAMS
from ..model.model import Model
from ..model.mtp import empty_mtp_state, init_mtp_state
from ..model.regions import regions_step
from ..model.spec import ModelSpec
from .mtp_iteration import draft, finish, iterations, mtp_params

__all__ = ["check_mtp_model", "check_mtp_spec", "new_mtp_state", "ScanPrograms", "RegionsPrograms", "programs"]


def check_mtp_model(model: Model) -> None:
    """Clear errors for what the MTP drafter needs and this version does not run."""
    check_mtp_spec(model.spec)


def check_mtp_spec(spec: ModelSpec) -> None:
    """check_mtp_model for a model's spec (a loaded model's, or one built from a config for lowering)."""
    if spec.config.engram is not None or spec.config.dspark is not None or spec.config.sharing is not None:
        raise ValueError("speculative method 'mtp' is for DeepSeek-V4 checkpoints; DeepSeek-V4.1 drafts with its "
                         "DSpark drafter: speculative={'method': 'dspark', 'num_speculative_tokens': k}")
    if spec.plan.mtp is None:
        raise ValueError("speculative decoding with method 'mtp' needs the checkpoint's MTP block loaded: "
                         "jdeep.load(path, drafter=True) (a checkpoint without mtp.* weights has none)")
    if spec.host_embedding:
        raise ValueError("MTP speculative decoding needs the embedding on the device (the MTP block embeds the "
                         "drafts): load without host_embedding")


def new_mtp_state(model: Model, batch: int, max_len: int) -> dict:
    """The MTP blocks' empty window state for `batch` sequences, on the device or, on a mesh, sharded by sequence
    slot like the backbone's state."""
    if model.layout is None:
        return init_mtp_state(model.config, model.plan, batch, max_len, model.dtype, model.numerics)
    empty = empty_mtp_state(model.config, model.plan, batch, max_len, model.dtype, model.numerics)
    return jax.device_put(empty, model.layout.state_shardings(empty))


class ScanPrograms:
    """The scan compile mode's blocks: iterations(n)(params, state, mstate, carry, sb, stops, max_new) -> (state,
    mstate, carry, emitted (acceptance.Emitted [n, B, k+1]), accepted [n, B]) as one program per n."""

    def __init__(self, model: Model, k: int, greedy: bool, keep_logits: bool = False):
        self.k, self.spec, self.options = k, model.spec, dict(greedy=greedy, keep_logits=keep_logits)
        self.kw = dict(config=model.config, plan=model.plan, numerics=model.numerics, layout=model.layout,
                       **self.options)

    def iterations(self, n: int) -> Callable:
        return PROGRAMS.keyed("mtp_iterations", self.spec, lambda: jax.jit(
            functools.partial(iterations, n=n, k=self.k, **self.kw), donate_argnums=(1, 2, 3)),
            k=self.k, n=n, **self.options)


class RegionsPrograms:
    """The regions compile mode's blocks, called as ScanPrograms' are: an iteration is the draft program, the regions
    step over the k + 1 verified positions (all logits and the final streams) and the finish program, n of them
    dispatched one after another without a host read. The MTP programs take only the parameters the MTP block reads
    (mtp_iteration.mtp_params)."""

    def __init__(self, model: Model, k: int, greedy: bool, keep_logits: bool = False):
        c, plan, nu = model.config, model.plan, model.numerics
        kw = dict(config=c, plan=plan, numerics=nu, greedy=greedy)
        self.verify = regions_step(c, plan, nu, True, layout=model.layout, hidden=True)
        self.draft = PROGRAMS.keyed("mtp_draft", model.spec, lambda: jax.jit(
            functools.partial(draft, k=k, **kw), donate_argnums=(2,)), k=k, greedy=greedy)
        self.finish = PROGRAMS.keyed("mtp_finish", model.spec, lambda: jax.jit(
            functools.partial(finish, k=k, keep_logits=keep_logits, **kw), donate_argnums=(1, 2)),
            k=k, greedy=greedy, keep_logits=keep_logits)

    def iteration(self, params, state, mstate, carry, sb, stops, max_new):
        mstate, dr = self.draft(mtp_params(params), state, mstate, carry, sb)
        (logits, XB), state = self.verify(params, state, dr.tokens, dr.pos)
        return self.finish(mtp_params(params), state, mstate, carry, dr, logits, XB, sb, stops, max_new)

    def iterations(self, n: int) -> Callable:
        def run(params, state, mstate, carry, sb, stops, max_new):
            emitted, accepted = [], []
            for _ in range(n):
                state, mstate, carry, e, a = self.iteration(params, state, mstate, carry, sb, stops, max_new)
                emitted.append(e)
                accepted.append(a)
            return state, mstate, carry, jax.tree_util.tree_map(lambda *e: jnp.stack(e), *emitted), jnp.stack(accepted)
        return run


def programs(model: Model, k: int, greedy: bool, keep_logits: bool = False) -> ScanPrograms | RegionsPrograms:
    """The block programs of the model's compile mode (the one place that chooses); keep_logits: their Emitted
    records carry the target's logits."""
    return (RegionsPrograms if model.compile_mode == "regions" else ScanPrograms)(model, k, greedy, keep_logits)
