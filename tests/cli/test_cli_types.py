"""Flag values that would leave a server up but refusing every request are refused before anything
starts (cde/cli_types.py), and every flag mistake is one line naming the command and the flag
(cde/cli.py's `Parser`), each run as a real `python -m cde` process."""

import pytest

from tests.cde_procs import run_cde


@pytest.mark.parametrize(
    "command,flag,value",
    [
        ("serve", "--workers", "-1"),
        ("serve", "--workers", "0"),
        ("serve", "--max-running", "0"),
        ("serve", "--max-model-len", "-5"),
        ("serve", "--kv-splits", "65"),
        ("serve", "--max-running-per-client", "0"),
        ("serve", "--heartbeat-timeout", "0"),
        ("serve", "--heartbeat-timeout", "nan"),
        ("serve", "--max-request-bytes", "0"),
        ("serve", "--startup-timeout", "-1"),
        ("serve", "--port", "70000"),
        ("serve", "--port", "-1"),
        ("serve", "--port", "abc"),
        ("serve", "--log-level", "verbose"),
        ("gateway", "--shutdown-timeout", "-1"),
        ("gateway", "--max-queued-per-client", "0"),
        ("worker", "--threads", "-2"),
        ("eval", "--max-running", "0"),
    ],
)
def test_a_value_no_server_could_use_is_one_line_naming_the_flag(command, flag, value):
    res = run_cde(command, f"{flag}={value}")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert lines[0].startswith(f"cde {command}: argument {flag}: expected ") and value in lines[0], res.stderr


def test_a_misspelt_flag_a_bare_api_key_and_an_unknown_dtype_are_one_line():
    for args, says in (
        (("serve", "--max-runing", "4"), "unrecognized arguments: --max-runing"),
        (("serve", "--api-key"), "CDE_API_KEY"),
        (("bogus",), "invalid choice: 'bogus'"),
        (("generate", "--dtype", "fp32"), "argument --dtype: invalid choice: 'fp32'"),
        (("worker", "--dtype", "float16"), "argument --dtype: invalid choice: 'float16'"),
    ):
        res = run_cde(*args)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and says in lines[0], res.stderr
        assert "usage:" not in res.stderr


def test_version():
    res = run_cde("--version")
    assert res.returncode == 0 and res.stdout.startswith("cde ") and res.stdout.split()[1][0].isdigit()


def test_a_source_tree_without_package_metadata_still_runs(monkeypatch, capsys):
    """scripts/gpu_run.sh runs `python -m cde` from a checkout on PYTHONPATH, never installed."""
    import importlib.metadata

    import cde.cli

    def absent(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(cde.cli, "version", absent)
    parser, _ = cde.cli.build_parser("make-model")
    assert parser.parse_args(["make-model", "--preset", "tiny", "out"]).out == "out"
    with pytest.raises(SystemExit) as done:
        parser.parse_args(["--version"])
    assert done.value.code == 0 and "not installed" in capsys.readouterr().out
