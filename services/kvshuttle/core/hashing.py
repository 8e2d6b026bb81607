"""kvshuttle's prefix-hash chain over token ids.

Tokens are cut into full blocks of the engine's block size; block i's hash is
H(hash of block i-1, tokens of block i), with H = BLAKE2b-64 over the parent hash
(8 bytes, little-endian) followed by the block's tokens (uint32, little-endian). Equal
hashes at position i mean equal tokens in blocks 0..i, so the longest common run of two
chains is the verified common prefix. A trailing partial block has no hash.

A chain starts from a root: ROOT_HASH for a plain prompt, `salted_root` of the prompt's vLLM
`cache_salt` (by its SHA-256, `cache_salt_digest`) for a salted one, so chains of equal tokens
under different salts never share a hash (as vLLM's own block hashes do not), and a per-adapter
root for LoRA (`chain_root`).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

ROOT_HASH = 0
_MAX_TOKEN = 2**32 - 1
_U32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF
# The parent from which LoRA chain roots are derived; a fixed tag, so no LoRA root equals
# ROOT_HASH or a base-model block's hash (short of a 64-bit collision).
_LORA_DOMAIN = int.from_bytes(hashlib.blake2b(b"kvshuttle/lora-root/v1", digest_size=8).digest(), "little")
# Domain tags of the roots derived from a cache salt's digest (plain, and under a LoRA adapter).
_SALT_TAG = b"kvshuttle/salted-root/v1\x00"
_LORA_SALT_TAG = b"kvshuttle/lora-salted-root/v1\x00"
SALT_DIGEST_BYTES = 32
TokenIds = Sequence[int] | npt.NDArray[np.integer[Any]]
Chain = Sequence[int] | npt.NDArray[np.uint64]


def token_array(tokens: TokenIds) -> npt.NDArray[np.uint32]:
    """Token ids as a little-endian uint32 array. Raises ValueError outside uint32.

    A protobuf repeated uint32 field converts without a Python loop (upb exposes a buffer).
    """
    try:
        arr = np.asarray(tokens)
    except OverflowError as exc:
        raise ValueError("token ids must be within uint32") from exc
    if arr.size == 0:
        return np.zeros(0, dtype="<u4")
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError("token ids must be a flat list of integers")
    if arr.dtype != np.uint32 and (int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN):
        raise ValueError("token ids must be within uint32")
    return arr.astype("<u4", copy=False)


def _token_bytes(tokens: TokenIds) -> bytes:
    if isinstance(tokens, np.ndarray):
        return token_array(tokens).tobytes()
    try:
        data = array("I", tokens)  # 4 bytes on every platform CPython supports here
    except (OverflowError, TypeError) as exc:
        raise ValueError("token ids must be within uint32") from exc
    if data.itemsize != 4:  # pragma: no cover
        raise RuntimeError("array('I') is not 4 bytes wide on this platform")
    if sys.byteorder != "little":  # pragma: no cover
        data.byteswap()
    return data.tobytes()


def block_hash(parent: int, block_tokens: TokenIds) -> int:
    """Hash of one block given its parent's hash."""
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(_token_bytes(block_tokens))
    return int.from_bytes(h.digest(), "little")


def _chain_digests(tokens: TokenIds, block_size: int, parent: int) -> list[bytes]:
    """Each full block's 8-byte digest (little-endian), chained from `parent`. The parent's
    digest is carried as bytes and hashed with the block in one call: no int round trip and no
    hasher object per block (about half the time of hashing a block in two updates)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    raw = _token_bytes(tokens)
    step = block_size * 4
    blake2b = hashlib.blake2b
    prev = parent.to_bytes(8, "little")
    out: list[bytes] = []
    for start in range(0, (len(tokens) // block_size) * step, step):
        prev = blake2b(prev + raw[start : start + step], digest_size=8).digest()
        out.append(prev)
    return out


def chain_hashes(tokens: TokenIds, block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Hashes of every full block of `tokens`, chained from `parent`.

    Raises ValueError for a non-positive block size or a token outside uint32.
    """
    return [int.from_bytes(d, "little") for d in _chain_digests(tokens, block_size, parent)]


def chain_array(tokens: TokenIds, block_size: int, parent: int = ROOT_HASH) -> npt.NDArray[np.uint64]:
    """`chain_hashes` as a uint64 array, built from the digests without Python ints."""
    digests = _chain_digests(tokens, block_size, parent)
    return np.frombuffer(b"".join(digests), dtype="<u8").astype(np.uint64, copy=False)


def common_prefix_blocks(
    a: Sequence[int] | npt.NDArray[np.uint64], b: Sequence[int] | npt.NDArray[np.uint64]
) -> int:
    """Number of leading equal hashes of two chains (the verified common prefix, in blocks)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.uint64)
    y = np.asarray(b[:n], dtype=np.uint64)
    differ = np.flatnonzero(x != y)
    return int(differ[0]) if differ.size else n


def cache_salt_digest(salt: str) -> bytes:
    """SHA-256 of a vLLM `cache_salt` (UTF-8): what stands for the salt outside the engines (the
    router's PlanTurn, the agent's block events), so the salt itself never leaves them."""
    return hashlib.sha256(salt.encode()).digest()


def _salted(salt_digest: bytes) -> bool:
    """Whether a digest names a salt (b"": none). Raises ValueError for a malformed one."""
    if len(salt_digest) not in (0, SALT_DIGEST_BYTES):
        raise ValueError(f"a cache salt digest is {SALT_DIGEST_BYTES} bytes (SHA-256), or empty for none")
    return bool(salt_digest)


def _root_of(tag: bytes, payload: bytes) -> int:
    root = int.from_bytes(hashlib.blake2b(tag + payload, digest_size=8).digest(), "little")
    return root if root != ROOT_HASH else 1  # never the unsalted root, even by a 2**-64 chance


def salted_root(salt_digest: bytes) -> int:
    """The root a prompt sent with a vLLM `cache_salt` chains from, given the salt's
    `cache_salt_digest`: ROOT_HASH for b"" (no salt); otherwise BLAKE2b-64 of a domain tag and
    the digest, never ROOT_HASH, so a chain under one salt never verifies for another salt or for
    none. Raises ValueError for a digest that is neither empty nor 32 bytes.
    """
    if not _salted(salt_digest):
        return ROOT_HASH
    return _root_of(_SALT_TAG, salt_digest)


def chain_root(lora_id: int | None, salt_digest: bytes = b"") -> int:
    """The chain hash a sequence's first block chains from: ROOT_HASH for the base model,
    a per-adapter root for blocks cached under LoRA adapter `lora_id`, each salted by the
    prompt's `cache_salt` when `salt_digest` (its `cache_salt_digest`) is given.

    To look up a LoRA prompt: `chain_hashes(tokens, block_size, parent=chain_root(lora_id))`.
    """
    if lora_id is None:
        return salted_root(salt_digest)
    v = lora_id & _U64  # int64 or uint64 alike
    if _salted(salt_digest):
        return _root_of(_LORA_SALT_TAG, salt_digest + v.to_bytes(8, "little"))
    return block_hash(_LORA_DOMAIN, (v & _U32, v >> 32))
