"""The gateway and the wire protocol stay free of torch (a slim process; no CUDA context)."""

import subprocess
import sys

from tests.api_server import REPO


def test_gateway_and_shared_do_not_import_torch():
    code = (
        "import sys, cde.gateway.app, cde.gateway.http_server, cde.shared.wire, cde.shared.tokenizer, "
        "cde.shared.config; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0
