"""Dependencies run one way: ``scavenger`` and ``megatron_bridge`` use ``rlboost_hpc``, never the reverse, and the
product does not import test helpers. Read from the source (AST), so a lazy import inside a function counts too."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imports(package: str) -> list[tuple[str, int, str]]:
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out += [(str(path.relative_to(ROOT)), node.lineno, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out += [(str(path.relative_to(ROOT)), node.lineno, node.module)]
    return out


def test_the_core_imports_neither_the_scavenger_nor_the_megatron_bridge():
    bad = [i for i in imports("rlboost_hpc") if i[2].split(".")[0] in ("scavenger", "megatron_bridge", "tests")]
    assert not bad, bad


def test_the_scavenger_and_the_bridge_do_not_import_each_other_or_tests():
    bad = [i for i in imports("scavenger") if i[2].split(".")[0] in ("megatron_bridge", "tests")]
    bad += [i for i in imports("megatron_bridge") if i[2].split(".")[0] in ("scavenger", "tests")]
    assert not bad, bad


def test_test_scenarios_and_cluster_helpers_live_under_tests():
    for gone in ("megatron_bridge/testing.py", "rlboost_hpc/cluster/slurm_local.py"):
        assert not (ROOT / gone).exists(), f"{gone} is test support: it belongs under tests/"
