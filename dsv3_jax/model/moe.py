"""Mixture of experts: the `noaux_tc` grouped sigmoid router and the routed + shared SwiGLU experts.

Owns: expert selection and weights (`route`), token permutation by expert, the grouped matmuls
(through `kernels.grouped_matmul`: the FP8 or BF16 Pallas kernel when `trace_options.kernels` is
"pallas", their references otherwise) and the weighted un-permutation. Only the chosen experts' work
is computed. Expert weights are stacked [E, ...] in the HF [out, in] layout.

Expert parallelism (`expert_parallel`): under `jax.set_mesh(mesh)` with a mesh from sharding.py, the
router and the routed experts run inside `shard_map` with explicit collectives (each device routes only
its own tokens; only tokens travel, in the activation dtype, with their routing ids and weights); without
a mesh (or a 1-device mesh) the single-device path (`route`, then `routed_experts` on all tokens) runs.
How the MoE learns the mesh: it reads `jax.sharding.get_abstract_mesh()` at trace time, i.e. the mesh
the *caller* set with `jax.set_mesh` around tracing (ModelHandle does this). Which array lives where
comes from sharding.py's tables; this module owns only the collectives. The dispatch mode and its
thresholds come from the module's `trace_options` (trace_options.py), never from module state.
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
from dsv3_jax.model.layers import MLP, swiglu
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
# Every device routes its own tokens (the router is replicated, 0.3% of a MoE layer) inside the
# shard_map, so no routing intermediate crosses a device. Which dispatch runs when is decided at trace
# time from static shapes and the TraceOptions (`moe_dispatch` "auto" follows this table, "all_gather" /
# "all_to_all" force one path):
# - "all_gather" when an expert group holds at most `all_gather_max_tokens` tokens (decode): every device
#   gathers the group's tokens, runs its own experts on the (token, choice) pairs that chose them, and a
#   reduce-scatter returns each token's partial sums to its owner. No capacity, nothing to drop.
# - "all_to_all" above that (prefill): each token travels once to each device owning at least one of its
#   chosen experts (never once per expert), with its local expert ids and routing weights; that device
#   returns one weighted partial sum per token, and the owner adds them up. Buffers hold C rows per
#   (source, destination) pair, C = `capacity_factor` x the balanced load, where a token reaches at most
#   `max_destinations` devices (DeepSeek-V3's group limit: 4 groups of 32 experts, so <= 4 of 8 devices at
#   EP=8), capped at the worst case (every local token). If any pair would exceed C (checked on every
#   call, collectively), the whole layer falls back to the all-gather path for that call, so no token is
#   ever dropped; at C = the worst case the check is skipped.
# Bytes on the wire, per device and MoE layer, n tokens per device, bf16 payloads: the all-gather and the
# reduce-scatter each (ep-1) x n x D x 2; the all-to-all (ep-1)/ep x ep x C x (D x 2 + ids and weights),
# both ways. For DeepSeek-V3 at EP=8 both equal the DeepEP-style volume (n x k x D x 2 x (ep-1)/ep, k = 8).
def choose_dispatch(group_tokens: int, options: TraceOptions) -> str:
    """The dispatch for an expert group of `group_tokens` tokens (see the table above)."""
    if options.moe_dispatch != "auto":
        return options.moe_dispatch
    return "all_gather" if group_tokens <= options.all_gather_max_tokens else "all_to_all"


def max_destinations(cfg: ModelConfig, ep: int) -> int:
    """The most devices of an expert group of `ep` one token's experts can live on: k choices, and with
    group-limited routing at most `topk_group` groups, each spanning ceil(group / experts per device)
    devices (one more when the two do not align)."""
    e_loc = cfg.n_routed_experts // ep
    group = cfg.n_routed_experts // cfg.n_group
    span = -(-group // e_loc) + (0 if group % e_loc == 0 or e_loc % group == 0 else 1)
    return max(1, min(cfg.num_experts_per_tok, ep, cfg.topk_group * span))


def a2a_capacity(n_local: int, ep: int, max_dest: int, capacity_factor: float) -> tuple[int, int]:
    """(capacity C per source->destination pair, worst case) for the all-to-all dispatch: a token goes to
    a destination at most once, so the worst case is every local token; the balanced load is
    n_local x max_dest / ep (C rounded up to 8 rows)."""
    worst = n_local
    balanced = -(-n_local * max_dest // ep)
    cap = -(-math.ceil(capacity_factor * balanced) // 8) * 8
    return min(cap, worst), worst


def _ep_all_gather(x, w, idx, experts, e_loc: int, backend: str) -> jax.Array:
    """All-gather the group's tokens, run local experts, reduce-scatter the partial outputs."""
    shard = jax.lax.axis_index("expert")
    xg = jax.lax.all_gather(x, "expert", tiled=True)
    wg = jax.lax.all_gather(w, "expert", tiled=True)
    ig = jax.lax.all_gather(idx, "expert", tiled=True)
    ig = jnp.where(ig >= 0, ig - shard * e_loc, -1)  # foreign ids fall outside [0, e_loc), padding stays -1
    y = routed_experts(xg, wg, ig, experts, e_loc, backend=backend)
    return jax.lax.psum_scatter(y, "expert", scatter_dimension=0, tiled=True)


