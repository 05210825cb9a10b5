"""Training small DeepSeek-V3-architecture models with their MTP head (the shipped default model, tests).

Owns: the `small-mtp` and `dsv3-small` configs, the corpus (the Python standard library's .py files
through the real tokenizer, split by file into train / held-out token streams), the objective
(next-token cross-entropy + lambda x the MTP cross-entropy on token i+2, MTP embedding and head shared
with the main model as in DeepSeek-V3), the aux-loss-free router-bias update, AdamW with warmup +
cosine, the jitted train step, evaluation (next-token accuracy, MTP accuracy, MTP/main agreement =
greedy k=1 acceptance), the compact vocabulary (`VocabMap`: rare and unseen tokens share one embedding
/ head row, so training computes logits over ~16K rows and the weights ship small; the
full-vocabulary model is exactly the compact one expanded), choosing the rows the shipped
default stores (`export_compact` / `export_compact_rows`; the part-file format itself, its reader and
the MTP tie are formats/compact.py's) and `save_checkpoint` (an HF directory `dsv3_jax.load` reads).
CLI: `python -m dsv3_jax.train --preset dsv3-small ...`.
Must not own the model math (model.py) or the HF name mapping (dsv3_jax/formats/hf_names.py, tree_to_hf.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dsv3_jax.config import ModelConfig
from dsv3_jax.formats.compact import TIED, flatten, import_compact, tie_mtp, write_parts
from dsv3_jax.formats.tree_to_hf import write_hf_weights
from dsv3_jax.model.transformer import Transformer

# Every mechanism of DeepSeek-V3 at a size one H200 trains in minutes: q LoRA, 1 dense + 4 MoE layers,
# 4 groups of 4 routed experts (top-2 groups, 4 experts per token) + a shared expert, the MTP layer.
# The real 129,280-token vocabulary makes the two embedding-sized tables most of the weights.
SMALL_MTP = ModelConfig(
    vocab_size=129280, hidden_size=256, intermediate_size=1024, moe_intermediate_size=128,
    num_hidden_layers=5, first_k_dense_replace=1, n_routed_experts=16, n_shared_experts=1,
    num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5, num_attention_heads=8,
    q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
    max_position_embeddings=4096, rope_scaling=None, num_nextn_predict_layers=1, bos_token_id=0,
    eos_token_id=1, dtype="bfloat16",
)
# The shipped default model (dsv3_jax/default_model): every DeepSeek-V3 mechanism at the REAL MLA widths
# (16 heads, q LoRA, kv_lora 512, rope 64, nope / v 128: the Pallas MLA kernel's shapes), 1 dense + 2 MoE
# layers (4 groups of 4 routed experts of width 64, top-2 groups, 4 per token, + a shared expert) and
# the MTP layer. Trained with plain RoPE over 512-token windows; the shipped config adds YaRN over that
# original context (`ship_config`). ~15M parameters outside the vocabulary tables, whose attention
# (kv_b alone is 2.1M per layer) is what the 40 MB budget pays for.
DSV3_SMALL = ModelConfig(
    vocab_size=129280, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
    num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=16, n_shared_experts=1,
    num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5, num_attention_heads=16,
    q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    max_position_embeddings=512, rope_scaling=None, num_nextn_predict_layers=1, bos_token_id=0,
    eos_token_id=1, dtype="bfloat16",
)
TRAIN_PRESETS: dict[str, ModelConfig] = {"small-mtp": SMALL_MTP, "dsv3-small": DSV3_SMALL}


def preset(name: str) -> ModelConfig:
    """A training preset (`small-mtp`) or any of config.py's presets."""
    return TRAIN_PRESETS[name] if name in TRAIN_PRESETS else ModelConfig.preset(name)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch: int = 32
    seq_len: int = 512
    peak_lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    mtp_weight: float = 0.3  # DeepSeek-V3: 0.3 for the first 10T tokens, then 0.1
    bias_update: float = 1e-3  # aux-loss-free balancing speed (gamma in the paper)
    eval_every: int = 200
    eval_windows: int = 64  # held-out windows per periodic eval (the final eval uses all)
    log_every: int = 50
    seed: int = 0
    time_budget: float | None = None  # seconds of training; caps `steps` after timing the first ones
    vocab_min_count: int = 0  # > 0: train on the compact vocabulary of tokens seen this often (VocabMap)
    tie_head: bool = False  # the LM head's rows are the embedding's (one table to store)

    def __post_init__(self) -> None:
        for f in ("steps", "batch", "seq_len"):
            if getattr(self, f) <= 0:
                raise ValueError(f"TrainConfig.{f} must be > 0, got {getattr(self, f)}")
        if self.seq_len < 3:
            raise ValueError(f"TrainConfig.seq_len must be >= 3 (MTP predicts token i+2), got {self.seq_len}")
        if self.tie_head and not self.vocab_min_count:
            raise ValueError("TrainConfig.tie_head needs vocab_min_count > 0 (a full-vocabulary tied table "
                             "keeps random rows for unseen tokens)")


