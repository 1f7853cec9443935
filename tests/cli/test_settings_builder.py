"""One settings object (shared/settings.py), built once from a command's flags and the
environment (cde/commands/settings_builder.py): the parsers `cde` builds, the builder, and the JSON
message `cde serve` hands each worker process it starts."""

import argparse
import dataclasses

import pytest
from cde.shared.protocol import FlashBlockSpec
from cde.shared.settings import EngineArgs, WorkerSettings

from cde.cli import build_parser
from cde.commands.settings_builder import INPUT_ATTRIBUTION_SHARE_ENV, INPUT_ATTRIBUTION_TOKENS_ENV, engine_args


def parse(command: str, *flags: str) -> argparse.Namespace:
    parser, _ = build_parser(command)
    return parser.parse_args([command, *flags])


def test_worker_flags_and_environment_become_engine_args(monkeypatch):
    monkeypatch.setenv(INPUT_ATTRIBUTION_TOKENS_ENV, "512")
    monkeypatch.setenv(INPUT_ATTRIBUTION_SHARE_ENV, "0.25")
    args = parse(
        "worker",
        *("--model", "m", "--dtype", "bfloat16", "--max-running", "8", "--max-running-per-client", "3"),
        *("--kv-splits", "4", "--flashblock-tau", "2", "--flashblock-max-reuse", "9", "--quantization", "fp8"),
    )
    assert engine_args(args) == EngineArgs(
        "m",
        device="auto",
        dtype="bfloat16",
        max_running=8,
        max_running_per_client=3,
        kv_splits=4,
        flashblock=FlashBlockSpec(2, 9),
        quantization="fp8",
        input_attribution_tokens=512,
        input_attribution_share=0.25,
    )


def test_a_command_without_a_flag_group_keeps_the_engine_defaults(monkeypatch):
    """`cde generate` has no attention or fair-share flags; what it chooses itself wins."""
    monkeypatch.delenv(INPUT_ATTRIBUTION_TOKENS_ENV, raising=False)
    monkeypatch.delenv(INPUT_ATTRIBUTION_SHARE_ENV, raising=False)
    got = engine_args(parse("generate", "--prompt", "x", "--model", "m"), max_running=1)
    assert got == EngineArgs("m", device="auto", max_running=1)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--flashblock-tau", "-1"), "must be >= 0"),
        (("--max-running", "2", "--max-running-per-client", "3"), "must be at most --max-running"),
        (("--quantization", "fp8", "--dtype", "float32"), "computes in bfloat16"),
    ],
)
def test_bad_flags_fail_in_the_builder(flags, message):
    with pytest.raises(SystemExit, match=message.replace("[", r"\[")):
        engine_args(parse("serve", *flags))


def test_no_prefix_cache_reaches_the_workers_as_a_setting(monkeypatch):
    """`--no-prefix-cache` is EngineArgs.prefix_cache: `cde serve` hands it to the workers it starts
    in their settings message, not as a flag rendered again."""
    monkeypatch.delenv(INPUT_ATTRIBUTION_TOKENS_ENV, raising=False)
    monkeypatch.delenv(INPUT_ATTRIBUTION_SHARE_ENV, raising=False)
    on = engine_args(parse("serve", "--model", "m"))
    off = engine_args(parse("serve", "--model", "m", "--no-prefix-cache"))
    assert on.prefix_cache and off == dataclasses.replace(on, prefix_cache=False)  # that field only
    assert engine_args(parse("worker", "--model", "m", "--no-prefix-cache")).prefix_cache is False
    message = WorkerSettings(off, bind="ipc:///tmp/w-0").to_json()
    assert WorkerSettings.from_json(message).engine.prefix_cache is False


def test_worker_settings_cross_as_one_json_message():
    settings = WorkerSettings(
        engine=EngineArgs("/m", device="cuda", flashblock=FlashBlockSpec(3, 7), max_running_per_client=2),
        bind="ipc:///tmp/w-0",
        served_model_name="org/name",
        parent_pid=123,
        host_workers=2,
        threads=4,
    )
    assert WorkerSettings.from_json(settings.to_json()) == settings
    exact = WorkerSettings(EngineArgs("/m"), bind="tcp://127.0.0.1:1")
    assert WorkerSettings.from_json(exact.to_json()) == exact


@pytest.mark.parametrize("text", ["[]", "{}", '{"engine": {"model": "m", "flashblock": null}}', "not json"])
def test_a_malformed_message_is_refused(text):
    with pytest.raises(ValueError, match="not a worker's settings"):
        WorkerSettings.from_json(text)
