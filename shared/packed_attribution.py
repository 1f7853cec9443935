"""The attribution of a request's committed tokens as packed little-endian arrays: what the worker
sends with a block (or a denoising step) and the gateway aggregates, without a Python object per
token or per concept on either side.

`PackedAttribution` holds, for n tokens, one typed buffer per field (a msgpack bin each on the
wire): the token ids, positions and denoising steps (int32 [n]), the target logit and epsilon
(float64 [n]), and per head the concept ids (int32 [n, k]), weights and contributions (float64
[n, k]), k being what the head reports per token (`k_known`, `k_discovered`). The floats are the
device's float64 values, so every number the API renders is the one the per-token dicts carried.

The wire decoder checks a frame's arrays against n and the ks (`check`), like every other
message's fields. Iterating yields the per-token record dicts of the old wire format
(`{"token_id", "position", "step", "target_logit", "epsilon", "known": [[id, weight,
contribution], ...], "discovered": [...]}`), for the per-token views and for tests.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields

import numpy as np

INT = np.dtype("<i4")
FLOAT = np.dtype("<f8")
MAX_K = 1 << 16  # concepts per token per head a peer may declare (the 8B reports 32 and 128)

# field -> (dtype, per-token width: None for one value, else the name of the k field)
_LAYOUT: dict[str, tuple[np.dtype, str | None]] = {
    "token_ids": (INT, None),
    "positions": (INT, None),
    "steps": (INT, None),
    "target_logits": (FLOAT, None),
    "epsilon": (FLOAT, None),
    "known_ids": (INT, "k_known"),
    "known_weights": (FLOAT, "k_known"),
    "known_contributions": (FLOAT, "k_known"),
    "discovered_ids": (INT, "k_discovered"),
    "discovered_weights": (FLOAT, "k_discovered"),
    "discovered_contributions": (FLOAT, "k_discovered"),
}
HEADS = ("known", "discovered")


@dataclass
class PackedAttribution:
    """The attribution of n committed tokens of one request (see the module's docstring)."""

    k_known: int
    k_discovered: int
    token_ids: bytes = b""
    positions: bytes = b""
    steps: bytes = b""
    target_logits: bytes = b""
    epsilon: bytes = b""
    known_ids: bytes = b""
    known_weights: bytes = b""
    known_contributions: bytes = b""
    discovered_ids: bytes = b""
    discovered_weights: bytes = b""
    discovered_contributions: bytes = b""

    # ---- building -------------------------------------------------------------------------------
    @classmethod
    def from_arrays(cls, k_known: int, k_discovered: int, **arrays: np.ndarray) -> PackedAttribution:
        """From numpy arrays named as the fields (any numeric dtype; converted)."""
        return cls(
            k_known,
            k_discovered,
            **{name: np.ascontiguousarray(arrays[name], dtype=dtype).tobytes() for name, (dtype, _) in _LAYOUT.items()},
        )

    @classmethod
    def from_rows(
        cls,
        rows: np.ndarray,
        token_ids: np.ndarray,
        positions: np.ndarray,
        steps: int | np.ndarray,
        k_known: int,
        k_discovered: int,
    ) -> PackedAttribution:
        """From the device's packed float64 rows [n, 2 + 3 k_known + 3 k_discovered] (target,
        epsilon, then per head ids, weights, contributions: `concept_contributions.attribute`);
        `steps`: every token's denoising step, or one for all."""
        kk, ku, u = k_known, k_discovered, 2 + 3 * k_known
        return cls.from_arrays(
            kk,
            ku,
            token_ids=token_ids,
            positions=positions,
            steps=np.broadcast_to(steps, len(token_ids)),
            target_logits=rows[:, 0],
            epsilon=rows[:, 1],
            known_ids=rows[:, 2 : 2 + kk],
            known_weights=rows[:, 2 + kk : 2 + 2 * kk],
            known_contributions=rows[:, 2 + 2 * kk : u],
            discovered_ids=rows[:, u : u + ku],
            discovered_weights=rows[:, u + ku : u + 2 * ku],
            discovered_contributions=rows[:, u + 2 * ku : u + 3 * ku],
        )

    @classmethod
    def from_records(cls, records: list[dict]) -> PackedAttribution:
        """From per-token record dicts (the old wire format; tests and the reference's shapes)."""
        kk = len(records[0]["known"]) if records else 0
        ku = len(records[0]["discovered"]) if records else 0

        def column(head: str, col: int, k: int) -> np.ndarray:
            return np.array([[e[col] for e in r[head]] for r in records], dtype=float).reshape(len(records), k)

        return cls.from_arrays(
            kk,
            ku,
            token_ids=np.array([r["token_id"] for r in records]),
            positions=np.array([r["position"] for r in records]),
            steps=np.array([r.get("step", 0) for r in records]),
            target_logits=np.array([r["target_logit"] for r in records], dtype=float),
            epsilon=np.array([r["epsilon"] for r in records], dtype=float),
            **{
                f"{head}_{name}": column(head, col, k)
                for head, k in (("known", kk), ("discovered", ku))
                for col, name in enumerate(("ids", "weights", "contributions"))
            },
        )

    @classmethod
    def join(cls, parts: Iterable[PackedAttribution]) -> PackedAttribution:
        """The tokens of several parts (of one request: the same ks), in order."""
        parts = list(parts)
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        return cls(
            first.k_known,
            first.k_discovered,
            **{name: b"".join(getattr(p, name) for p in parts) for name in _LAYOUT},
        )

    def take(self, index: np.ndarray | slice) -> PackedAttribution:
        """The tokens at `index` (an integer array or a slice over the n tokens), in its order."""
        a = self.arrays()
        return PackedAttribution.from_arrays(self.k_known, self.k_discovered, **{n: a[n][index] for n in _LAYOUT})

    def head(self, n: int) -> PackedAttribution:
        """The first n tokens (in the order they were committed)."""
        return self if n >= len(self) else self.take(slice(0, n))

    def kept(self, positions: set[int]) -> PackedAttribution:
        """The tokens at these positions, in position order."""
        pos = self.arrays()["positions"]
        inside = np.flatnonzero(np.isin(pos, np.fromiter(positions, dtype=np.int64, count=len(positions))))
        return self.take(inside[np.argsort(pos[inside], kind="stable")])

    # ---- reading --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.token_ids) // INT.itemsize

    def __eq__(self, other: object) -> bool:
        """Equal to the same arrays, or to the list of its per-token record dicts."""
        if isinstance(other, list):
            return self.records() == other
        if not isinstance(other, PackedAttribution):
            return NotImplemented
        return all(getattr(self, f.name) == getattr(other, f.name) for f in fields(self))

    __hash__ = None  # type: ignore[assignment]  # mutable, like every message

    def __bool__(self) -> bool:
        return True  # present, even with no token (None means "not asked")

    def arrays(self) -> dict[str, np.ndarray]:
        """The fields as read-only numpy arrays ([n] or [n, k]); cached."""
        cached = self.__dict__.get("_arrays")
        if cached is None:
            n = len(self)
            cached = {}
            for name, (dtype, k) in _LAYOUT.items():
                a = np.frombuffer(getattr(self, name), dtype=dtype)
                cached[name] = a if k is None else a.reshape(n, getattr(self, k))
            self.__dict__["_arrays"] = cached
        return cached

    def check(self) -> None:
        """ValueError unless every buffer holds n values (n [n, k] for the heads) of its dtype."""
        for k in (self.k_known, self.k_discovered):
            if type(k) is not int or not 0 <= k <= MAX_K:
                raise ValueError(f"a concept count per token must be in [0, {MAX_K}], not {k!r}")
        if len(self.token_ids) % INT.itemsize:
            raise ValueError("token_ids is not a whole number of int32")
        n = len(self)
        for name, (dtype, k) in _LAYOUT.items():  # type: ignore[assignment]  # `k` was an int above
            want = n * dtype.itemsize * (1 if k is None else getattr(self, k))  # type: ignore[call-overload]
            if len(getattr(self, name)) != want:
                raise ValueError(f"{name} holds {len(getattr(self, name))} bytes, not {want} ({n} tokens)")

    def __iter__(self) -> Iterator[dict]:
        """The per-token record dicts, in order (plain ints and floats)."""
        a = self.arrays()
        lists = {name: a[name].tolist() for name in _LAYOUT}
        for i in range(len(self)):
            yield {
                "token_id": lists["token_ids"][i],
                "position": lists["positions"][i],
                "step": lists["steps"][i],
                "target_logit": lists["target_logits"][i],
                "epsilon": lists["epsilon"][i],
                **{
                    head: [
                        [c, w, v]
                        for c, w, v in zip(
                            lists[f"{head}_ids"][i], lists[f"{head}_weights"][i], lists[f"{head}_contributions"][i]
                        )
                    ]
                    for head in HEADS
                },
            }

    def records(self) -> list[dict]:
        return list(self)