# ------------------------------------------------------------------------------------------- corpus
@dataclasses.dataclass
class Corpus:
    """Token streams (uint32): each file is [BOS] + its tokens + [EOS], files concatenated."""

    train: np.ndarray
    heldout: np.ndarray
    n_train_files: int
    n_heldout_files: int

    def save(self, path: str | Path) -> None:
        np.savez_compressed(path, train=self.train, heldout=self.heldout,
                            files=np.array([self.n_train_files, self.n_heldout_files]))

    @classmethod
    def load(cls, path: str | Path) -> Corpus:
        with np.load(path) as z:
            return cls(z["train"], z["heldout"], int(z["files"][0]), int(z["files"][1]))


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The standard library's .py files (site-packages excluded), sorted."""
    import sysconfig

    root = Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(f for f in root.rglob("*.py") if "site-packages" not in f.relative_to(root).parts)


def is_heldout(path: Path, every: int) -> bool:
    """Deterministic file-level split: a file is held out when crc32(its name) % every == 0."""
    return zlib.crc32(str(Path(path.parent.name) / path.name).encode()) % every == 0


def tokenize_files(tokenizer: Any, files: Sequence[Path]) -> list[np.ndarray]:
    """Each file as [BOS] + its tokens + [EOS] (uint32), the corpus' unit."""
    texts = [Path(f).read_text(encoding="utf-8", errors="replace") for f in files]
    encs = tokenizer.backend.encode_batch(texts, add_special_tokens=False)
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    return [np.asarray([*([bos] if bos is not None else []), *e.ids, *([eos] if eos is not None else [])],
                       np.uint32) for e in encs]


def build_corpus(tokenizer: Any, files: Sequence[Path] | None = None, heldout_every: int = 40) -> Corpus:
    """Tokenize `files` (default: `stdlib_files()`) with `tokenizer` (a dsv3_jax Tokenizer)."""
    files = list(files if files is not None else stdlib_files())
    if not files:
        raise ValueError("build_corpus: no files to tokenize")
    if heldout_every < 2:
        raise ValueError(f"heldout_every must be >= 2, got {heldout_every}")
    parts: dict[bool, list[np.ndarray]] = {True: [], False: []}
    for f, ids in zip(files, tokenize_files(tokenizer, files), strict=True):
        parts[is_heldout(f, heldout_every)].append(ids)
    if not parts[True] or not parts[False]:
        raise ValueError(f"build_corpus: the split of {len(files)} files left one side empty; "
                         "pass more files or a smaller heldout_every")
    return Corpus(np.concatenate(parts[False]), np.concatenate(parts[True]), len(parts[False]),
                  len(parts[True]))


