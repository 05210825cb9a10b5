"""dsv3-jax: DeepSeek-V3 / V3.1-Terminus inference in JAX with Pallas Mosaic GPU kernels."""

from dsv3_jax.api import ModelHandle, load
from dsv3_jax.config import ConfigError, ModelConfig

__all__ = ["ConfigError", "ModelConfig", "ModelHandle", "load"]
__version__ = "0.1.0"
