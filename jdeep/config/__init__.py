"""Model configuration in one place: the typed, validated config (model.py: ModelConfig; parts.py: its parts, each
checked on construction), config.json's spellings read and written (formats.py), the released architectures by name
(presets.py) and the small random-weight models (small_models.py). Nothing registers itself on import."""

from __future__ import annotations

from .model import (AttentionKind, ConfigError, DSparkConfig, EngramConfig, ModelConfig, QuantizationConfig,
                    RopeConfig, SharingConfig, VisionConfig, YarnConfig)
from .presets import PRESET_NAMES, PRESETS, preset

__all__ = ["ModelConfig", "ConfigError", "AttentionKind", "RopeConfig", "YarnConfig", "SharingConfig", "EngramConfig",
           "DSparkConfig", "VisionConfig", "QuantizationConfig", "PRESETS", "PRESET_NAMES", "preset"]
