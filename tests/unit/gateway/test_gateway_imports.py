"""The gateway process must stay light: it never imports torch (it reaches workers over HTTP)."""

from __future__ import annotations

import subprocess
import sys


def test_the_gateway_never_imports_torch() -> None:
    code = ("import sys, gateway.app, gateway.openai.views, gateway.auth.admin_api; "
            "sys.exit(1 if any(m == 'torch' or m.startswith('torch.') for m in sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
