"""The documentation (issue 56 item 5): README is what the project is, the two commands and a map; one page per topic
under docs/, built by mkdocs; the configuration reference is generated from the config's declarations; and the
commands the pages give are run — a ``task check`` for real, a ``run`` as far as its configuration (file and every
``--set``, exactly as the CLI loads them), any other command's flags against its ``--help``.
"""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CLI = [sys.executable, "-m", "rlboost_hpc.cli"]


def _nav_pages() -> list[str]:
    """The pages mkdocs.yml's nav lists, in order (its lines ``- Title: page.md``)."""
    return re.findall(r"^\s*- [^:\n]+: (\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)


def _blocks() -> list[tuple[str, str, str]]:
    """(page, language, body) of every fenced code block of the pages."""
    return [(p.name, m.group(1), m.group(2)) for p in sorted(DOCS.glob("*.md"))
            for m in re.finditer(r"^```(\w*)\n(.*?)^```", p.read_text(), re.S | re.M)]


def _commands() -> list[tuple[str, list[str], dict[str, str]]]:
    """(page, argv, copies) of every ``rlboost-hpc`` command in the pages' shell blocks — continuation lines joined,
    comments dropped, ``&&`` chains split; ``copies``: the block's ``cp A B`` (B is A for the command's config)."""
    out = []
    for page, lang, body in _blocks():
        if lang not in ("", "bash", "sh"):
            continue
        copies: dict[str, str] = {}
        for line in body.replace("\\\n", " ").splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # a synopsis such as `--experiment preemption|lengths [--json]`: not a command
                continue
            while words:
                argv, words = (words[:words.index("&&")], words[words.index("&&") + 1:]) if "&&" in words else (
                    words, [])
                if argv and argv[0] == "cp" and len(argv) == 3:
                    copies[argv[2]] = argv[1]
                elif argv and argv[0].endswith("rlboost-hpc") and not any(w.startswith("[") for w in argv):
                    out.append((page, argv[1:], copies))
    return out


def test_every_page_is_in_the_site_and_both_maps_name_the_same_pages():
    """Each page of docs/ is in the nav; README's map and the site's home page list the same pages, in order."""
    pages = {p.name for p in DOCS.glob("*.md")}
    assert set(_nav_pages()) == pages, f"pages not in mkdocs.yml's nav: {sorted(pages - set(_nav_pages()))}"
    def table_links(text: str, prefix: str) -> list[str]:
        return [m for line in text.splitlines() if line.startswith("| ")
                for m in re.findall(rf"\]\({prefix}([\w.-]+\.md)\)", line)]

    readme = table_links((ROOT / "README.md").read_text(), "docs/")
    home = table_links((DOCS / "index.md").read_text(), "")
    assert readme and readme == home, (readme, home)
    for cmd in re.findall(r"^python3 -m venv .*$", (ROOT / "README.md").read_text(), re.M):
        assert cmd in (DOCS / "index.md").read_text(), f"the home page's two commands are not README's: {cmd}"


def test_the_site_builds_with_no_warning(tmp_path):
    """``mkdocs build --strict``: every page of the nav exists and every link between pages resolves."""
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "site" / "configuration-reference" / "index.html").is_file()


def test_the_configuration_reference_is_what_the_config_declares():
    """docs/configuration-reference.md is generated (scripts/config_reference.py); it lists every key the loader
    accepts, so a key added without regenerating it fails here."""
    r = subprocess.run([sys.executable, "scripts/config_reference.py", "--check"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    text = (DOCS / "configuration-reference.md").read_text()
    for key in ("`[trainer.lora]`", "`[task.rewards.model]`", "| `max_staleness` |", "| `heldout_fraction` |"):
        assert key in text


def test_the_toml_of_the_pages_is_a_valid_configuration():
    """Every TOML block of the pages parses and holds only keys the configuration accepts."""
    from rlboost_hpc.config import RunConfig

    blocks = [(page, body) for page, lang, body in _blocks() if lang == "toml"]
    assert blocks
    for page, body in blocks:
        RunConfig.model_validate(tomllib.loads(body))  # raises naming the key


def test_the_commands_of_the_pages_run(tmp_path):
    """Each ``rlboost-hpc`` command of the pages, through the CLI where it is cheap: ``task check`` runs (exit 0);
    ``run`` loads its configuration as the CLI does (the file, or the one it was copied from, and every ``--set``);
    any other command's flags are among those its ``--help`` lists."""
    from rlboost_hpc.config import load_config

    commands = _commands()
    kinds = {argv[0] for _, argv, _ in commands}
    assert {"run", "task", "simulate"} <= kinds, kinds
    helps: dict[str, str] = {}
    for page, argv, copies in commands:
        where = f"{page}: rlboost-hpc {shlex.join(argv)}"
        if argv[:2] == ["task", "check"]:
            r = subprocess.run([*CLI, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, f"{where}\n{r.stderr[-2000:]}"
        elif argv[0] == "run":
            flags = dict(zip(argv[1::2], argv[2::2]))
            config = flags.get("--config")
            config = copies.get(config, config)
            sets = [argv[i + 1] for i, w in enumerate(argv) if w == "--set"]
            assert config is None or (ROOT / config).is_file(), where
            load_config(str(ROOT / config) if config else None, sets)
        else:
            if argv[0] not in helps:
                r = subprocess.run([*CLI, argv[0], "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
                assert r.returncode == 0, f"{where}\n{r.stderr[-2000:]}"
                helps[argv[0]] = r.stdout
            unknown = [w for w in argv if w.startswith("--")
                       and not re.search(rf"(?<![\w-]){re.escape(w.split('=')[0])}(?![\w-])", helps[argv[0]])]
            assert not unknown, f"{where}: flags its --help does not list: {unknown}"


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_a_page_names_only_repository_paths_that_exist(page):
    """A path the page names in backticks (``configs/…``, ``examples/…``, ``sbatch/…``, ``scripts/…``,
    ``benchmarks/…``, ``rlboost_hpc/…``, ``scavenger/…``, ``megatron_bridge/…``) exists in the repository."""
    text = (DOCS / page).read_text()
    named = re.findall(r"`((?:configs|examples|sbatch|scripts|benchmarks|rlboost_hpc|scavenger|megatron_bridge)/"
                       r"[\w./-]+?)[`\s]", text)
    missing = sorted({p for p in named if "*" not in p and not (ROOT / p.rstrip("/.")).exists()})
    assert not missing, f"{page} names paths that do not exist: {missing}"
