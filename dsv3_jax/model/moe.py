"""Mixture of experts: the `noaux_tc` grouped sigmoid router and the routed + shared SwiGLU experts.

Owns: expert selection and weights (`route`), token permutation by expert, the grouped matmuls
(through `kernels.grouped_matmul`: the FP8 or BF16 Pallas kernel when `trace_options.kernels` is
"pallas", their references otherwise) and the weighted un-permutation. Only the chosen experts' work
is computed. Expert weights are stacked [E, ...] in the HF [out, in] layout.

Expert parallelism (`expert_parallel`): under `jax.set_mesh(mesh)` with a mesh from sharding.py, the
routed experts run inside `shard_map` with explicit collectives; without a mesh (or a 1-device mesh) the
single-device path (`routed_experts` on all tokens) runs unchanged. How the MoE learns the mesh: it
reads `jax.sharding.get_abstract_mesh()` at trace time, i.e. the mesh the *caller* set with
`jax.set_mesh` around tracing (ModelHandle does this). Which array lives where comes from sharding.py's
tables; this module owns only the collectives. The dispatch mode and its thresholds come from the
module's `trace_options` (trace_options.py), never from module state.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dsv3_jax.config import ModelConfig
from dsv3_jax.model import kernel_dispatch as kernels
from dsv3_jax.model import layout
from dsv3_jax.model.layers import MLP
from dsv3_jax.model.trace_options import TraceOptions
from dsv3_jax.parallel import sharding


def route(logits: jax.Array, bias: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """noaux_tc routing: logits [N, E] (fp32) -> (weights [N, k] fp32, expert ids [N, k] int32).

    The correction bias steers *selection only*; weights are the unbiased sigmoid scores of the chosen
    experts, normalized to sum 1 (norm_topk_prob) and multiplied by routed_scaling_factor.
    """
    n, e = logits.shape
    g, k = cfg.n_group, cfg.num_experts_per_tok
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    biased = scores + bias.astype(jnp.float32)
    group_score = jax.lax.top_k(biased.reshape(n, g, e // g), 2)[0].sum(-1)  # [N, G]
    _, top_groups = jax.lax.top_k(group_score, cfg.topk_group)
    group_keep = jnp.zeros((n, g), bool).at[jnp.arange(n)[:, None], top_groups].set(True)
    expert_keep = jnp.repeat(group_keep, e // g, axis=1)
    _, idx = jax.lax.top_k(jnp.where(expert_keep, biased, -jnp.inf), k)
    w = jnp.take_along_axis(scores, idx, axis=1)
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return w * cfg.routed_scaling_factor, idx.astype(jnp.int32)


def routed_experts(x: jax.Array, weights: jax.Array, idx: jax.Array, experts: dict,
                   num_experts: int, *, backend: str) -> jax.Array:
    """sum_k w_k * expert_k(x) for x [N, D] via sort-by-expert + grouped matmuls.

    `experts` holds {gate_proj, up_proj, down_proj}: {"weight": [E, out, in], optionally "scale"}.
    `idx` may hold ids outside [0, num_experts) (experts another device owns, or -1 for padding tokens):
    those rows are skipped. `backend`: the grouped matmuls' kernel backend ("pallas" or "reference").
    """
    n, k = idx.shape
    flat = idx.reshape(-1)
    local = (flat >= 0) & (flat < num_experts)
    # Foreign experts sort last and fall outside every group, so they cost nothing and add zero.
    order = jnp.argsort(jnp.where(local, flat, num_experts), stable=True)
    token = order // k
    group_sizes = jnp.bincount(jnp.where(local, flat, num_experts), length=num_experts + 1)[:num_experts]
    xs = x[token]

    def mm(h, name):
        p = experts[name]
        return kernels.grouped_matmul(h, p["weight"], group_sizes, p.get("scale"), backend=backend)

    h = jax.nn.silu(mm(xs, "gate_proj")) * mm(xs, "up_proj")
    y = mm(h, "down_proj")
    wsorted = jnp.where(local[order], weights.reshape(-1)[order], 0.0)
    y = (y.astype(jnp.float32) * wsorted[:, None]).astype(x.dtype)
    return jnp.zeros_like(x).at[token].add(y)


# ------------------------------------------------------------------------------- expert parallelism
# Which dispatch runs when (decided at trace time from static shapes and the TraceOptions: its
# `moe_dispatch` "auto" follows this table, "all_gather" / "all_to_all" force one path):
# - "all_gather" when an expert group holds at most `all_gather_max_tokens` tokens (decode): every device
#   gathers the group's tokens, runs its own experts on the (token, choice) pairs that chose them, and a
#   reduce-scatter returns each token's partial sums to its owner. No capacity, nothing to drop; bytes
#   on the wire ~ ep x tokens x D each way, which for DeepSeek (k = 8 = ep) equals the all-to-all's.
# - "all_to_all" above that (prefill): each (token, choice) pair is sent only to the device owning its
#   expert, in a capacity-bounded buffer of C rows per (source, destination) pair, C = `capacity_factor` x
#   the balanced load; results come back by a second all-to-all. If any pair of devices would exceed C
#   (checked on every call, collectively), the whole layer falls back to the all-gather path for that
#   call, so no token is ever dropped. If C reaches the worst case, the check is skipped.
def choose_dispatch(group_tokens: int, options: TraceOptions) -> str:
    """The dispatch for an expert group of `group_tokens` tokens (see the table above)."""
    if options.moe_dispatch != "auto":
        return options.moe_dispatch
    return "all_gather" if group_tokens <= options.all_gather_max_tokens else "all_to_all"


def a2a_capacity(n_local: int, k: int, ep: int, experts_per_shard: int,
                 capacity_factor: float) -> tuple[int, int]:
    """(capacity C per source->destination pair, worst case) for the all-to-all dispatch."""
    worst = n_local * min(k, experts_per_shard)
    balanced = -(-n_local * k // ep)
    cap = -(-math.ceil(capacity_factor * balanced) // 8) * 8
    return min(cap, worst), worst


def _ep_all_gather(x, w, idx, experts, e_loc: int, backend: str) -> jax.Array:
    """All-gather the group's tokens, run local experts, reduce-scatter the partial outputs."""
    shard = jax.lax.axis_index("expert")
    xg = jax.lax.all_gather(x, "expert", tiled=True)
    wg = jax.lax.all_gather(w, "expert", tiled=True)
    ig = jax.lax.all_gather(idx, "expert", tiled=True) - shard * e_loc  # foreign ids fall outside
    y = routed_experts(xg, wg, ig, experts, e_loc, backend=backend)
    return jax.lax.psum_scatter(y, "expert", scatter_dimension=0, tiled=True)


