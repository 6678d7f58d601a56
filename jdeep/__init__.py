"""jdeep: a JAX inference engine for the DeepSeek-V4 family (CPU, GPU and AWS Trainium via PJRT)."""

from __future__ import annotations

import os
from typing import Any

from .checkpoint import CheckpointError
from .config import ConfigError, ModelConfig
from .generate import GenerateOutput, forward, generate
from .model import Model

__all__ = ["load", "generate", "forward", "Model", "ModelConfig", "GenerateOutput", "ConfigError", "CheckpointError"]
__version__ = "0.1.0"


def load(path: str | os.PathLike, dtype: str = "float32") -> Model:
    """Load a DeepSeek-V4 checkpoint folder (HF layout: config.json + safetensors) or a folder written
    by `jdeep convert` (Orbax). dtype: "float32" or "bfloat16" (activations and float weights)."""
    import jax
    import numpy as np

    from . import checkpoint
    from .model import as_jax_dtype
    from .plan import build_plan

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint folder at {path}")
    jdtype = as_jax_dtype(dtype)
    config = ModelConfig.from_file(path)
    plan = build_plan(config)
    if checkpoint.is_converted(path):
        params = checkpoint.restore_converted(path, config, plan, jdtype)
    else:
        params = checkpoint.load_params(path, config, plan, np.dtype(jdtype))
    # One placement for both sources, so both hit the same compiled programs.
    params = jax.device_put(params, jax.devices()[0])
    return Model(config, plan, params, jdtype)
