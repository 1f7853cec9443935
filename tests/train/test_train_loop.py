"""The training program on a tiny shape: loss falls, a run is a function of its seed, and a run
stopped and resumed ends with the same weights as one that ran straight through."""

import json
import shutil

import torch

from cde.train.loop import Options, train
from cde.train.program import main, model_config


def _run(out, seed=0, steps=6, stop_step=None, resume=False, weights=None, **kw):
    o = Options(
        out=str(out),
        config=model_config("mini"),
        seed=seed,
        steps=steps,
        stop_step=stop_step,
        rows=4,
        length=128,
        warmup=2,
        lr=3e-3,
        log_every=kw.pop("log_every", 3),
        eval_problems=0,
        **kw,
    )
    train(o, resume=resume, weights=weights)
    return torch.load(out / "state.pt", weights_only=False)


def _same(a, b):
    return all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_loss_falls(tmp_path):
    _run(tmp_path, steps=40, log_every=10)
    logs = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    lm = [r["lm"] for r in logs if "lm" in r]
    assert len(lm) == 4 and lm[-1] < lm[0] - 1.0, lm
    assert (tmp_path / "model" / "config.json").is_file() and (tmp_path / "model.tar.xz").is_file()


def test_seeded_and_resumable(tmp_path):
    straight = _run(tmp_path / "a")
    _run(tmp_path / "b", stop_step=3)
    shutil.copy(tmp_path / "b" / "weights.pt", tmp_path / "w3.pt")
    assert json.loads((tmp_path / "b" / "log.jsonl").read_text().splitlines()[-1])["budget_spent"] is False
    resumed = _run(tmp_path / "b", resume=True)
    assert straight["step"] == resumed["step"] == 6
    assert _same(straight, resumed)
    assert not _same(straight, _run(tmp_path / "c", seed=1))
    # On a fresh machine only the small weights.pt travels: the schedule continues from its step.
    moved = _run(tmp_path / "d", weights=str(tmp_path / "w3.pt"))
    assert moved["step"] == 6 and moved["warm_from"] == 3
    logged = [json.loads(line) for line in (tmp_path / "d" / "log.jsonl").read_text().splitlines()]
    assert logged[0]["start_step"] == 3 and logged[1]["step"] == 6


def test_command_line(tmp_path):
    assert (
        main(
            [
                "--out",
                str(tmp_path),
                "--shape",
                "mini",
                "--steps",
                "2",
                "--rows",
                "2",
                "--length",
                "128",
                "--eval-problems",
                "0",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "options.json").read_text())["config"]["n_layers"] == 2


def test_a_failing_compile_falls_back_to_eager(tmp_path, monkeypatch):
    def broken(fn, **options):
        def run(*args):
            raise RuntimeError("inductor exploded")

        return run

    monkeypatch.setattr(torch, "compile", broken)
    state = _run(tmp_path, steps=2, compile=True)
    assert state["step"] == 2
    logged = (tmp_path / "log.jsonl").read_text()
    assert "inductor exploded" in logged and '"continuing": "eager"' in logged