def _ep_all_to_all(x, w, idx, experts, e_loc: int, ep: int, cap: int, backend: str) -> jax.Array:
    """Send each (token, choice) to its expert's device (C slots per destination), compute, send back."""
    n, k = idx.shape
    d = x.shape[-1]
    flat = idx.reshape(-1)
    dest = jnp.where(flat >= 0, flat // e_loc, ep)  # padding tokens (-1) sort last and are never sent
    order = jnp.argsort(dest, stable=True)
    counts = jnp.bincount(dest, length=ep + 1)
    starts = jnp.cumsum(counts) - counts
    sdest = dest[order]
    rank = jnp.arange(n * k) - starts[sdest]
    valid = (rank < cap) & (sdest < ep)
    slot = jnp.where(valid, sdest * cap + rank, ep * cap)  # ep*cap: out of bounds, dropped by .set
    send_x = jnp.zeros((ep * cap, d), x.dtype).at[slot].set(x[order // k], mode="drop")
    send_e = jnp.full((ep * cap,), -1, jnp.int32).at[slot].set(flat[order] - sdest * e_loc, mode="drop")
    recv_x = jax.lax.all_to_all(send_x, "expert", 0, 0, tiled=True)
    recv_e = jax.lax.all_to_all(send_e, "expert", 0, 0, tiled=True)
    # Padding slots carry id -1: routed_experts skips them.
    y = routed_experts(recv_x, jnp.ones((ep * cap, 1), jnp.float32), recv_e[:, None], experts, e_loc,
                       backend=backend)
    back = jax.lax.all_to_all(y, "expert", 0, 0, tiled=True)
    yp = back[jnp.minimum(slot, ep * cap - 1)].astype(jnp.float32)
    wp = jnp.where(valid, w.reshape(-1)[order], 0.0)
    return jnp.zeros((n, d), jnp.float32).at[order // k].add(yp * wp[:, None]).astype(x.dtype)


def expert_parallel(x: jax.Array, weights: jax.Array, idx: jax.Array, experts: dict, num_experts: int,
                    mesh, options: TraceOptions) -> jax.Array:
    """routed_experts on a mesh: tokens [N, D] batch-sharded over (data, expert), experts over `expert`,
    their FFN width over `tensor` (partial sums psum'ed over tensor). Same numbers as one device.
    `options` gives the dispatch mode, its thresholds and the kernel backend.
    """
    sizes = sharding.axis_sizes(mesh)
    ep = sizes["expert"]
    e_loc = num_experts // ep
    tok = sharding.logical_to_spec(sharding.ACTIVATION_AXES["moe_tokens"])
    row = P(tok[0], None)
    batch_axes = (tok[0],) if isinstance(tok[0], str) else tuple(tok[0])
    w_specs = {name: sharding.logical_to_spec(layout.PARAM_AXES[f"mlp/{name}_weight"])
               for name in ("gate_proj", "up_proj", "down_proj")}
    exp_specs = {name: {key: w_specs[name] for key in p} for name, p in experts.items()}
    n_local = x.shape[0] // sharding.batch_multiple(mesh)
    mode = choose_dispatch(n_local * ep, options)
    cap, worst = a2a_capacity(n_local, idx.shape[1], ep, e_loc, options.capacity_factor)
    backend = options.kernels

    def body(x, w, idx, experts):
        if ep == 1:
            y = routed_experts(x, w, idx, experts, num_experts, backend=backend)
        elif mode == "all_gather":
            y = _ep_all_gather(x, w, idx, experts, e_loc, backend)
        elif cap >= worst:
            y = _ep_all_to_all(x, w, idx, experts, e_loc, ep, cap, backend)
        else:
            # Overflow anywhere -> every device falls back together (the predicate is global).
            flat = idx.reshape(-1)
            load = jnp.bincount(jnp.where(flat >= 0, flat // e_loc, ep), length=ep + 1)[:ep].max()
            overflow = jax.lax.pmax(load, batch_axes) > cap  # tokens are tensor-invariant
            y = jax.lax.cond(overflow,
                             lambda *a: _ep_all_gather(*a, e_loc, backend),
                             lambda *a: _ep_all_to_all(*a, e_loc, ep, cap, backend),
                             x, w, idx, experts)
        # Each device computed its FFN slice's partial sum (a no-op reduction when tensor=1).
        return jax.lax.psum(y, "tensor")

    fn = jax.shard_map(body, mesh=mesh, in_specs=(tok, row, row, exp_specs), out_specs=tok)
    return fn(x, weights, idx, experts)


class MoE(nn.Module):
    cfg: ModelConfig
    param_dtype: jnp.dtype = jnp.float32
    fp8: bool = False
    trace_options: TraceOptions = dataclasses.field(default_factory=TraceOptions.from_environment)

    @nn.compact
    def __call__(self, x: jax.Array, valid: jax.Array | None = None) -> jax.Array:
        """x [..., D]; `valid` [...] bool marks real tokens: padding tokens are routed nowhere (left
        out of the token sort and every expert's load) and get only the shared expert's output."""
        c = self.cfg
        e, d, i = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
        init = nn.initializers.normal(0.02)
        gate_w = self.param("gate_weight", init, (e, d), self.param_dtype)
        bias = self.param("e_score_correction_bias", nn.initializers.zeros, (e,), jnp.float32)

        def expert_param(name, out_dim, in_dim):
            if self.fp8:
                return {"weight": self.param(f"{name}_weight", nn.initializers.zeros, (e, out_dim, in_dim),
                                             jnp.float8_e4m3fn),
                        "scale": self.param(f"{name}_scale", nn.initializers.ones,
                                            (e, -(-out_dim // 128), -(-in_dim // 128)), jnp.float32)}
            return {"weight": self.param(f"{name}_weight", init, (e, out_dim, in_dim), self.param_dtype)}

        experts = {"gate_proj": expert_param("gate_proj", i, d), "up_proj": expert_param("up_proj", i, d),
                   "down_proj": expert_param("down_proj", d, i)}
        shape = x.shape
        xf = x.reshape(-1, d)
        logits = jnp.einsum("nd,ed->ne", xf.astype(jnp.float32), gate_w.astype(jnp.float32))
        w, idx = route(logits, bias, c)
        self.sow("intermediates", "router_choice", idx.reshape(*shape[:-1], -1))
        if valid is not None:
            idx = jnp.where(valid.reshape(-1, 1), idx, -1)
        self.sow("intermediates", "expert_load", jnp.bincount(jnp.where(idx >= 0, idx, e).reshape(-1),
                                                              length=e + 1)[:e])
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or math.prod(sharding.axis_sizes(mesh).values()) == 1:
            out = routed_experts(xf, w, idx, experts, e, backend=self.trace_options.kernels)  # one device
        else:
            out = expert_parallel(xf, w, idx, experts, e, mesh, self.trace_options)
        if c.n_shared_experts:
            shared = MLP(d, i * c.n_shared_experts, self.param_dtype, self.fp8, self.trace_options,
                         name="shared_experts")
            out = out + shared(xf)
        return out.reshape(shape)
