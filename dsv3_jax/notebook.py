"""How a `ModelHandle` shows itself in a REPL or a Jupyter cell.

Owns: the summary rows of a handle (config, parameter counts, dtype, attention form, kernels, mesh,
per-device memory), rendered as text (`handle_repr`) and as an HTML table (`handle_html`), and `Table`,
dict rows that render as an HTML table in a notebook (the examples' tables).
Must not load, compute with or change the model; reading shard sizes and device memory stats only.
"""

from __future__ import annotations

import html
from collections import defaultdict
from typing import Any

import jax


def _gb(n: float) -> str:
    return f"{n / 1e9:,.3f} GB" if n < 1e11 else f"{n / 1e9:,.1f} GB"


def _count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:,.2f}{unit}"
    return str(n)


def memory_per_device(handle: Any) -> dict[str, int]:
    """Bytes of the handle's parameters held by each device (from the arrays' own shards)."""
    per: dict[str, int] = defaultdict(int)
    for leaf in jax.tree.leaves(handle.params):
        shards = getattr(leaf, "addressable_shards", None)
        if shards is None:  # a host (numpy) array
            per["host"] += int(leaf.nbytes)
            continue
        for s in shards:
            per[str(s.device)] += int(s.data.nbytes)
    return dict(per)


def _device_limit(name: str) -> int | None:
    """What XLA may use on the device called `name` (None on CPU, which reports no limit)."""
    for d in jax.local_devices():
        if str(d) == name:
            stats = d.memory_stats() or {}
            return stats.get("bytes_limit")
    return None


def summary_rows(handle: Any) -> list[tuple[str, str]]:
    """(field, value) rows describing the handle; the repr and the HTML table both render these."""
    from dsv3_jax.model import layout
    from dsv3_jax.parallel import sharding

    c = handle.config
    dtype = (f"FP8 e4m3 weights (128x128 block scales), {c.dtype} activations" if handle.fp8
             else f"{c.dtype} weights and activations")
    rows = [
        ("checkpoint", str(handle.path) if handle.path is not None else "tiny default (random weights)"),
        ("parameters", f"{_count(c.param_count())} total, {_count(c.param_count(activated=True))} "
                       f"activated per token (+ MTP {_count(c.mtp_params())})"),
        ("layers", f"{c.num_hidden_layers} ({c.n_dense_layers} dense + {c.n_moe_layers} MoE)"),
        ("hidden_size", str(c.hidden_size)),
        ("attention", f"MLA, {handle.attention} form, {c.num_attention_heads} heads, "
                      f"kv_lora_rank {c.kv_lora_rank} + rope {c.qk_rope_head_dim}, "
                      f"q_lora_rank {c.q_lora_rank}"),
        ("experts", f"{c.n_routed_experts} routed ({c.n_group} groups, top-{c.topk_group} groups) + "
                    f"{c.n_shared_experts} shared, num_experts_per_tok {c.num_experts_per_tok}"),
        ("vocab_size", f"{c.vocab_size:,}"),
        ("context", f"{c.max_position_embeddings:,} tokens"
                    + (f" (YaRN x{c.rope_scaling.factor:g})" if c.rope_scaling is not None else "")),
        ("dtype", dtype),
        ("kernels", handle.trace_options.kernels),
        ("KV cache", f"{layout.bytes_per_token(c, handle.attention):,} B per token "
                     f"({c.dtype}, {handle.attention} form, all layers)"),
        ("mesh", "none (one device)" if handle.mesh is None
         else f"{sharding.describe(handle.mesh)} ({handle.mesh.size} devices)"),
    ]
    mem = memory_per_device(handle)
    sizes = sorted(set(mem.values()))
    limits = {_device_limit(d) for d in mem}
    limit = f" of {_gb(limits.pop())}" if len(limits) == 1 and None not in limits else ""
    if len(sizes) == 1:
        rows.append(("weights per device", f"{_gb(sizes[0])}{limit} on each of {len(mem)} device(s)"))
    else:
        rows.append(("weights per device", f"{_gb(min(sizes))} .. {_gb(max(sizes))}{limit} over "
                                           f"{len(mem)} devices"))
    return rows


def handle_repr(handle: Any) -> str:
    rows = summary_rows(handle)
    w = max(len(k) for k, _ in rows)
    return "ModelHandle(\n" + "\n".join(f"  {k:<{w}}  {v}" for k, v in rows) + "\n)"


def handle_html(handle: Any) -> str:
    body = "".join(f"<tr><th style='text-align:left'>{html.escape(k)}</th>"
                   f"<td style='text-align:left'>{html.escape(v)}</td></tr>" for k, v in summary_rows(handle))
    return f"<table><caption style='text-align:left'><b>dsv3_jax ModelHandle</b></caption>{body}</table>"


class Table:
    """A list of same-keyed dict rows that renders as an HTML table in Jupyter and as text elsewhere."""

    def __init__(self, rows: list[dict[str, Any]], title: str | None = None):
        if not rows:
            raise ValueError("rows must hold at least one row")
        self.rows = [dict(r) for r in rows]
        self.columns = list(self.rows[0])
        self.title = title

    def __len__(self) -> int:
        return len(self.rows)

    @staticmethod
    def _cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}"
        return str(v)

    def __repr__(self) -> str:
        cells = [[self._cell(r.get(c, "")) for c in self.columns] for r in self.rows]
        w = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(self.columns)]
        lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(self.columns)),
                 "  ".join("-" * n for n in w)]
        lines += ["  ".join(v.rjust(w[i]) for i, v in enumerate(row)) for row in cells]
        return "\n".join(([self.title] if self.title else []) + lines)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(self._cell(r.get(c, '')))}</td>"
                                        for c in self.columns) + "</tr>" for r in self.rows)
        cap = f"<caption style='text-align:left'><b>{html.escape(self.title)}</b></caption>" \
            if self.title else ""
        return f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def to_csv(self, path: Any) -> None:
        """Write the rows as CSV (raw values, not the display formatting)."""
        import csv

        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.columns)
            w.writeheader()
            w.writerows(self.rows)