def windows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping [N, seq_len] int32 windows of a token stream (the tail is dropped)."""
    n = len(stream) // seq_len
    if n == 0:
        raise ValueError(f"stream of {len(stream)} tokens is shorter than seq_len={seq_len}")
    return stream[: n * seq_len].reshape(n, seq_len).astype(np.int32)


def sample_batch(rng: np.random.Generator, stream: np.ndarray, batch: int, seq_len: int) -> np.ndarray:
    """`batch` windows of `seq_len` tokens at uniformly random offsets of the stream."""
    if len(stream) <= seq_len:
        raise ValueError(f"train stream of {len(stream)} tokens is not longer than seq_len={seq_len}")
    starts = rng.integers(0, len(stream) - seq_len, batch)
    return stream[starts[:, None] + np.arange(seq_len)].astype(np.int32)


@dataclasses.dataclass(frozen=True)
class VocabMap:
    """The compact vocabulary: tokens seen >= min_count times in the train split keep their own row (in id
    order), every other token of the full vocabulary shares the last row.

    A model over the compact rows IS a full-vocabulary model whose shared tokens have equal embedding and
    head rows: each of the `n_shared` tokens gets the shared row's logit z, so the full softmax equals the
    compact one with z + log(n_shared) in the shared column (`shared_column`), and the full cross-entropy
    of a shared target is the compact one + log(n_shared). Training and evaluation use that identity.
    """

    kept: np.ndarray  # int32 [R], full ids with their own row
    vocab_size: int

    @classmethod
    def from_stream(cls, stream: np.ndarray, vocab_size: int, min_count: int) -> VocabMap:
        if min_count < 1:
            raise ValueError(f"min_count must be >= 1, got {min_count}")
        counts = np.bincount(np.asarray(stream, np.int64), minlength=vocab_size)
        if len(counts) > vocab_size:
            raise ValueError(f"stream has token ids >= vocab_size={vocab_size}")
        return cls(np.flatnonzero(counts >= min_count).astype(np.int32), vocab_size)

    @property
    def rows(self) -> int:
        return len(self.kept) + 1

    @property
    def n_shared(self) -> int:
        return self.vocab_size - len(self.kept)

    def shared_column(self) -> tuple[int, float]:
        """(the shared row's index, log of how many full-vocabulary tokens it stands for)."""
        return len(self.kept), math.log(self.n_shared)

    def index(self) -> np.ndarray:
        """int32 [vocab_size]: full id -> compact row."""
        idx = np.full(self.vocab_size, len(self.kept), np.int32)
        idx[self.kept] = np.arange(len(self.kept), dtype=np.int32)
        return idx

    def to_compact(self, stream: np.ndarray) -> np.ndarray:
        return self.index()[np.asarray(stream, np.int64)].astype(np.uint32)

    def to_full(self, ids: np.ndarray) -> np.ndarray:
        """Compact ids -> full ids (the shared row -> its lowest full id, the full model's argmax)."""
        shared_ids = np.setdiff1d(np.arange(self.vocab_size), self.kept, assume_unique=True)
        lut = np.concatenate([self.kept, shared_ids[:1]]).astype(np.int32)
        return lut[np.asarray(ids)]


# ------------------------------------------------------------------------------------- parameters
def compute_dtype() -> jnp.dtype:
    """bf16 on an accelerator, fp32 on CPU (bf16 matmuls are slow and imprecise there)."""
    return jnp.dtype(jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32)


def init_params(cfg: ModelConfig, key: jax.Array, tie_head: bool = False) -> dict[str, Any]:
    """fp32 training parameters: the whole tree minus the MTP copies of the embedding and head (shared),
    and minus lm_head itself with `tie_head` (its rows are the embedding's).

    lm_head starts at zero: every row of a token the corpus never contains then receives the same
    updates, so those rows stay equal (and `restrict_vocab` can store one of them for all).
    """
    model = Transformer(cfg.replace(dtype="float32"), jnp.float32, False, "naive")
    params = jax.jit(lambda k: model.init(k, jnp.zeros((1, 4), jnp.int32), method=model.init_all))(key)
    params = jax.tree_util.tree_map(lambda x: x, params["params"])  # a plain mutable dict tree
    params["lm_head"]["weight"] = jnp.zeros_like(params["lm_head"]["weight"])
    if tie_head:
        del params["lm_head"]
    if "mtp" in params:
        for path in TIED:
            del params[path[0]][path[1]]
    return params


def cast_for_compute(params: dict[str, Any], dtype: jnp.dtype) -> dict[str, Any]:
    """Floating leaves in `dtype`, the router bias kept fp32 (as checkpoint.cast_tree does on load)."""
    def cast(path, x):
        return x if path[-1].key == "e_score_correction_bias" else x.astype(dtype)
    return jax.tree_util.tree_map_with_path(cast, params)


def _decays(path) -> bool:
    """Weight decay on matrices only: not on norms or the router bias."""
    keys = [p.key for p in path]
    return not any("norm" in k for k in keys) and keys[-1] != "e_score_correction_bias"


def restrict_vocab(params: dict[str, Any], used: np.ndarray) -> dict[str, Any]:
    """Embedding rows of tokens outside `used` (bool [V]) -> 0, their head rows -> their mean.

    Those tokens never occur in training; their rows carry no information (untouched init / identical
    by construction, see `init_params`), so this makes the weights compactable without changing what
    the model predicts on the corpus. Evaluate after this, so the measured model is the shipped one.
    """
    used = jnp.asarray(used, bool)
    if used.shape != params["lm_head"]["weight"].shape[:1]:
        raise ValueError(f"used must be a bool mask of the vocabulary, got shape {used.shape}")
    emb, head = params["embed_tokens"]["embedding"], params["lm_head"]["weight"]
    n_unused = jnp.maximum((~used).sum(), 1)
    fill = jnp.where(used[:, None], 0, head).sum(0) / n_unused
    out = {**params, "embed_tokens": {"embedding": jnp.where(used[:, None], emb, 0)},
           "lm_head": {"weight": jnp.where(used[:, None], head, fill[None].astype(head.dtype))}}
    return out


# ------------------------------------------------------------------------------------- objective
Shared = tuple[int, float] | None  # VocabMap.shared_column() of a compact-vocabulary model, or None


def _ce_and_top1(logits: jax.Array, targets: jax.Array, shared: Shared = None) -> tuple[jax.Array, jax.Array]:
    """Per-position cross-entropy and top-1 hit for logits [..., V] (fp32) and targets [...], both those
    of the full-vocabulary model when `shared` describes a compact one (see `VocabMap`)."""
    hit = jnp.argmax(logits, -1) == targets
    if shared is not None:
        row, log_n = shared
        logits = logits.at[..., row].add(log_n)
        hit = hit & (targets != row)  # the full model's argmax is one shared token, the target another
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    ce = lse - tgt
    if shared is not None:
        ce = ce + jnp.where(targets == shared[0], shared[1], 0.0)
    return ce, hit


def forward_both(model: Transformer, params: dict[str, Any], tokens: jax.Array, collect: bool = False):
    """Main logits [B,T,V], MTP logits [B,T-1,V] (position i predicts token i+2), router choices."""
    b, t = tokens.shape
    full = {"params": tie_mtp(params)}
    mut = ["intermediates"] if collect else False
    out = model.apply(full, tokens, mutable=mut)
    (logits, hidden, _), inter = out if collect else (out, {})
    pos = jnp.broadcast_to(jnp.arange(t - 1, dtype=jnp.int32), (b, t - 1))
    out = model.apply(full, hidden[:, :-1], tokens[:, 1:], pos, method=model.mtp_logits, mutable=mut)
    (mtp_logits, _, _), inter2 = out if collect else (out, {})
    return logits, mtp_logits, {**inter.get("intermediates", {}), **inter2.get("intermediates", {})}


def loss_fn(model: Transformer, params: dict[str, Any], tokens: jax.Array, mtp_weight: float,
            dtype: jnp.dtype, shared: Shared = None):
    """L = CE(next token) + mtp_weight * CE_MTP(token i+2); returns (L, (metrics, router choices))."""
    logits, mtp_logits, inter = forward_both(model, cast_for_compute(params, dtype), tokens, collect=True)
    ce, hit = _ce_and_top1(logits[:, :-1], tokens[:, 1:], shared)
    mce, mhit = _ce_and_top1(mtp_logits[:, :-1], tokens[:, 2:], shared)
    loss = ce.mean() + mtp_weight * mce.mean()
    metrics = {"loss": loss, "main_ce": ce.mean(), "mtp_ce": mce.mean(), "main_acc": hit.mean(),
               "mtp_acc": mhit.mean()}
    return loss, (metrics, inter)


def update_router_bias(params: dict[str, Any], inter: dict[str, Any], cfg: ModelConfig,
                       gamma: float) -> dict[str, Any]:
    """Aux-loss-free balancing: bias_e += gamma * sign(mean load - load_e), per MoE layer."""
    e = cfg.n_routed_experts

    def nudge(bias: jax.Array, choice: jax.Array) -> jax.Array:
        # choice [..., k] for one layer -> per-expert load
        load = jax.nn.one_hot(choice.reshape(-1), e, dtype=jnp.float32).sum(0)
        return bias + gamma * jnp.sign(load.mean() - load)

    params = dict(params)
    if "moe_layers" in params and "moe_layers" in inter:
        ch = inter["moe_layers"]["mlp"]["router_choice"][0]  # [L, B, T, k]
        mlp = params["moe_layers"]["mlp"]
        bias = jax.vmap(nudge)(mlp["e_score_correction_bias"], ch)
        params["moe_layers"] = {**params["moe_layers"], "mlp": {**mlp, "e_score_correction_bias": bias}}
    if "mtp" in params and "mtp" in inter:
        ch = inter["mtp"]["block"]["mlp"]["router_choice"][0]
        blk = params["mtp"]["block"]
        mlp = {**blk["mlp"], "e_score_correction_bias": nudge(blk["mlp"]["e_score_correction_bias"], ch)}
        params["mtp"] = {**params["mtp"], "block": {**blk, "mlp": mlp}}
    return params


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """Clip + AdamW at learning rate 1; the step multiplies the update by the scheduled rate."""
    mask = lambda p: jax.tree_util.tree_map_with_path(lambda path, _: _decays(path), p)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(tc.grad_clip),
                       optax.adamw(1.0, b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay, mask=mask))


