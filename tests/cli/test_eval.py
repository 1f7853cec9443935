"""`cde eval` on a tiny trained checkpoint: every section runs in process, the API path measures
the same thing (same replies, same tokens per pass) through a real server; and CI's slice of the
eval on the shipped model, with its floors."""

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
from cde.shared.settings import EngineArgs
from cde.worker.engine import Engine

from cde.cli import main
from cde.train import heldout
from cde.train.loop import Options, train
from cde.train.program import model_config
from tests.api_server import REPO, ServerProcess


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A few steps of the training program: the tests below run `cde eval` on its exported
    checkpoint and assert no quality (the floors are the shipped model's test's)."""
    out = tmp_path_factory.mktemp("run")
    train(
        Options(
            out=str(out),
            config=model_config("mini"),
            steps=4,
            rows=4,
            length=128,
            warmup=2,
            lr=3e-3,
            log_every=2,
            eval_problems=0,
        )
    )
    return out / "model"


def _eval(capsys, tmp_path, *args):
    path = tmp_path / "eval.json"
    assert main(["eval", *args, "--limit", "1", "--json", str(path)]) == 0
    return capsys.readouterr().out, json.loads(path.read_text())


@pytest.fixture(scope="module")
def every_section(trained, tmp_path_factory):
    """One in-process run of every section on the trained checkpoint, shared by the tests below:
    its first task row ("one token per step") is the engine's side of the API and training-log
    comparisons (the rows run one after the other, each its own batch on the same engine)."""
    path = tmp_path_factory.mktemp("every_section") / "eval.json"
    args = ["--model", str(trained), "--settings", "one token per step,tokens_per_step 2", "--strengths", "0,8"]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["eval", *args, "--limit", "1", "--json", str(path)]) == 0
    return out.getvalue(), json.loads(path.read_text())


def test_every_section_in_process(every_section):
    text, report = every_section
    assert "| one token per step |" in text and "| tokens_per_step 2 |" in text
    one, two = report["tasks"]
    assert one["setting"] == "one token per step" and two["setting"] == "tokens_per_step 2"
    assert set(one["accuracy"]) == {"arithmetic", "sorting", "reversal", "word_problem"}
    assert one["tokens_per_step"] == 1.0 and 1.5 < two["tokens_per_step"] <= 2.0
    assert [r["strength"] for r in report["amplify"]] == [0.0, 8.0]
    assert all(0 <= r["repeated_3grams"] <= 1 and r["masked_token_loss"] > 0 for r in report["amplify"])
    assert "per unit of strength" in text and isinstance(report["logits_per_strength"], float)
    assert 0 <= report["suppress"]["baseline"] <= 1
    unsteered, steered = report["attribution"]
    assert unsteered["strength"] == 0 and steered["strength"] == 8.0  # below 80% on topic: the strongest
    assert unsteered["chunks"] > 0 and 0 <= unsteered["top_is_topic"] <= unsteered["topic_in_top3"] <= 1
    faithful = report["faithfulness"]
    assert faithful["positions"] > 0 and 0 <= faithful["injection"]["top_beats_other"] <= 1
    # The preset's logit mask only takes more off: its drops are at least its injection's.
    assert faithful["drop_top"] >= faithful["injection"]["drop_top"]
    assert faithful["drop_other"] >= faithful["injection"]["drop_other"]
    assert "Attribution" in text and "suppress preset" in text


def test_api_measures_the_same_as_the_engine(trained, every_section, tmp_path, capsys):
    local = every_section[1]["tasks"][0]  # "one token per step", through the engine in this process
    server = ServerProcess(trained, workers=1)
    try:
        _, remote = _eval(
            capsys, tmp_path, "--url", server.url, "--sections", "tasks", "--settings", "one token per step"
        )
    finally:
        server.stop()
    assert remote["tasks"][0]["setting"] == local["setting"] == "one token per step"
    assert remote["tasks"][0]["samples"] == local["samples"]
    assert remote["tasks"][0]["tokens_per_step"] == local["tokens_per_step"] == 1.0


def test_the_training_log_measures_the_same_as_the_engine(trained, every_section):
    """The training log's held-out accuracy builds its requests from the chat prompt's token ids
    (no HTTP layer, cde/train/heldout.py); `cde eval --model` parses API bodies with the gateway's
    own code: the same replies, the same tokens per pass."""
    local = every_section[1]["tasks"][0]  # "one token per step"
    logged = heldout.on_engine(Engine(EngineArgs(str(trained), max_running=4)), heldout.problems(1, seed=0))
    assert logged["samples"] == [tuple(s) for s in local["samples"]]
    assert logged["accuracy"] == local["accuracy"]
    assert logged["tokens_per_step"] == local["tokens_per_step"] == 1.0


# The CPU slice's floors (docs/reference-model.md, "CI on the CPU"): 2 held-out problems per family.
FLOORS = {"arithmetic": 0.8, "word_problem": 0.8, "sorting": 0.5, "reversal": 0.5}


@pytest.mark.slow
def test_the_shipped_model_passes_the_cpu_slice(tmp_path):
    """`cde eval` as CI runs it on the shipped model: held-out accuracy per family above its floor,
    amplify at strength 24 (where it passes 80% on the H200) moves neutral prompts onto the topic,
    suppress moves them off, the top known concept of a topic chunk is its topic, and suppressing
    the top attributed concept's direction lowers the token more than another active one's."""
    out = tmp_path / "eval.json"
    cmd = [
        sys.executable,
        "-m",
        "cde",
        "eval",
        "--model",
        "cde-reference",  # the name the server reports resolves to the shipped model
        "--limit",
        "2",
        "--settings",
        "one token per step",
        "--sections",
        "tasks,steering,attribution",
        "--strengths",
        "0,24",
        "--json",
        str(out),
    ]
    res = subprocess.run(
        cmd,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    report = json.loads(out.read_text())
    accuracy = report["tasks"][0]["accuracy"]
    assert all(accuracy[f] >= floor for f, floor in FLOORS.items()), accuracy
    unsteered, steered = (r["on_topic"] for r in report["amplify"])
    assert steered >= 0.5 and steered > unsteered, report["amplify"]
    assert report["suppress"]["suppressed"] < report["suppress"]["baseline"], report["suppress"]
    asked, amplified = report["attribution"]
    assert asked["top_is_topic"] >= 0.5 and amplified["topic_in_top3"] >= 0.5, report["attribution"]
    assert report["faithfulness"]["injection"]["top_beats_other"] >= 0.85, report["faithfulness"]


@pytest.mark.parametrize("flag", ["--url", "--model"])
def test_an_empty_target_is_refused_with_a_message(flag, capsys):
    """An empty --url (a shell variable that came back empty) is neither taken for an in-process
    run nor allowed to reach a traceback."""
    assert main(["eval", flag, "", "--limit", "1"]) == 1
    err = capsys.readouterr().err
    assert f"cde eval: {flag} is empty" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "args,says",
    [
        (["--limit", "0"], "argument --limit: expected a positive integer"),
        (["--settings", "one token per step,bogus"], "argument --settings: unknown setting 'bogus'"),
        (["--sections", "tasks,bogus"], "argument --sections: unknown section 'bogus'"),
        (["--strengths", "0,abc"], "argument --strengths: numbers separated by commas"),
    ],
)
def test_a_flag_a_later_section_reads_is_refused_before_anything_runs(args, says, capsys):
    """Checked by the parser: the held-out tasks (minutes on a full run) never start only to end
    on a typo in a flag that the steering section reads."""
    with pytest.raises(SystemExit) as exc:
        main(["eval", *args])
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_a_json_path_in_no_directory_is_refused_before_the_run(tmp_path, capsys):
    assert main(["eval", "--json", str(tmp_path / "none" / "eval.json"), "--limit", "1"]) == 1
    assert f"no such directory '{tmp_path / 'none'}'" in capsys.readouterr().err
