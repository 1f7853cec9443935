"""`--model` as a directory or a Hugging Face Hub id (`org/name`, optionally at a `--revision`).

An id is resolved with `huggingface_hub`, the field's standard client: it downloads into (or,
offline, only reads) the shared Hub cache, so HF_HOME, HF_TOKEN and HF_HUB_OFFLINE mean what
they mean for every other tool, and a model fetched once is not fetched again. Only the files
a Steerling checkpoint is made of are fetched. Torch-free: the gateway resolves ids too (it
reads the concept labels beside the weights).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# The checkpoint (weights, sharded or not), the tokenizer and generation settings, and the
# concept labels when the repo ships them; never the Hub repo's Python modelling files.
CHECKPOINT_FILES = [
    "config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer_config.json",
    "generation_config.json",
    "concept_labels.parquet",
    "concept_labels.csv",
]
# The Hub's own rule for repo ids: one namespace, one name, letters, digits and `-_.`.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")


class HubError(ValueError):
    """The model is neither a directory nor a Hub id that could be resolved."""


def is_hub_id(model: str) -> bool:
    """`org/name` that is not a directory on disk (a directory of that name wins, as in vLLM)."""
    return bool(_HUB_ID.match(model)) and ".." not in model and not Path(model).expanduser().is_dir()


def resolve_model(model: str, revision: str | None = None) -> Path:
    """The local directory holding the checkpoint. Anything that is not a Hub id is returned as
    a path, for the loader to accept or to reject with its own error."""
    if not is_hub_id(model):
        if revision is not None:
            raise HubError(f"--revision applies to Hub ids, and {model!r} is a directory")
        return Path(model).expanduser()
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision!r}" if revision else ""
    try:
        return Path(snapshot_download(model, revision=revision, allow_patterns=CHECKPOINT_FILES))
    except LocalEntryNotFoundError:
        from huggingface_hub import constants

        raise HubError(  # the cache searched: HF_HUB_CACHE, else HF_HOME's hub/
            f"{model!r}{at} is neither a directory nor in the Hugging Face cache ({constants.HF_HUB_CACHE}), and the "
            f"Hub cannot be reached{' (HF_HUB_OFFLINE is set)' if _offline() else ''}: download it once with "
            f"network access, or give a checkpoint directory"
        ) from None
    except GatedRepoError:
        raise HubError(f"{model!r} is gated on the Hub: accept its terms and set HF_TOKEN") from None
    except RevisionNotFoundError:
        raise HubError(f"{model!r} has no revision {revision!r} on the Hub") from None
    except RepositoryNotFoundError:
        raise HubError(f"{model!r} is neither a directory nor a Hub repo (a private repo needs HF_TOKEN)") from None
    except HfHubHTTPError as exc:
        raise HubError(f"fetching {model!r}{at} from the Hub failed: {exc}") from None


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