def lr_at(step: int, total: int, tc: TrainConfig) -> float:
    """Linear warmup to peak_lr, then cosine down to min_lr_ratio * peak_lr at `total`."""
    if step < tc.warmup:
        return tc.peak_lr * (step + 1) / tc.warmup
    frac = min(1.0, (step - tc.warmup) / max(1, total - tc.warmup))
    return tc.peak_lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def make_train_step(cfg: ModelConfig, tc: TrainConfig, dtype: jnp.dtype, shared: Shared = None) -> Callable:
    """jitted (params, opt_state, tokens [B,T], lr) -> (params, opt_state, metrics)."""
    model = Transformer(cfg.replace(dtype=jnp.dtype(dtype).name), jnp.float32, False, "naive")
    tx = make_optimizer(tc)

    def step(params, opt_state, tokens, lr):
        grads, (metrics, inter) = jax.grad(
            lambda p: loss_fn(model, p, tokens, tc.mtp_weight, dtype, shared), has_aux=True)(params)
        metrics["grad_norm"] = optax.global_norm(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, jax.tree_util.tree_map(lambda u: lr * u, updates))
        params = update_router_bias(params, inter, cfg, tc.bias_update)
        return params, opt_state, metrics

    return jax.jit(step, donate_argnums=(0, 1))


