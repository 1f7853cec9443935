"""cde/commands/model_args.py: `--model` and `--revision` as every command that loads a model
reads them, run in-process on the parser `cde` builds."""

import argparse

import pytest

from cde.commands.model_args import add_model_arguments, resolve_model_args


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_model_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("argv", [("--revision", "v1"), ("--model", "cde-reference", "--revision", "v1")])
def test_a_revision_without_a_hub_id_is_refused(argv):
    """It would be ignored: the demo model has no revisions."""
    with pytest.raises(SystemExit, match=r"^cde serve: --revision"):
        resolve_model_args(parse(*argv), "serve")
