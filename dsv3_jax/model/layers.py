"""Small building blocks shared by attention, MoE and the decoder: RMSNorm, Linear, SwiGLU MLP.

Owns: weight layout of every linear ([out, in], the HF layout, so FP8 128x128 block scales line up
with the checkpoint and FP8 wgmma gets K-major B), and the FP8 weight path through the kernel dispatch
(its backend from the module's `trace_options`, never from module state).
Must not know about layers, caches or meshes.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from dsv3_jax.model import kernel_dispatch as kernels
from dsv3_jax.model.trace_options import TraceOptions

Dtype = jnp.dtype


def _init(scale: float = 0.02):
    return nn.initializers.normal(stddev=scale)


def linear(x: jax.Array, weight: jax.Array, scale: jax.Array | None = None, *, backend: str) -> jax.Array:
    """y = x @ W^T, W [out, in] (FP8 with its 128x128 block `scale`, or any float dtype): the math of
    `Linear`, also for callers holding the arrays themselves (moe.py's shared expert inside shard_map)."""
    if scale is not None:
        return kernels.fp8_linear(x, weight, scale, backend=backend)
    return jnp.einsum("...i,oi->...o", x, weight.astype(x.dtype))


def swiglu(x: jax.Array, params: dict, *, backend: str) -> jax.Array:
    """down(silu(gate(x)) * up(x)) from an MLP's parameter dict ({gate,up,down}_proj: {weight[, scale]})."""
    def lin(h, name):
        p = params[name]
        return linear(h, p["weight"], p.get("scale"), backend=backend)

    return lin(jax.nn.silu(lin(x, "gate_proj")) * lin(x, "up_proj"), "down_proj")


class RMSNorm(nn.Module):
    dim: int
    eps: float = 1e-6
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.param("weight", nn.initializers.ones, (self.dim,), self.param_dtype)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return w * xf.astype(x.dtype)


class Linear(nn.Module):
    """y = x @ W^T with W [out, in]. With `fp8=True` W is float8_e4m3fn plus `scale` [out/128, in/128]."""

    in_dim: int
    out_dim: int
    param_dtype: Dtype = jnp.float32
    fp8: bool = False
    trace_options: TraceOptions = dataclasses.field(default_factory=TraceOptions.from_environment)

    def setup(self) -> None:
        if self.fp8:
            self.weight = self.param("weight", nn.initializers.zeros, (self.out_dim, self.in_dim),
                                     jnp.float8_e4m3fn)
            self.scale = self.param("scale", nn.initializers.ones,
                                    (-(-self.out_dim // 128), -(-self.in_dim // 128)), jnp.float32)
        else:
            self.weight = self.param("weight", _init(), (self.out_dim, self.in_dim), self.param_dtype)

    def matrix(self, dtype) -> jax.Array:
        """W [out, in] in `dtype`, dequantized when FP8 (for weights reshaped by the caller, e.g. kv_b)."""
        if self.fp8:
            return kernels.dequantize_weight(self.weight, self.scale, dtype)
        return self.weight.astype(dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return linear(x, self.weight, self.scale if self.fp8 else None, backend=self.trace_options.kernels)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); the dense layers and the shared expert."""

    dim: int
    hidden: int
    param_dtype: Dtype = jnp.float32
    fp8: bool = False
    trace_options: TraceOptions = dataclasses.field(default_factory=TraceOptions.from_environment)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(param_dtype=self.param_dtype, fp8=self.fp8, trace_options=self.trace_options)
        g = Linear(self.dim, self.hidden, name="gate_proj", **kw)(x)
        u = Linear(self.dim, self.hidden, name="up_proj", **kw)(x)
        return Linear(self.hidden, self.dim, name="down_proj", **kw)(jax.nn.silu(g) * u)