# ------------------------------------------------------------------------------------ evaluation
def make_eval(cfg: ModelConfig, dtype: jnp.dtype, shared: Shared = None) -> Callable:
    """jitted (params, tokens [B,T]) -> sums: main CE/hits over T-1 targets, MTP CE/hits and agreement
    with the main model's greedy token over T-2 positions (the teacher-forced acceptance proxy)."""
    model = Transformer(cfg.replace(dtype=jnp.dtype(dtype).name), jnp.float32, False, "naive")

    def ev(params, tokens):
        logits, mtp_logits, _ = forward_both(model, cast_for_compute(params, dtype), tokens)
        ce, hit = _ce_and_top1(logits[:, :-1], tokens[:, 1:], shared)
        mce, mhit = _ce_and_top1(mtp_logits[:, :-1], tokens[:, 2:], shared)
        agree = jnp.argmax(mtp_logits[:, :-1], -1) == jnp.argmax(logits[:, 1:-1], -1)
        return {"main_ce": ce.sum(), "main_hits": hit.sum(), "n_main": ce.size, "mtp_ce": mce.sum(),
                "mtp_hits": mhit.sum(), "agree": agree.sum(), "n_mtp": mce.size}

    return jax.jit(ev)


def evaluate(ev: Callable, params: dict[str, Any], wins: np.ndarray, batch: int) -> dict[str, float]:
    """Held-out metrics over windows `wins` [N, T]: losses, accuracies, MTP/main agreement."""
    tot: dict[str, float] = {}
    for i in range(0, len(wins) - batch + 1, batch) or [0]:
        chunk = wins[i:i + batch]
        for k, v in ev(params, jnp.asarray(chunk)).items():
            tot[k] = tot.get(k, 0.0) + float(v)
    return {"main_ce": tot["main_ce"] / tot["n_main"], "main_acc": tot["main_hits"] / tot["n_main"],
            "mtp_ce": tot["mtp_ce"] / tot["n_mtp"], "mtp_acc": tot["mtp_hits"] / tot["n_mtp"],
            "acceptance_proxy": tot["agree"] / tot["n_mtp"], "tokens": tot["n_main"]}


def make_greedy_acceptance(cfg: ModelConfig, dtype: jnp.dtype, n_new: int) -> Callable:
    """jitted (params, prompts [B,P]) -> (generated [B, P+n_new], accepted, drafted).

    The main model continues each prompt greedily (full recompute per token: exact, simple); then on
    that continuation the MTP draft from (h_i, g_{i+1}) is compared with g_{i+2}, the main model's own
    greedy choice. That is exactly the acceptance rate of greedy k=1 MTP speculative decoding.
    """
    model = Transformer(cfg.replace(dtype=jnp.dtype(dtype).name), jnp.float32, False, "naive")

    def run(params, prompts):
        p = cast_for_compute(params, dtype)
        b, plen = prompts.shape
        buf = jnp.concatenate([prompts, jnp.zeros((b, n_new), prompts.dtype)], axis=1)

        def body(j, buf):
            logits = model.apply({"params": tie_mtp(p)}, buf)[0]
            nxt = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, plen + j - 1, 1, keepdims=False), -1)
            return jax.lax.dynamic_update_index_in_dim(buf, nxt.astype(buf.dtype), plen + j, 1)

        buf = jax.lax.fori_loop(0, n_new, body, buf)
        _, mtp_logits, _ = forward_both(model, p, buf)
        draft = jnp.argmax(mtp_logits[:, plen - 1:-1], -1)  # from h_i, g_{i+1}: i = P-1 .. P+n-3
        ok = draft == buf[:, plen + 1:]
        return buf, ok.sum(), ok.size

    return jax.jit(run)


