"""The GEMM picks' file under CDE_HOME (worker/gemm_tuning_cache.py): shared by worker processes
that tune at the same time (one per GPU of a machine), it loses no process's pick; where it cannot
be written, nothing is kept and nothing fails. (tests/worker/test_gemm_tuning.py covers its use.)"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from cde.worker.gemm_tuning_cache import Pick, TuningCache

KEYS = 60


def _keep_picks(path: str, worker: int) -> None:
    cache = TuningCache(Path(path))
    for i in range(KEYS):
        cache.put(f"worker {worker} shape {i}", Pick({"BLOCK_N": 64, "i": i}, float(i)))


def test_workers_keeping_picks_at_once_lose_none(tmp_path: Path) -> None:
    path = tmp_path / "gemm-tuning" / "gpu.json"
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_keep_picks, args=(str(path), w)) for w in range(4)]
    for p in workers:
        p.start()
    for p in workers:
        p.join(60)
        assert p.exitcode == 0
    cache = TuningCache(path)
    missing = [(w, i) for w in range(4) for i in range(KEYS) if cache.get(f"worker {w} shape {i}") is None]
    assert missing == []
    assert cache.get("worker 3 shape 7") == Pick({"BLOCK_N": 64, "i": 7}, 7.0)
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".tmp-")] == []


def test_a_home_that_cannot_be_written_keeps_nothing_and_raises_nothing(tmp_path: Path, caplog) -> None:
    """A CDE_HOME the worker cannot write (read-only, or here a file where its folder should be):
    the pick holds for the process only, with a warning; serving goes on."""
    blocker = tmp_path / "home"
    blocker.write_text("not a folder")
    cache = TuningCache(blocker / "gemm-tuning" / "gpu.json")
    cache.put("c_attn", Pick({"BLOCK_N": 64}, 1.0))
    assert cache.get("c_attn") is None
    assert "cannot keep the pick" in caplog.text
