"""Errors a user can cause, each run as a real `python -m cde` process: one line on stderr that
names the command and the cause, exit status 1, no traceback; `--debug` or CDE_DEBUG=1 brings the
traceback back."""

import functools
import json
import socket
import subprocess
from pathlib import Path

import pytest
from cde.worker.checkpoint import make_model

from tests.cde_procs import free_port, run_cde
from tests.faulty_worker import LAUNCH_FAULT

cde = functools.partial(run_cde, timeout=240)  # a model loads in some cases


def one_line(res: subprocess.CompletedProcess, command: str, *says: str) -> None:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1, res.stderr
    assert len(lines) == 1 and lines[0].startswith(f"cde {command}: "), res.stderr
    assert all(s in lines[0] for s in says), res.stderr


def log_messages(stderr: str) -> list[str]:
    """The gateway logs JSON lines; anything else on stderr is a plain line (the worker's error)."""
    out = []
    for line in stderr.strip().splitlines():
        try:
            out.append(json.loads(line)["msg"])
        except (ValueError, KeyError):
            out.append(line)
    return out


@pytest.fixture(scope="module")
def missing_tensors(tmp_path_factory) -> Path:
    """A checkpoint whose config.json names a layer its weights do not have: every check that can
    be made without loading passes, the load fails."""
    out = make_model("tiny", tmp_path_factory.mktemp("ckpt") / "tiny")
    config = json.loads((out / "config.json").read_text())
    config["n_layers"] += 1
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_missing_model_directory(tmp_path):
    for command in ("serve", "generate", "worker", "eval"):
        extra = ["--prompt", "hi"] if command == "generate" else []
        res = cde(command, "--model", str(tmp_path / "nowhere"), *extra, timeout=60)
        one_line(res, command, "does not exist", str(tmp_path / "nowhere"))


def test_a_file_given_as_the_model_directory(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    res = cde("generate", "--model", str(tmp_path / "model.safetensors"), "--prompt", "hi", timeout=60)
    one_line(res, "generate", "is a file", "the checkpoint directory that holds config.json")


@pytest.mark.parametrize("command", ["serve", "bench engine"])
def test_an_unknown_flag_names_the_command_whose_help_lists_its_flags(command):
    res = cde(*command.split(), "--bogus", timeout=60)
    assert res.returncode == 2, res.stderr
    assert (
        res.stderr.strip() == f"cde {command}: unrecognized arguments: --bogus (`cde {command} --help` lists the flags)"
    )


def test_a_request_the_engine_fails_is_an_error_not_an_empty_completion(tiny_dir):
    res = cde("generate", "--model", str(tiny_dir), "--prompt-ids", str(LAUNCH_FAULT), module="tests.faulty_worker")
    assert res.returncode == 1, res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("cde generate: the request failed: "), res.stderr
    assert "RuntimeError: planted fault while launching a pass" in res.stderr  # the engine's log: why


def test_a_weight_file_cut_short_is_refused_before_any_worker_starts(tmp_path):
    """Its header parses but its tensors' bytes are not all there (a download cut short): `cde
    serve` says so itself, in one line, rather than through a worker's failed start."""
    out = make_model("tiny", tmp_path / "tiny")
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    res = cde("serve", "--model", str(out), "--port", str(free_port()), timeout=60)
    one_line(res, "serve", "model.safetensors is not a readable safetensors file", "fetch it again")


def test_a_bad_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    one_line(cde("serve", "--model", str(tmp_path), timeout=60), "serve", "config.json", "invalid JSON")
    res = cde("serve", "--model", str(tmp_path), "--debug", timeout=60)  # a command's own check
    assert res.returncode == 1 and "json.decoder.JSONDecodeError: Expecting property name" in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith(f"cde serve: {tmp_path}/config.json: invalid JSON")
    (tmp_path / "config.json").write_text(json.dumps({"n_layers": 0}))
    one_line(cde("generate", "--model", str(tmp_path), "--prompt", "hi", timeout=60), "generate", "n_layers")


def test_a_checkpoint_whose_tensors_do_not_match(missing_tensors):
    res = cde("generate", "--model", str(missing_tensors), "--prompt", "hi")
    one_line(res, "generate", "missing tensor(s)", "transformer.blocks.2.")
    for debug in (["--debug"], []):
        res = cde(
            "generate",
            "--model",
            str(missing_tensors),
            "--prompt",
            "hi",
            *debug,
            env={"CDE_DEBUG": "1"} if not debug else None,
        )
        assert res.returncode == 1 and "Traceback (most recent call last)" in res.stderr
        assert "CheckpointError: checkpoint is missing tensor(s)" in res.stderr


def test_bad_flag_combinations(tmp_path):
    one_line(cde("worker", "--curve-secret-key", str(tmp_path / "k"), timeout=60), "worker", "go together")
    one_line(cde("gateway", timeout=60), "gateway", "--worker")
    one_line(cde("eval", "--model", "", timeout=60), "eval", "--model is empty")


@pytest.mark.parametrize("host", ["::1", "127.0.0.1"])
def test_the_port_check_binds_as_uvicorn(host):
    """IPv6 hosts too (a check on an IPv4 socket refused `--host ::1`): the check passes where a
    socket of the host's family binds (a machine without IPv6 refuses ::1 both ways), and a host
    that does not resolve is one line."""
    from cde.commands.gateway import check_port

    port = free_port()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, port))
        binds = True
    except OSError:
        binds = False
    if binds:
        check_port(host, port, "serve")
    else:
        with pytest.raises(SystemExit, match=f"cannot listen on {host}:{port}"):
            check_port(host, port, "serve")
    with pytest.raises(SystemExit, match=r"cde serve: cannot listen on no\.such\.host\.invalid:80 \(\w"):
        check_port("no.such.host.invalid", 80, "serve")


@pytest.mark.parametrize("command", ["gateway", "serve"])
def test_a_port_in_use(command):
    """One line, before any worker starts or any model loads (docs/operations.md)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        extra = ["--worker", "tcp://127.0.0.1:9"] if command == "gateway" else []
        res = cde(command, *extra, "--port", str(port), timeout=60)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip().splitlines() == [
        f"cde {command}: cannot listen on 127.0.0.1:{port} (Address already in use)"
    ], res.stderr


@pytest.mark.slow
def test_a_worker_that_dies_loading_its_model(missing_tensors):
    """`cde serve` whose worker fails at load: the worker says why in one line, the gateway that
    it died, and serve exits 1; no traceback from any of the three processes' layers."""
    res = cde("serve", "--model", str(missing_tensors), "--port", "0", "--startup-timeout", "200")
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    messages = log_messages(res.stderr)
    [worker] = [m for m in messages if m.startswith("cde worker: ")]
    assert "missing tensor(s)" in worker
    assert "RuntimeError: worker-0 exited with code 1 during startup" in messages
    assert all("\n" not in m for m in messages)