# ----------------------------------------------------------------------------------------- saving
def save_checkpoint(params: dict[str, Any], cfg: ModelConfig, tokenizer: Any, dst: str | Path, *,
                    generation_config: dict[str, Any] | None = None,
                    max_shard_bytes: int = 2 * 1024**3) -> Path:
    """Write an HF-format directory `dsv3_jax.load(dst)` reads: config.json, safetensors weights with HF
    names (the MTP layer as model.layers.{num_hidden_layers}.*, its embedding / head as copies of the
    main model's), tokenizer files (when `tokenizer` is given) and generation_config.json."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    full = tie_mtp(jax.tree_util.tree_map(np.asarray, params))
    (dst / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    write_hf_weights(full, cfg, dst, max_shard_bytes=max_shard_bytes)
    if tokenizer is not None:
        tokenizer.save_to(dst)
    gen = generation_config if generation_config is not None else {
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "do_sample": True,
        "temperature": 0.6, "top_p": 0.95}
    (dst / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return dst


def export_compact(params: dict[str, Any], used: np.ndarray, dst: str | Path, *,
                   part_bytes: int = 15 * 1024**2, dtype: str = "bfloat16") -> list[Path]:
    """Full-vocabulary training params (after `restrict_vocab`) as `compact.part-NNN` files of <=
    part_bytes: one safetensors blob, floats in `dtype` (router bias fp32), embedding / head rows of
    `used` tokens only plus the one shared head row of the rest. `import_compact` inverts it."""
    used = np.asarray(used, bool)
    flat = {k: np.asarray(v) for k, v in flatten(jax.tree_util.tree_map(np.asarray, params)).items()}
    head = flat["lm_head/weight"]
    if (~used).any():
        flat["lm_head_fill"] = head[np.argmin(used)]
    flat["embed_tokens/embedding"] = flat["embed_tokens/embedding"][used]
    flat["lm_head/weight"] = head[used]
    flat["used_ids"] = np.flatnonzero(used).astype(np.int32)
    return write_parts(flat, {"vocab_size": str(len(used))}, Path(dst), part_bytes, dtype)


def export_compact_rows(params: dict[str, Any], vm: VocabMap, dst: str | Path, *,
                        part_bytes: int = 15 * 1024**2, dtype: str = "bfloat16") -> list[Path]:
    """Compact-vocabulary training params (`train` with `vocab_min_count`) in `export_compact`'s format:
    the kept tokens' rows, the shared row as `embed_fill` / `lm_head_fill`, no head at all when tied."""
    flat = {k: np.asarray(v) for k, v in flatten(jax.tree_util.tree_map(np.asarray, params)).items()}
    r = len(vm.kept)
    emb = flat["embed_tokens/embedding"]
    if emb.shape[0] != vm.rows:
        raise ValueError(f"embedding has {emb.shape[0]} rows, the vocabulary map {vm.rows}")
    flat["embed_tokens/embedding"], flat["embed_fill"] = emb[:r], emb[r]
    tied = "lm_head/weight" not in flat
    if not tied:
        head = flat["lm_head/weight"]
        flat["lm_head/weight"], flat["lm_head_fill"] = head[:r], head[r]
    flat["used_ids"] = vm.kept.astype(np.int32)
    meta = {"vocab_size": str(vm.vocab_size), "tied_head": "1" if tied else "0"}
    return write_parts(flat, meta, Path(dst), part_bytes, dtype)


