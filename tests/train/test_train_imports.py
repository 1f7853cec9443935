"""The training program stands apart from the HTTP layer: no module of cde.train imports
cde.gateway, at import or during a run (the held-out accuracy of a run decodes on an engine
in-process from token ids; `cde eval`, in cde/eval/, speaks the API)."""

import json
import subprocess
import sys

from cde.train.tasks import FAMILIES

GATEWAY_LOADED = "[m for m in sys.modules if m == 'cde.gateway' or m.startswith('cde.gateway.')]"


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_importing_the_training_program_loads_no_gateway():
    code = (
        "import importlib, pkgutil, sys, cde.train\n"
        "names = [m.name for m in pkgutil.iter_modules(cde.train.__path__) if m.name != '__main__']\n"
        "assert {'loop', 'program', 'objective', 'heldout'} <= set(names), names\n"
        "for n in names: importlib.import_module('cde.train.' + n)\n"
        f"assert not {GATEWAY_LOADED}, {GATEWAY_LOADED}\n"
    )
    out = _python(code)
    assert out.returncode == 0, out.stderr


def test_a_training_run_with_heldout_accuracy_loads_no_gateway(tmp_path):
    code = (
        "import sys\n"
        "from cde.train.loop import Options, train\n"
        "from cde.train.program import model_config\n"
        f"o = Options(out={str(tmp_path)!r}, config=model_config('mini'), steps=2, rows=2, length=128,\n"
        "            warmup=1, log_every=1, eval_problems=1)\n"
        "train(o)\n"
        f"assert not {GATEWAY_LOADED}, {GATEWAY_LOADED}\n"
    )
    out = _python(code)
    assert out.returncode == 0, out.stderr
    logs = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    [heldout] = [r["heldout"] for r in logs if "heldout" in r]
    assert set(heldout["accuracy"]) == set(FAMILIES), heldout
    assert heldout["tokens_per_step"] > 0 and heldout["samples"], heldout
