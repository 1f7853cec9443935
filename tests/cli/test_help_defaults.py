"""Every option of every `cde` command (and `cde bench` subcommand) says its default in --help:
a value, "off" for a switch, or in words what leaving it unset does. Walks the real parsers,
built as `cde` builds them, and reads each option's help as `--help` prints it."""

import argparse
import importlib

import pytest

from cde.cli import COMMANDS, HelpFormatter, build_parser
from cde.commands.bench import SUBCOMMANDS


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub._name_parser_map[name]


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    out = []
    for name in COMMANDS:
        parser, _ = build_parser(name)
        out.append((name, _subparser(parser, name)))
    out.append(("cde", build_parser(None)[0]))
    bench = out[list(COMMANDS).index("bench")][1]
    for name, (module, _) in SUBCOMMANDS.items():
        sub = _subparser(bench, name)
        importlib.import_module(f"cde.commands.{module}").add_arguments(sub)
        out.append((f"bench {name}", sub))
    return out


PARSERS = _parsers()


@pytest.mark.parametrize(("command", "parser"), PARSERS, ids=[c for c, _ in PARSERS])
def test_every_option_shows_its_default(command, parser):
    assert parser.formatter_class is HelpFormatter
    parser.format_help()  # renders, every %(default)s included
    formatter = parser._get_formatter()
    missing = []
    for action in parser._actions:
        if not action.option_strings or isinstance(
            action, argparse._HelpAction | argparse._VersionAction | argparse._SubParsersAction
        ):
            continue
        if action.help == argparse.SUPPRESS:  # not in --help at all (`--api-key`, refused with a message)
            continue
        text = formatter._expand_help(action) if action.help else ""
        if "default" not in text and "required" not in text:
            missing.append(f"{'/'.join(action.option_strings)}: {text!r}")
    assert not missing, f"cde {command}: options whose --help shows no default:\n" + "\n".join(missing)


def test_generate_and_serve_pick_the_device_the_same_way():
    devices = {}
    for name in ("generate", "serve"):
        parser, _ = build_parser(name)
        devices[name] = _subparser(parser, name).parse_args([]).device if name == "serve" else None
    parser, _ = build_parser("generate")
    devices["generate"] = _subparser(parser, "generate").parse_args(["--prompt", "x"]).device
    assert devices == {"generate": "auto", "serve": "auto"}
