"""Benchmarks: `cde bench engine` (offline engine), `cde bench serve` (HTTP load generator) and
`cde bench soak` (mixed load against a running server, then pass/fail checks)."""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from cde.cli_errors import add_debug_argument

# name -> (module in cde.commands, one-line help). Only the chosen one is imported: `bench serve`
# and `bench soak` run where torch is not installed.
SUBCOMMANDS = {
    "engine": ("bench_engine", "offline engine benchmark: latency and throughput per concurrency"),
    "serve": ("bench_serve", "HTTP load generator against a running server (vllm bench serve style)"),
    "prefix-cache": ("bench_prefix_cache", "offline engine: shared prefixes and a second turn, prefix cache off vs on"),
    "prefix-routing": ("bench_prefix_routing", "prefix cache hit rate and balance over workers, per routing policy"),
    "roofline": ("bench_roofline", "engine benchmark results beside the GPU's weight-read and tensor-core limits"),
    "soak": ("soak", "mixed requests against a running server for a while, then pass/fail checks"),
}


class _LazySubcommands(argparse._SubParsersAction):
    """Adds the chosen subcommand's arguments when argparse reaches it."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        name = values[0]
        if name in SUBCOMMANDS:
            module = importlib.import_module(f"cde.commands.{SUBCOMMANDS[name][0]}")
            sub = self._name_parser_map[name]
            sub.description = module.__doc__
            add_debug_argument(sub)  # listed in its --help, as on every command
            module.add_arguments(sub)
            namespace.bench_run = module.run
        super().__call__(parser, namespace, values, option_string)


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", required=True, action=_LazySubcommands)
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, formatter_class=p.formatter_class)


def run(args: argparse.Namespace) -> int:
    return args.bench_run(args)
