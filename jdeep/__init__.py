"""jdeep: a JAX inference engine for the DeepSeek-V4 family (CPU, GPU and AWS Trainium via PJRT)."""

from __future__ import annotations

from .config import ConfigError, ModelConfig
from .io.checkpoint import CheckpointError
from .model.load import load
from .model.model import Model
from .runtime.engine import Engine
from .runtime.generate import GenerateOutput, forward, generate
from .runtime.sampling import SamplingParams

__all__ = ["load", "generate", "forward", "Model", "ModelConfig", "GenerateOutput", "SamplingParams", "ConfigError",
           "CheckpointError", "Engine"]
__version__ = "0.1.0"