# ---------------------------------------------------------------------------------------- training
def train(cfg: ModelConfig, tc: TrainConfig, corpus: Corpus, log: Callable[[str], None] = print
          ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Train from scratch; returns (fp32 training params, history dict).

    Full vocabulary (`tc.vocab_min_count` 0): the params come back after `restrict_vocab`. Compact
    vocabulary: they are over `compact_vocab(...)`'s rows (`export_compact_rows` stores them), and every
    reported loss is the full-vocabulary model's (see `VocabMap`).
    """
    if cfg.num_nextn_predict_layers != 1:
        raise ValueError("train: the objective needs exactly one MTP layer (num_nextn_predict_layers=1)")
    dtype = compute_dtype()
    vm = compact_vocab(corpus, cfg, tc)
    shared = vm.shared_column() if vm is not None else None
    if vm is not None:
        cfg = cfg.replace(vocab_size=vm.rows)
        corpus = Corpus(vm.to_compact(corpus.train), vm.to_compact(corpus.heldout), corpus.n_train_files,
                        corpus.n_heldout_files)
    params = init_params(cfg, jax.random.key(tc.seed), tc.tie_head)
    opt_state = make_optimizer(tc).init(params)
    step_fn = make_train_step(cfg, tc, dtype, shared)
    ev = make_eval(cfg, dtype, shared)
    used = np.zeros(cfg.vocab_size, bool)
    used[corpus.train] = True
    if vm is not None:
        restrict = lambda p: p  # noqa: E731  (rare and unseen tokens already share one row)
    else:
        restrict = lambda p: restrict_vocab(p, used)  # noqa: E731
    held = windows(corpus.heldout, tc.seq_len)
    eb = min(tc.batch, len(held))
    rng = np.random.default_rng(tc.seed)
    hist: dict[str, Any] = {"train": [], "eval": [], "dtype": jnp.dtype(dtype).name,
                            "device": jax.devices()[0].device_kind}
    total, t_start, t_timed, timed_from = tc.steps, time.perf_counter(), None, 10
    for step in range(tc.steps):
        if step >= total:
            break
        tokens = jnp.asarray(sample_batch(rng, corpus.train, tc.batch, tc.seq_len))
        params, opt_state, m = step_fn(params, opt_state, tokens, jnp.float32(lr_at(step, total, tc)))
        if step == timed_from - 1:
            jax.block_until_ready(params)
            t_timed = time.perf_counter()
        if step == 2 * timed_from - 1 and tc.time_budget is not None:
            jax.block_until_ready(params)
            per = (time.perf_counter() - t_timed) / timed_from
            left = tc.time_budget - (time.perf_counter() - t_start)
            total = min(tc.steps, step + 1 + max(0, int(left / per)))
            log(f"step time {per * 1e3:.1f} ms -> {total} steps fit the {tc.time_budget:.0f} s budget")
        if (step + 1) % tc.log_every == 0 or step + 1 == total:
            m = {k: float(v) for k, v in m.items()}
            m.update(step=step + 1, lr=lr_at(step, total, tc), elapsed=time.perf_counter() - t_start)
            hist["train"].append(m)
            log(f"step {step + 1}/{total} loss {m['loss']:.3f} main {m['main_ce']:.3f} mtp {m['mtp_ce']:.3f} "
                f"acc {m['main_acc']:.3f}/{m['mtp_acc']:.3f} |g| {m['grad_norm']:.2f} {m['elapsed']:.0f}s")
        if tc.eval_every and (step + 1) % tc.eval_every == 0 and step + 1 < total:
            e = evaluate(ev, restrict(params), held[: max(tc.eval_windows, eb)], eb)
            e["step"] = step + 1
            hist["eval"].append(e)
            log(f"  eval@{step + 1}: main ce {e['main_ce']:.3f} acc {e['main_acc']:.3f} | mtp ce "
                f"{e['mtp_ce']:.3f} acc {e['mtp_acc']:.3f} | agree {e['acceptance_proxy']:.3f}")
    jax.block_until_ready(params)
    t_end = time.perf_counter()
    done = min(total, tc.steps)
    hist["steps"] = done
    hist["train_seconds"] = t_end - t_start
    if t_timed is not None and done > timed_from:
        # Throughput over the steps after compilation (includes the periodic evals' pauses).
        hist["tokens_per_s"] = (done - timed_from) * tc.batch * tc.seq_len / (t_end - t_timed)
    params = restrict(params)
    final = evaluate(ev, params, held, eb)
    final["step"] = done
    hist["final_eval"] = final
    hist["used_vocab"] = int(used.sum())
    if vm is not None:
        hist["vocab"] = {"rows": vm.rows, "kept": len(vm.kept), "n_shared": vm.n_shared,
                         "min_count": tc.vocab_min_count, "tied_head": tc.tie_head,
                         "heldout_shared_fraction": float((corpus.heldout == shared[0]).mean())}
    log(f"final held-out ({final['tokens']:.0f} tokens): main ce {final['main_ce']:.3f} acc "
        f"{final['main_acc']:.3f} | mtp ce {final['mtp_ce']:.3f} acc {final['mtp_acc']:.3f} | "
        f"agree {final['acceptance_proxy']:.3f}")
    return params, hist


def compact_vocab(corpus: Corpus, cfg: ModelConfig, tc: TrainConfig) -> VocabMap | None:
    """The `VocabMap` training uses (None for full-vocabulary training): a function of the train split."""
    if not tc.vocab_min_count:
        return None
    return VocabMap.from_stream(corpus.train, cfg.vocab_size, tc.vocab_min_count)


def greedy_acceptance(cfg: ModelConfig, params: dict[str, Any], heldout: np.ndarray, *, prompts: int,
                      prompt_len: int, n_new: int) -> dict[str, float]:
    """Greedy k=1 MTP acceptance on the main model's own continuations of held-out prompts."""
    stride = max(1, len(heldout) // prompts - prompt_len)
    starts = np.arange(prompts) * stride
    starts = starts[starts + prompt_len <= len(heldout)]
    p = heldout[starts[:, None] + np.arange(prompt_len)].astype(np.int32)
    _, ok, n = make_greedy_acceptance(cfg, compute_dtype(), n_new)(params, jnp.asarray(p))
    return {"greedy_acceptance": float(ok) / float(n), "drafts": int(n), "prompts": len(p),
            "prompt_len": prompt_len, "new_tokens": n_new}


def ship_config(cfg: ModelConfig, train_len: int, yarn_factor: float) -> ModelConfig:
    """The config a model trained with plain RoPE over `train_len`-token windows ships with: YaRN with
    `yarn_factor` over that original context (DeepSeek-V3's pattern: original 4096, factor 40)."""
    from dsv3_jax.config import YarnScaling

    if yarn_factor <= 1:
        return cfg.replace(rope_scaling=None, max_position_embeddings=train_len)
    yarn = YarnScaling(factor=float(yarn_factor), original_max_position_embeddings=train_len)
    return cfg.replace(rope_scaling=yarn, max_position_embeddings=int(train_len * yarn_factor))


def _load_tokenizer(required: bool):
    from dsv3_jax.text.tokenizer import Tokenizer

    try:
        return Tokenizer.default()
    except (FileNotFoundError, ImportError):
        if required:
            raise
        print("tokenizer package not found: the checkpoint gets no tokenizer files", file=sys.stderr)
        return None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv3_jax.train", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small-mtp")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--time-budget", type=float, default=None, help="seconds; caps --steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus", type=Path, help="a pre-tokenized corpus .npz (else: tokenize the stdlib)")
    ap.add_argument("--save-corpus", type=Path, help="write the tokenized corpus here and exit")
    ap.add_argument("--out", type=Path, help="write the HF checkpoint directory here")
    ap.add_argument("--compact-out", type=Path, help="write the compact bf16 part files here")
    ap.add_argument("--metrics", type=Path, help="write the history / metrics JSON here")
    ap.add_argument("--greedy-prompts", type=int, default=32)
    ap.add_argument("--greedy-new", type=int, default=128)
    ap.add_argument("--from-compact", type=Path, help="skip training: rebuild --out from compact parts")
    ap.add_argument("--vocab-min-count", type=int, default=0,
                    help="compact vocabulary: own rows for tokens seen this often, one shared row")
    ap.add_argument("--tie-head", action="store_true", help="LM head rows = embedding rows (needs the above)")
    ap.add_argument("--yarn-factor", type=float, default=None,
                    help="YaRN factor over --seq-len for checkpoints written (training: plain RoPE)")
    a = ap.parse_args(argv)
    cfg = preset(a.preset)

    ship = cfg if a.yarn_factor is None else ship_config(cfg, a.seq_len, a.yarn_factor)
    if a.from_compact is not None:
        if a.out is None:
            ap.error("--from-compact needs --out")
        save_checkpoint(import_compact(a.from_compact), ship, _load_tokenizer(False), a.out,
                        max_shard_bytes=512 * 1024**2)
        print(f"wrote {a.out}")
        return 0
    if a.corpus is not None:
        corpus = Corpus.load(a.corpus)
    else:
        corpus = build_corpus(_load_tokenizer(True))
    if a.save_corpus is not None:
        corpus.save(a.save_corpus)
        print(f"corpus: {len(corpus.train)} train tokens ({corpus.n_train_files} files), "
              f"{len(corpus.heldout)} held-out ({corpus.n_heldout_files} files) -> {a.save_corpus}")
        return 0
    tc = TrainConfig(steps=a.steps, batch=a.batch, seq_len=a.seq_len, peak_lr=a.lr, warmup=a.warmup,
                     mtp_weight=a.mtp_weight, eval_every=a.eval_every, seed=a.seed, time_budget=a.time_budget,
                     vocab_min_count=a.vocab_min_count, tie_head=a.tie_head)
    print(f"{jax.devices()[0].device_kind}: {cfg.param_count(include_mtp=True) / 1e6:.1f}M params "
          f"({cfg.param_count(activated=True) / 1e6:.1f}M activated), corpus {len(corpus.train)} train / "
          f"{len(corpus.heldout)} held-out tokens", flush=True)
    params, hist = train(cfg, tc, corpus, log=lambda s: print(s, flush=True))
    vm = compact_vocab(corpus, cfg, tc)
    if a.greedy_prompts > 0:
        gcfg, held = (cfg, corpus.heldout) if vm is None else (cfg.replace(vocab_size=vm.rows),
                                                                vm.to_compact(corpus.heldout))
        g = greedy_acceptance(gcfg, params, held, prompts=a.greedy_prompts,
                              prompt_len=min(128, a.seq_len // 2), n_new=a.greedy_new)
        hist["greedy"] = g
        print(f"greedy k=1 MTP acceptance on the main model's own continuations: "
              f"{g['greedy_acceptance']:.3f} ({g['drafts']} drafts)", flush=True)
    hist.update(config=cfg.to_hf_dict(), train_config=dataclasses.asdict(tc))
    if a.metrics is not None:
        a.metrics.parent.mkdir(parents=True, exist_ok=True)
        a.metrics.write_text(json.dumps(hist, indent=2))
    if a.compact_out is not None:
        if vm is None:
            used = np.zeros(cfg.vocab_size, bool)
            used[corpus.train] = True
            files = export_compact(params, used, a.compact_out)
        else:
            files = export_compact_rows(params, vm, a.compact_out)
        print(f"compact: {len(files)} parts, {sum(f.stat().st_size for f in files) / 2**20:.1f} MiB")
    if a.out is not None:
        if vm is not None:
            with tempfile.TemporaryDirectory() as tmp:
                export_compact_rows(params, vm, tmp, dtype="float32")
                params = import_compact(tmp)
        save_checkpoint(params, ship, _load_tokenizer(False), a.out)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
