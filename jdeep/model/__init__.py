"""The model: the forward step (scan and regions compile modes), the loaded-model handle and loading."""

from .model import Model, model_step

__all__ = ["Model", "model_step"]
