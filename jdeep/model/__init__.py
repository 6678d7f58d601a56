"""The model: the forward step in its two compile modes (scan.py, regions.py), the loaded-model handle (model.py),
the compiled-program cache (cache.py) and loading a checkpoint folder into a Model (load.py)."""

from .model import Model
from .scan import model_step

__all__ = ["Model", "model_step"]
