"""Record the official generator's greedy tokens for the parity checkpoints written by `cde
make-model` (the `tiny_dir` and `small_dir` fixtures).

tests/parity/test_parity.py runs the reference live for the checkpoint written by the official
classes; for these two (whose reference runs cost minutes on a 2-core CI machine) it compares
against these goldens. A golden file pins the checkpoint by the SHA-256 of its safetensors, so a
change to `cde make-model` fails loudly instead of comparing against the wrong weights.

    python scripts/record_goldens.py small tiny   # writes tests/goldens/parity_{small,tiny}.json
"""

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cde.worker.checkpoint import make_model

from tests.parity.test_parity import GOLDEN_SEEDS, checkpoint_sha256, golden_path, prompts, reference_tokens


def record(preset: str) -> None:
    seed = GOLDEN_SEEDS[preset]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(preset, tmp, seed=seed)
        ps = prompts(seed=len(f"{preset}_dir"))  # the seed the live test used for the fixture of that name
        out = {
            "preset": preset,
            "seed": seed,
            "safetensors_sha256": checkpoint_sha256(model_dir),
            "max_new_tokens": 256,
            "prompts": ps,
            "tokens": [reference_tokens(model_dir, p, 256) for p in ps],
        }
    path = golden_path(preset)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
    print(f"wrote {path}")


def main() -> None:
    for preset in sys.argv[1:] or sorted(GOLDEN_SEEDS):
        record(preset)


if __name__ == "__main__":
    main()
