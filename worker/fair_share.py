"""Fair share of the decoding slots between clients (GenerateRequest.client: an address, or a
key digest and an address, set by the gateway).

Admission is round-robin over the clients that have requests waiting: the next slot goes to the
first waiting request of the client admitted least recently (one with nothing running counts as
never admitted). A client may hold at most `per_client` running slots, so that with the default
(3/4 of --max-running) one client's `n: 16` cannot take every slot: a second client's request
finds a slot free and starts at the next pass instead of after the first client's requests end.
Slots are never taken back from a running request (no preemption): the cap is what keeps room.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only named: `cde serve` reads default_per_client without importing torch
    from cde.worker.sequence import Sequence


def default_per_client(max_running: int) -> int:
    """3/4 of the slots, at least one: one client alone keeps most of the throughput, and a
    quarter of the slots stays for the others."""
    return max(1, max_running * 3 // 4)


class FairShare:
    def __init__(self, per_client: int | None) -> None:
        self.per_client = per_client  # None: no cap (the offline engine, benchmarks)
        self.running: Counter[str] = Counter()
        self._admitted_at: dict[str, int] = {}  # client -> admission count when it last got a slot
        self._admissions = 0

    def pick(self, waiting: Iterable[Sequence]) -> Sequence | None:
        """The request the next free slot goes to, or None when every waiting client is at its cap."""
        best, best_at = None, 0
        for seq in waiting:
            client = seq.req.client
            if self.per_client is not None and self.running[client] >= self.per_client:
                continue
            at = self._admitted_at.get(client, -1)
            if best is None or at < best_at:  # strictly: a client's first waiting request is its turn
                best, best_at = seq, at
        return best

    def admitted(self, seq: Sequence) -> None:
        self._admissions += 1
        self.running[seq.req.client] += 1
        self._admitted_at[seq.req.client] = self._admissions

    def finished(self, seq: Sequence) -> None:
        client = seq.req.client
        self.running[client] -= 1
        if self.running[client] <= 0:  # nothing running: forgotten (bounded by the running requests)
            del self.running[client]
            self._admitted_at.pop(client, None)
