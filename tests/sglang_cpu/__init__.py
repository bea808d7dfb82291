"""Test tooling for the SGLang engine on CPU (TEST AIDS ONLY — never on the production path).

- ``stubs/``: a directory put on the *SGLang server's* ``PYTHONPATH`` by the tests. Its ``sitecustomize.py``
  installs import-time stand-ins for ``torchvision`` and ``sgl_kernel`` (see that file). Production servers
  (GPU, ``pip install rlboost-hpc[sglang]``) have the real packages and never see this directory.
- :func:`stub_env` returns the environment additions a test passes to :class:`SGLangEngine` (``env=``).
"""
from __future__ import annotations

import os
from pathlib import Path

STUBS_DIR = Path(__file__).resolve().parent / "stubs"
INSTALL_SCRIPT = "scripts/install-sglang-cpu.sh"


def stub_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a CPU SGLang server under test: the stand-ins first on PYTHONPATH, CPU engine on."""
    base = dict(os.environ if base is None else base)
    pp = base.get("PYTHONPATH", "")
    return {
        "PYTHONPATH": str(STUBS_DIR) + (os.pathsep + pp if pp else ""),
        "SGLANG_USE_CPU_ENGINE": "1",
        "RLBOOST_SGLANG_TEST_STANDINS": "1",
    }
