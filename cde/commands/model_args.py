"""`--model` / `--revision`, the same on every command that loads a model: a checkpoint directory
or a Hugging Face Hub id, resolved to a local directory before any model work."""

from __future__ import annotations

import argparse
from pathlib import Path

MODEL_HELP = (
    "checkpoint directory, `cde-reference` (the built-in demo model), or Hugging Face Hub id org/name "
    "(fetched into HF_HOME; HF_TOKEN, HF_HUB_OFFLINE apply)"
)


def add_model_arguments(
    p: argparse.ArgumentParser,
    model_help: str = MODEL_HELP + " (default: the built-in demo model)",
    into: argparse._MutuallyExclusiveGroup | None = None,
) -> None:
    """`into`: a mutually exclusive group of `p` that --model joins (`bench engine --preset`)."""
    (into or p).add_argument("--model", help=model_help)
    p.add_argument("--revision", help="branch, tag or commit of a Hub id (default: main)")


def resolve_model_args(args: argparse.Namespace, command: str, demo: bool = True) -> str | None:
    """Points `args.model` at a local directory (the demo model when absent and `demo`) and
    returns the name to serve it under by default: a Hub id as given (as vLLM does), else None
    (a directory is served under its own name)."""
    from cde.shared.hub import HubError, is_hub_id, resolve_model

    if args.model is None:
        if args.revision is not None:
            raise SystemExit(f"cde {command}: --revision needs --model ORG/NAME")
        if demo:
            from cde.worker.demo_model import demo_model_dir

            args.model = str(demo_model_dir())
        return None
    from cde.worker.demo_model import DEMO_NAME

    if args.model == DEMO_NAME and not Path(DEMO_NAME).exists():  # the name the server reports
        from cde.worker.demo_model import demo_model_dir

        if args.revision is not None:
            raise SystemExit(f"cde {command}: --revision applies to Hub ids; {DEMO_NAME} is built in")

        args.model = str(demo_model_dir())
        return None
    hub_id = args.model if is_hub_id(args.model) else None
    args.model_from_hub = hub_id is not None  # its concept catalog is then fetched from the Hub too
    try:
        args.model = str(resolve_model(args.model, args.revision))
    except HubError as exc:
        raise SystemExit(f"cde {command}: {exc}") from None
    if demo:  # a command that loads the weights: a wrong path fails here, in one line, not in a worker
        check_checkpoint_dir(args.model, command)
    return hub_id


def check_checkpoint_dir(path: str, command: str) -> None:
    """What can be checked without torch: the directory, a valid config.json, the weight files the
    loader reads (shared/weight_files.py), their headers parsed and their bytes all there. The
    tensors' names and shapes are checked when the weights load."""
    from cde.shared.config import ConfigError, ModelConfig
    from cde.shared.weight_files import check_headers

    where = Path(path)
    if where.is_file():
        raise SystemExit(
            f"cde {command}: {path!r} is a file; give the checkpoint directory that holds config.json "
            "and the *.safetensors weights"
        )
    if not where.is_dir():
        raise SystemExit(
            f"cde {command}: model directory {path!r} does not exist (give a checkpoint directory, "
            "cde-reference, or a Hub id org/name)"
        )
    try:
        ModelConfig.from_json(where / "config.json")
    except ConfigError as exc:
        raise SystemExit(f"cde {command}: {exc}") from None
    try:
        check_headers(where)
    except ValueError as exc:
        raise SystemExit(f"cde {command}: {exc}") from None
