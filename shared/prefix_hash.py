"""The keys of full 64-token prompt pages: a hash chain over their token ids (no torch; the worker's
prefix cache and the gateway's prefix routing both use it).

Page b's key is a digest of page b-1's key and page b's 64 token ids, so equal keys mean equal
token ids from position 0 to the page's end: under block-causal attention, the same K/V. The root
is a digest of what else the K/V depend on (the worker passes its model, dtype and quantization).
BLAKE2b with a 32-byte digest: a client cannot craft a prompt whose key collides with another's
(64-bit hashes such as Python's hash() could be searched for a collision)."""

from __future__ import annotations

import hashlib
import struct

from cde.shared.config import PAGE

KEY_BYTES = 32


def root_key(namespace: str) -> bytes:
    return hashlib.blake2b(namespace.encode(), digest_size=KEY_BYTES).digest()


def page_keys(token_ids: list[int], n_pages: int, namespace: str = "") -> list[bytes]:
    """The keys of the first `n_pages` pages of `token_ids`: full pages, the caller's to count
    (shared.config.PAGE tokens each)."""
    keys, parent = [], root_key(namespace)
    for b in range(n_pages):
        page = token_ids[b * PAGE : (b + 1) * PAGE]
        # little-endian int32: the same key on every machine
        parent = hashlib.blake2b(parent + struct.pack(f"<{len(page)}i", *page), digest_size=KEY_BYTES).digest()
        keys.append(parent)
    return keys
