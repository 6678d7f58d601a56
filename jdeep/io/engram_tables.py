"""Host side of DeepSeek-V4.1's Engram conditional memory (spec §5.7): the compressed token map, the
exact int64 n-gram hashing into table row ids, the per-sequence n-gram history, and the host-resident
fp8 tables gathered through memory maps.

Everything here is numpy (int64 hashing, uint8 table bytes); the device decodes the gathered rows.
Naming: `N = max_ngram_size` (n-grams of orders 2..N), `H = N - 1` (history length), `n_eng` Engram
layers, `R = (N - 1) * n_heads` row ids per token and layer, ordered order-major then head.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import Regex, Tokenizer, normalizers

from .safetensors import CheckpointReader

__all__ = [
    "LAYER_SEED_PRIME",
    "SCALE_BLOCK",
    "EngramHost",
    "EngramLayout",
    "EngramTables",
    "NgramHistory",
    "build_token_map",
    "dequant_rows",
    "hash_ids",
]

LAYER_SEED_PRIME = 10007     # multiplier seed of Engram layer l is 10007 * l (l = the model layer id)
SCALE_BLOCK = 32             # one e8m0 scale per 32 fp8 codes of a table row
_INT64_MAX = int(np.iinfo(np.int64).max)
# A private-use character (assumed absent from token texts) that carries a text that is exactly one space
# through Strip() (DeepSeek's sentinel trick).
_SENTINEL = "\ue000"


# ---------------------------------------------------------------------------- token map
def _normalizer() -> Any:
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), _SENTINEL),
        normalizers.Strip(), normalizers.Replace(_SENTINEL, " "),
    ])


def build_token_map(tokenizer_json_path: str | os.PathLike, expected_classes: int | None = None) -> np.ndarray:
    """DeepSeek's compressed token map: vocab id -> class id, int64 [V] (V = the tokenizer's full
    vocabulary, added tokens included).

    Each id is decoded alone with the raw backend tokenizer (special tokens kept) and keyed by its
    normalised text (NFKC, NFD, strip accents, lowercase, `[ \\t\\r\\n]+` -> one space, strip; a text
    that is exactly one space stays " "); an empty normalised text is keyed by the decoded text itself,
    a decoded text containing U+FFFD (a partial UTF-8 byte sequence) by the raw token string. All keys
    share one dictionary; classes are numbered in order of first appearance over ids 0, 1, 2, ...
    Raises ValueError when `expected_classes` is given and the class count differs.
    """
    tok = Tokenizer.from_file(str(tokenizer_json_path))
    norm = _normalizer()
    n_vocab = tok.get_vocab_size(with_added_tokens=True)
    texts = tok.decode_batch([[i] for i in range(n_vocab)], skip_special_tokens=False)
    classes: dict[str, int] = {}
    out = np.empty(n_vocab, np.int64)
    for i, text in enumerate(texts):
        if "\ufffd" in text:
            key = tok.id_to_token(i)
        else:
            key = norm.normalize_str(text) or text
        out[i] = classes.setdefault(key, len(classes))
    if expected_classes is not None and len(classes) != expected_classes:
        raise ValueError(f"the compressed token map of {tokenizer_json_path} has {len(classes)} classes, "
                         f"the config expects {expected_classes} (engram_compressed_vocab_size)")
    return out


# ---------------------------------------------------------------------------- layout
def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in bases:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _next_prime(start: int, used: set[int]) -> int:
    """The smallest prime >= start not in `used` (which it is added to)."""
    n = start
    while not _is_prime(n) or n in used:
        n += 1
    used.add(n)
    return n


def _multipliers(layer_id: int, max_ngram_size: int, compressed_vocab_size: int) -> tuple[int, ...]:
    """The odd multipliers M_k = 2 R_k + 1 (k = 0..N-1) of one Engram layer; R_k < B with
    B = (int64_max // compressed_vocab_size) // 2, so class * M_k < int64_max for every class."""
    bound = max(1, (_INT64_MAX // compressed_vocab_size) // 2)
    draws = np.random.default_rng(LAYER_SEED_PRIME * layer_id).integers(0, bound, size=max_ngram_size, dtype=np.int64)
    return tuple(int(r) * 2 + 1 for r in draws)


@dataclass(frozen=True)
class EngramLayout:
    """Hash geometry of every Engram layer (plain int tuples; the *_array methods return int64 arrays).

    multipliers[i][k]: odd int64 multiplier of lag k (k = 0..N-1) for Engram layer layer_ids[i].
    primes[i][o][h], offsets[i][o][h]: modulus and first table row of n-gram order o+2, head h.
    table_rows[i]: rows of layer i's table (the sum of its primes)."""

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    engram_vocab_size: int
    compressed_vocab_size: int
    pad_class: int
    multipliers: tuple[tuple[int, ...], ...]
    primes: tuple[tuple[tuple[int, ...], ...], ...]
    offsets: tuple[tuple[tuple[int, ...], ...], ...]
    table_rows: tuple[int, ...]

    @classmethod
    def create(cls, layer_ids: Sequence[int], max_ngram_size: int, n_heads: int, engram_vocab_size: int,
               compressed_vocab_size: int, pad_class: int) -> EngramLayout:
        """Derive multipliers, primes and offsets as DeepSeek's EngramLayout does: primes are taken
        walking layer -> order 2..N -> head, each the next unused prime >= engram_vocab_size."""
        if max_ngram_size < 2 or n_heads < 1 or compressed_vocab_size < 1:
            raise ValueError(f"bad Engram sizes: max_ngram_size {max_ngram_size}, n_heads {n_heads}, "
                             f"compressed_vocab_size {compressed_vocab_size}")
        if not 0 <= pad_class < compressed_vocab_size:
            raise ValueError(f"pad class {pad_class} is outside [0, {compressed_vocab_size})")
        used: set[int] = set()
        primes, offsets, rows = [], [], []
        for _ in layer_ids:
            p = [[_next_prime(engram_vocab_size, used) for _ in range(n_heads)] for _ in range(max_ngram_size - 1)]
            flat = [q for order in p for q in order]
            starts = np.concatenate([[0], np.cumsum(flat[:-1])]).tolist()
            primes.append(tuple(tuple(order) for order in p))
            offsets.append(tuple(tuple(starts[o * n_heads:(o + 1) * n_heads]) for o in range(max_ngram_size - 1)))
            rows.append(sum(flat))
        mults = tuple(_multipliers(layer, max_ngram_size, compressed_vocab_size) for layer in layer_ids)
        return cls(tuple(int(x) for x in layer_ids), max_ngram_size, n_heads, engram_vocab_size,
                   compressed_vocab_size, pad_class, mults, tuple(primes), tuple(offsets), tuple(rows))

    @classmethod
    def from_config(cls, text_config: Mapping[str, Any], token_map: np.ndarray) -> EngramLayout:
        """From a V4.1 HF `text_config` (or ModelArgs-style) mapping; the pad class is
        token_map[engram_pad_token_id]. Checks the table rows against engram_num_embeddings."""
        pad_id = text_config.get("engram_pad_token_id", text_config.get("engram_pad_id"))
        layout = cls.create(text_config["engram_layer_ids"], text_config["engram_max_ngram_size"],
                            text_config["engram_n_heads"], text_config["engram_vocab_size"],
                            text_config["engram_compressed_vocab_size"], int(token_map[pad_id]))
        if "engram_num_embeddings" in text_config:
            layout.check_rows(text_config["engram_num_embeddings"])
        return layout

    @property
    def history(self) -> int:
        """H = N - 1 class ids of look-back per sequence."""
        return self.max_ngram_size - 1

    @property
    def ids_per_layer(self) -> int:
        """R = (N - 1) * n_heads row ids per token and Engram layer."""
        return (self.max_ngram_size - 1) * self.n_heads

    def multipliers_array(self) -> np.ndarray:
        """int64 [n_eng, N]."""
        return np.asarray(self.multipliers, np.int64)

    def primes_array(self) -> np.ndarray:
        """int64 [n_eng, N-1, n_heads]."""
        return np.asarray(self.primes, np.int64)

    def offsets_array(self) -> np.ndarray:
        """int64 [n_eng, N-1, n_heads]."""
        return np.asarray(self.offsets, np.int64)

    def check_rows(self, num_embeddings: Sequence[int]) -> None:
        """Raise ValueError unless the derived table rows equal `num_embeddings` (engram_num_embeddings)."""
        if tuple(int(n) for n in num_embeddings) != self.table_rows:
            raise ValueError(f"Engram table rows derived from the layout ({list(self.table_rows)} for layers "
                             f"{list(self.layer_ids)}) differ from engram_num_embeddings {list(num_embeddings)}: "
                             f"check engram_vocab_size, engram_n_heads and engram_max_ngram_size")


# ---------------------------------------------------------------------------- hashing
def _hash_windows(layout: EngramLayout, windows: np.ndarray) -> np.ndarray:
    """windows int64 [..., N] with windows[..., k] = c_{t-k} -> row ids int64 [..., n_eng, R].

    p_k = c_{t-k} * M_k, h_n = p_0 ^ ... ^ p_{n-1}, id = (h_n mod prime) + offset. Classes are in
    [0, compressed_vocab_size), so every product and XOR is non-negative and below int64_max."""
    w = np.asarray(windows, np.int64)
    if w.size and (w.min() < 0 or w.max() >= layout.compressed_vocab_size):
        raise ValueError(f"Engram class ids must lie in [0, {layout.compressed_vocab_size}), "
                         f"got range [{w.min()}, {w.max()}]")
    prods = w[..., None, :] * layout.multipliers_array()             # [..., n_eng, N]
    mixes = np.bitwise_xor.accumulate(prods, axis=-1)[..., 1:]        # [..., n_eng, N-1]: orders 2..N
    ids = mixes[..., None] % layout.primes_array() + layout.offsets_array()
    return ids.reshape(ids.shape[:-2] + (layout.ids_per_layer,))


def _windows(full: np.ndarray, history: int, length: int) -> np.ndarray:
    """full [B, H + S] -> [B, S, H + 1] with out[b, t, k] = full[b, H + t - k]."""
    return np.stack([full[:, history - k: history - k + length] for k in range(history + 1)], axis=-1)


def hash_ids(layout: EngramLayout, classes: np.ndarray) -> np.ndarray:
    """Row ids of a chunk: classes int64 [B, S + H] (the H = N-1 history class ids, then the S chunk
    class ids; use pad_class before the sequence start) -> int64 [B, S, n_eng, R], order-major then
    head, table offsets included."""
    classes = np.asarray(classes, np.int64)
    if classes.ndim != 2 or classes.shape[1] < layout.history:
        raise ValueError(f"classes must be [B, S + {layout.history}], got shape {classes.shape}")
    return _hash_windows(layout, _windows(classes, layout.history, classes.shape[1] - layout.history))


class NgramHistory:
    """Per-sequence Engram state for B sequence slots: the last H = N-1 class ids of each sequence and
    whether each of those tokens was dead (inside an image span). A fresh or reset slot holds pad
    classes (the sequence start) and no dead tokens.

    Dead tokens: for position t, c_{t-k} becomes pad when any of the tokens t-k..t is dead, i.e.
    walking back from t the first dead token and everything behind it read as pad (the blocking
    propagates to larger k; a dead token itself reads as pad, so all of its own n-grams are pad-only).
    The dead flags of the history travel across chunks like the classes, so chunking never changes ids."""

    def __init__(self, layout: EngramLayout, token_map: np.ndarray, batch: int):
        self.layout = layout
        self.token_map = np.asarray(token_map, np.int64)
        if self.token_map.size and (self.token_map.min() < 0 or self.token_map.max() >= layout.compressed_vocab_size):
            raise ValueError(f"token map classes fall outside [0, {layout.compressed_vocab_size})")
        self.classes = np.full((batch, layout.history), layout.pad_class, np.int64)   # [B, H], oldest first
        self.dead = np.zeros((batch, layout.history), bool)                            # [B, H]

    @property
    def batch(self) -> int:
        return self.classes.shape[0]

    def reset(self, rows: Sequence[int] | np.ndarray | None = None) -> None:
        """Start the sequences in `rows` (all rows when None) afresh."""
        sel = slice(None) if rows is None else np.asarray(rows, np.int64)
        self.classes[sel] = self.layout.pad_class
        self.dead[sel] = False

    def _token_classes(self, tokens: np.ndarray) -> np.ndarray:
        tokens = np.asarray(tokens, np.int64)
        n_vocab = self.token_map.shape[0]
        if tokens.size and (tokens.min() < 0 or tokens.max() >= n_vocab):
            raise ValueError(f"token ids must lie in [0, {n_vocab}), got range [{tokens.min()}, {tokens.max()}]")
        return self.token_map[tokens]

    def _chunk(self, tokens, n_valid, dead) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A chunk's (classes int64 [B, S], n_valid int64 [B] (default S), dead bool [B, S]), validated."""
        batch, cls = self.batch, self._token_classes(tokens)
        if cls.ndim != 2 or cls.shape[0] != batch:
            raise ValueError(f"tokens must be [{batch}, S], got shape {cls.shape}")
        length = cls.shape[1]
        n_valid = np.full(batch, length, np.int64) if n_valid is None else np.asarray(n_valid, np.int64)
        if n_valid.shape != (batch,) or n_valid.min(initial=0) < 0 or n_valid.max(initial=0) > length:
            raise ValueError(f"n_valid must be [{batch}] ints in [0, {length}], got {n_valid}")
        dead = np.zeros(cls.shape, bool) if dead is None else np.asarray(dead, bool)
        if dead.shape != cls.shape:
            raise ValueError(f"dead must have the tokens' shape {cls.shape}, got {dead.shape}")
        return cls, n_valid, dead

    def ids_for_chunk(self, tokens: np.ndarray, n_valid: np.ndarray | Sequence[int] | None = None,
                      dead: np.ndarray | None = None) -> np.ndarray:
        """Row ids for a chunk of new tokens and advance each row's history by its real tokens.

        tokens int [B, S]: row b has n_valid[b] (int [B], default S) real tokens at the front, the
        rest padding (any in-range ids; their row ids are computed but meaningless).
        dead bool [B, S] (optional): tokens inside an image span.
        Returns int64 [B, S, n_eng, R]."""
        cls, n_valid, dead = self._chunk(tokens, n_valid, dead)
        h, length = self.layout.history, cls.shape[1]
        full = np.concatenate([self.classes, cls], axis=1)              # [B, H + S]
        full_dead = np.concatenate([self.dead, dead], axis=1)
        win = _windows(full, h, length)                                  # [B, S, N]
        blocked = np.logical_or.accumulate(_windows(full_dead, h, length), axis=-1)
        ids = _hash_windows(self.layout, np.where(blocked, self.layout.pad_class, win))
        self._keep_last(full, full_dead, n_valid)
        return ids

    def advance(self, tokens: np.ndarray, n_valid: np.ndarray | Sequence[int], dead: np.ndarray | None = None) -> None:
        """Advance each row's history as ids_for_chunk does, without row ids (the tokens a speculative step kept)."""
        cls, n_valid, dead = self._chunk(tokens, n_valid, dead)
        self._keep_last(np.concatenate([self.classes, cls], 1), np.concatenate([self.dead, dead], 1), n_valid)

    def _keep_last(self, full: np.ndarray, full_dead: np.ndarray, n_valid: np.ndarray) -> None:
        keep = n_valid[:, None] + np.arange(self.layout.history)         # the last H real entries
        self.classes, self.dead = np.take_along_axis(full, keep, axis=1), np.take_along_axis(full_dead, keep, axis=1)

    def copy(self) -> "NgramHistory":
        """An independent copy (speculative decoding reads draft tokens' rows from one, rejected drafts leave none)."""
        out = copy.copy(self)
        out.classes, out.dead = self.classes.copy(), self.dead.copy()
        return out


# ---------------------------------------------------------------------------- tables
def _find_view(source: Any, name: str) -> tuple[Any, Any]:
    """(SafetensorsFile holding `name`, its header entry) in a CheckpointReader."""
    for f in source.files.values():
        if name in f.entries:
            return f, f.entries[name]
    raise ValueError(f"Engram tensor {name!r} is missing from the checkpoint {source.folder}")


class EngramTables:
    """The Engram tables `layers.{L}.engram.embed.weight` (F8_E4M3 [rows, head_dim]) and `.scale`
    (F8_E8M0 [rows, head_dim/32]; U8 accepted for either) of each Engram layer, kept on the host as
    read-only memory maps.

    source: a jdeep.io.safetensors.CheckpointReader or a checkpoint folder. With `layout`, each table's rows
    must equal layout.table_rows. Only the pages of gathered rows are ever read."""

    def __init__(self, source: CheckpointReader | str | os.PathLike, layer_ids: Sequence[int],
                 layout: EngramLayout | None = None):
        if isinstance(source, (str, os.PathLike)):
            source = CheckpointReader(str(source))
        self.layer_ids = tuple(int(x) for x in layer_ids)
        if layout is not None and layout.layer_ids != self.layer_ids:
            raise ValueError(f"Engram layers {list(self.layer_ids)} differ from the layout's {list(layout.layer_ids)}")
        self.codes: list[np.ndarray] = []    # uint8 [rows, head_dim] per layer
        self.scales: list[np.ndarray] = []   # uint8 [rows, head_dim // 32] per layer
        for i, layer in enumerate(self.layer_ids):
            codes, scales = self._open_layer(source, layer)
            if layout is not None and codes.shape[0] != layout.table_rows[i]:
                raise ValueError(f"tensor 'layers.{layer}.engram.embed.weight' has {codes.shape[0]} rows, the Engram "
                                 f"layout expects {layout.table_rows[i]}")
            if self.codes and codes.shape[1] != self.codes[0].shape[1]:
                raise ValueError(f"tensor 'layers.{layer}.engram.embed.weight' has head_dim {codes.shape[1]}, "
                                 f"layer {self.layer_ids[0]}'s has {self.codes[0].shape[1]}")
            self.codes.append(codes)
            self.scales.append(scales)

    @staticmethod
    def _open_layer(source: Any, layer: int) -> tuple[np.ndarray, np.ndarray]:
        wname, sname = f"layers.{layer}.engram.embed.weight", f"layers.{layer}.engram.embed.scale"
        wfile, w = _find_view(source, wname)
        sfile, s = _find_view(source, sname)
        # U8 (raw bytes) is accepted too, as jdeep.io.checkpoint.validate_checkpoint does
        if w.dtype not in ("F8_E4M3", "U8") or len(w.shape) != 2 or w.shape[1] % SCALE_BLOCK:
            raise ValueError(f"tensor {wname!r} must be F8_E4M3 [rows, head_dim] with head_dim a multiple of "
                             f"{SCALE_BLOCK}, got {w.dtype} {list(w.shape)}")
        want = [w.shape[0], w.shape[1] // SCALE_BLOCK]
        if s.dtype not in ("F8_E8M0", "U8") or list(s.shape) != want:
            raise ValueError(f"tensor {sname!r} must be F8_E8M0 {want}, got {s.dtype} {list(s.shape)}")
        return wfile.view(wname, random_access=True), sfile.view(sname, random_access=True)

    @property
    def head_dim(self) -> int:
        return self.codes[0].shape[1]

    def gather(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """ids int64 [B, S, n_eng, R] -> (codes uint8 [n_eng, B, S, R, head_dim],
        scales uint8 [n_eng, B, S, R, head_dim // 32]): raw fp8 e4m3fn codes and e8m0 exponent bytes."""
        ids = np.asarray(ids, np.int64)
        if ids.ndim != 4 or ids.shape[2] != len(self.layer_ids):
            raise ValueError(f"ids must be [B, S, {len(self.layer_ids)}, R], got shape {ids.shape}")
        lead = (len(self.layer_ids),) + ids.shape[:2] + ids.shape[3:]
        codes = np.empty(lead + (self.head_dim,), np.uint8)
        scales = np.empty(lead + (self.head_dim // SCALE_BLOCK,), np.uint8)
        for i, layer in enumerate(self.layer_ids):
            rows = ids[:, :, i, :]
            n_rows = self.codes[i].shape[0]
            if rows.size and (rows.min() < 0 or rows.max() >= n_rows):
                raise ValueError(f"Engram layer {layer}: row ids must lie in [0, {n_rows}), "
                                 f"got range [{rows.min()}, {rows.max()}]")
            np.take(self.codes[i], rows, axis=0, out=codes[i])
            np.take(self.scales[i], rows, axis=0, out=scales[i])
        return codes, scales


# ---------------------------------------------------------------------------- reference decode
def _e4m3fn_values() -> np.ndarray:
    """float64 [256]: the OCP e4m3fn value of every code (bias 7, no infinities, 0x7F/0xFF NaN)."""
    code = np.arange(256)
    sign = np.where(code & 0x80, -1.0, 1.0)
    exp, mant = (code >> 3) & 0xF, code & 0x7
    mag = np.where(exp == 0, mant / 8.0 * 2.0 ** -6, (1.0 + mant / 8.0) * 2.0 ** (exp - 7.0))
    return np.where((code & 0x7F) == 0x7F, np.nan, sign * mag)


def dequant_rows(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Reference decode of gathered rows (float64 math, for tests): codes uint8 [..., D] (e4m3fn),
    scales uint8 [..., D // 32] (e8m0: 2^(s - 127), 255 = NaN) -> float32 [..., D]."""
    codes, scales = np.asarray(codes, np.uint8), np.asarray(scales, np.uint8)
    exps = scales.astype(np.float64)
    mult = np.where(scales == 255, np.nan, np.exp2(exps - 127.0))
    values = _e4m3fn_values()[codes] * np.repeat(mult, SCALE_BLOCK, axis=-1)
    return values.astype(np.float32)



# ---------------------------------------------------------------------------- per-model bundle
class EngramHost:
    """What a model with Engram layers keeps on the host: the layout (hash geometry), the compressed
    token map and the memory-mapped tables. `rows` turns a chunk of tokens into the device inputs of
    `model_step(..., engram=...)`."""

    def __init__(self, layout: EngramLayout, token_map: np.ndarray, tables: EngramTables):
        self.layout, self.token_map, self.tables = layout, np.asarray(token_map, np.int64), tables

    @classmethod
    def load(cls, folder: str | os.PathLike, config: Any, source: CheckpointReader | None = None) -> "EngramHost":
        """From a checkpoint folder holding tokenizer.json and the tables; config: jdeep EngramConfig."""
        tok = os.path.join(os.fspath(folder), "tokenizer.json")
        if not os.path.isfile(tok):
            raise FileNotFoundError(f"{folder} has Engram layers but no tokenizer.json: Engram hashes token classes "
                                    "built from the tokenizer (model-spec.md §5.7)")
        token_map = build_token_map(tok, config.compressed_vocab_size)
        if not 0 <= config.pad_id < token_map.shape[0]:
            raise ValueError(f"engram_pad_token_id {config.pad_id} is outside the tokenizer's {token_map.shape[0]} ids")
        layout = EngramLayout.create(config.layer_ids, config.max_ngram_size, config.n_heads, config.vocab_size,
                                     config.compressed_vocab_size, int(token_map[config.pad_id]))
        layout.check_rows(config.num_embeddings)
        return cls(layout, token_map, EngramTables(source if source is not None else folder, config.layer_ids, layout))

    def history(self, batch: int) -> NgramHistory:
        """Fresh per-sequence n-gram histories for `batch` sequence slots."""
        return NgramHistory(self.layout, self.token_map, batch)

    def rows(self, history: NgramHistory, tokens: np.ndarray, n_valid: np.ndarray,
             dead: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """tokens int [B, S] with n_valid [B] real tokens at the front of each row (dead bool [B, S]: image
        tokens) -> (codes uint8 [n_eng, B, S, R, hd], scales uint8 [n_eng, B, S, R, hd/32]); advances the
        histories."""
        return self.tables.gather(history.ids_for_chunk(tokens, n_valid, dead))
