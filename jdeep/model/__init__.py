"""The model: the forward step in its two compile modes (scan.py, regions.py), the loaded-model handle (model.py),
the compiled-program cache (cache.py), loading a checkpoint folder into a Model (load.py) and DeepSeek-V4's MTP
blocks (mtp.py)."""

from .model import Model
from .mtp import mtp_step
from .scan import model_step

__all__ = ["Model", "model_step", "mtp_step"]
