"""Record the official generator's greedy tokens for the `small` parity checkpoint.

tests/parity/test_parity.py runs the reference live for the tiny checkpoints; for `small` (whose
reference run costs minutes on a 2-core CI machine) it compares against these goldens. The
golden file pins the checkpoint by the SHA-256 of its safetensors, so a change to `cde make-model`
fails loudly instead of comparing against the wrong weights.

    python scripts/record_goldens.py   # writes tests/goldens/parity_small.json
"""

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cde.worker.checkpoint import make_model

from tests.parity.test_parity import GOLDEN, SMALL_SEED, checkpoint_sha256, prompts, reference_tokens


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model("small", tmp, seed=SMALL_SEED)
        ps = prompts(seed=len("small_dir"))
        record = {
            "preset": "small",
            "seed": SMALL_SEED,
            "safetensors_sha256": checkpoint_sha256(model_dir),
            "max_new_tokens": 256,
            "prompts": ps,
            "tokens": [reference_tokens(model_dir, p, 256) for p in ps],
        }
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(record))
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