def _ep_all_to_all(x, w, idx, experts, e_loc: int, ep: int, cap: int, backend: str) -> jax.Array:
    """Send each token once to every device holding one of its experts (C slots per destination), with
    its local ids and weights; each device returns one weighted partial sum per received token."""
    n, k = idx.shape
    d = x.shape[-1]
    dest = jnp.where(idx >= 0, idx // e_loc, ep)  # [n, k]; padding tokens (-1) go nowhere
    goes = (dest[:, :, None] == jnp.arange(ep)).any(1)  # [n, ep]: token -> destination, once
    rank = jnp.cumsum(goes, axis=0) - 1  # the token's row in its destination's buffer
    sent = goes & (rank < cap)
    slot = jnp.where(sent, jnp.arange(ep) * cap + rank, ep * cap)  # ep*cap: out of bounds, dropped
    src = jnp.full((ep * cap,), n, jnp.int32).at[slot.reshape(-1)].set(
        jnp.repeat(jnp.arange(n, dtype=jnp.int32), ep), mode="drop")  # slot -> token (n: empty slot)
    x_pad = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])
    i_pad = jnp.concatenate([idx, jnp.full((1, k), -1, idx.dtype)])
    w_pad = jnp.concatenate([w, jnp.zeros((1, k), w.dtype)])
    slot_dest = jnp.arange(ep * cap) // cap
    ids = i_pad[src]
    mine = (ids >= 0) & (ids // e_loc == slot_dest[:, None])
    send_ids = jnp.where(mine, ids - slot_dest[:, None] * e_loc, -1)  # the destination's local ids
    send_w = jnp.where(mine, w_pad[src], 0.0)
    recv_x = jax.lax.all_to_all(x_pad[src], "expert", 0, 0, tiled=True)
    recv_ids = jax.lax.all_to_all(send_ids, "expert", 0, 0, tiled=True)
    recv_w = jax.lax.all_to_all(send_w, "expert", 0, 0, tiled=True)
    y = routed_experts(recv_x, recv_w, recv_ids, experts, e_loc, backend=backend)  # weighted partial sums
    back = jax.lax.all_to_all(y, "expert", 0, 0, tiled=True)
    return jnp.zeros((n, d), jnp.float32).at[src].add(back.astype(jnp.float32), mode="drop").astype(x.dtype)


def expert_parallel(x: jax.Array, gate_w: jax.Array, bias: jax.Array, valid: jax.Array, experts: dict,
                    cfg: ModelConfig, mesh, options: TraceOptions,
                    shared: dict | None = None) -> tuple[jax.Array, jax.Array]:
    """Route and run the routed experts on a mesh: tokens [N, D] (and `valid` [N]) batch-sharded over
    (data, expert), the router replicated (each device routes its own tokens), experts over `expert`,
    their FFN width over `tensor` (partial sums psum'ed over tensor). `shared`: the shared expert's
    parameters ({gate,up,down}_proj: {weight[, scale]}, width over `tensor`): its partial sum joins the
    routed one, so one all-reduce over `tensor` carries both. Returns (output [N, D], the chosen expert
    ids [N, k], padding tokens' included); same numbers as one device.
    `options` gives the dispatch mode, its thresholds and the kernel backend.
    """
    num_experts = cfg.n_routed_experts
    sizes = sharding.axis_sizes(mesh)
    ep = sizes["expert"]
    e_loc = num_experts // ep
    tok = sharding.logical_to_spec(sharding.ACTIVATION_AXES["moe_tokens"])
    row = P(tok[0], None)
    batch_axes = (tok[0],) if isinstance(tok[0], str) else tuple(tok[0])
    w_specs = {name: sharding.logical_to_spec(layout.PARAM_AXES[f"mlp/{name}_weight"])
               for name in ("gate_proj", "up_proj", "down_proj")}
    exp_specs = {name: {key: w_specs[name] for key in p} for name, p in experts.items()}
    shared_specs = None if shared is None else {
        name: {key: sharding.logical_to_spec(layout.param_axes(f"shared_experts/{name}/{key}", v.ndim))
               for key, v in p.items()} for name, p in shared.items()}
    n_local = x.shape[0] // sharding.batch_multiple(mesh)
    mode = choose_dispatch(n_local * ep, options)
    cap, worst = a2a_capacity(n_local, ep, max_destinations(cfg, ep), options.capacity_factor)
    backend = options.kernels

    def body(x, gate_w, bias, valid, experts, shared):
        logits = jnp.einsum("nd,ed->ne", x.astype(jnp.float32), gate_w.astype(jnp.float32))
        w, choice = route(logits, bias, cfg)
        idx = jnp.where(valid[:, None], choice, -1)
        if ep == 1:
            y = routed_experts(x, w, idx, experts, num_experts, backend=backend)
        elif mode == "all_gather":
            y = _ep_all_gather(x, w, idx, experts, e_loc, backend)
        elif cap >= worst:
            y = _ep_all_to_all(x, w, idx, experts, e_loc, ep, cap, backend)
        else:
            # Overflow anywhere -> every device falls back together (the predicate is global).
            dest = jnp.where(idx >= 0, idx // e_loc, ep)
            load = (dest[:, :, None] == jnp.arange(ep)).any(1).sum(0).max()
            overflow = jax.lax.pmax(load, batch_axes) > cap  # tokens are tensor-invariant
            y = jax.lax.cond(overflow,
                             lambda *a: _ep_all_gather(*a, e_loc, backend),
                             lambda *a: _ep_all_to_all(*a, e_loc, ep, cap, backend),
                             x, w, idx, experts)
        if shared is not None:
            y = y + swiglu(x, shared, backend=backend)
        # Each device computed its FFN slice's partial sum (a no-op reduction when tensor=1).
        return jax.lax.psum(y, "tensor"), choice

    fn = jax.shard_map(body, mesh=mesh, in_specs=(tok, P(), P(), P(tok[0]), exp_specs, shared_specs),
                       out_specs=(tok, row))
    return fn(x, gate_w, bias, valid, experts, shared)


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
        mesh = jax.sharding.get_abstract_mesh()
        shared = None
        if c.n_shared_experts:
            shared = MLP(d, i * c.n_shared_experts, self.param_dtype, self.fp8, self.trace_options,
                         name="shared_experts")
        one_device = mesh.empty or math.prod(sharding.axis_sizes(mesh).values()) == 1
        if one_device or self.is_initializing():
            logits = jnp.einsum("nd,ed->ne", xf.astype(jnp.float32), gate_w.astype(jnp.float32))
            w, choice = route(logits, bias, c)
            idx = choice if valid is None else jnp.where(valid.reshape(-1, 1), choice, -1)
            out = routed_experts(xf, w, idx, experts, e, backend=self.trace_options.kernels)
            if shared is not None:
                out = out + shared(xf)
        else:  # each device routes its own tokens inside the expert-parallel shard_map
            ok = jnp.ones(xf.shape[:1], bool) if valid is None else valid.reshape(-1)
            shared_params = None if shared is None else shared.variables["params"]
            out, choice = expert_parallel(xf, gate_w, bias, ok, experts, c, mesh, self.trace_options,
                                          shared_params)
            idx = choice if valid is None else jnp.where(valid.reshape(-1, 1), choice, -1)
        self.sow("intermediates", "router_choice", choice.reshape(*shape[:-1], -1))
        self.sow("intermediates", "expert_load", jnp.bincount(jnp.where(idx >= 0, idx, e).reshape(-1),
                                                              length=e + 1)[:e])
        return out.reshape(shape)
