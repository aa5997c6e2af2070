"""The README's command sequences run as written, in order, in a fresh folder.

Every ```bash block the README marks with ``<!-- readme-test ... -->`` on the line above is run command by command
(``vla ...`` lines; ``\\``-continued lines joined, comments dropped) in a temporary folder, through ``vla.cli.main``
in this process. Only sizes are shrunk (``--episodes`` to 2, ``--workers`` to 1, generated images to 32 px,
``--settle-steps`` to 2), so the sequence (generate, preview, shards, merge, info; Bridge info, show, convert) is the one a user types.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from vla.cli import main

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
MARKER = "<!-- readme-test"


def readme_blocks() -> list[list[list[str]]]:
    """The marked blocks of README.md, each as its commands (argument lists, ``vla`` first)."""
    lines = (REPO / "README.md").read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if not line.startswith(MARKER):
            continue
        assert lines[i + 1] == "```bash", (
            f"README.md line {i + 2}: a readme-test marker must precede a bash block"
        )
        end = lines.index("```", i + 2)
        text = "\n".join(lines[i + 2 : end]).replace("\\\n", " ")
        commands = [shlex.split(c, comments=True) for c in text.splitlines()]
        blocks.append([c for c in commands if c])
    return blocks


def shrink(argv: list[str]) -> list[str]:
    """The command with small sizes: 2 episodes (over all shards), 1 worker, 32 px generated images."""
    out = list(argv)
    for flag, value in (("--episodes", "2"), ("--workers", "1")):
        if flag in out:
            out[out.index(flag) + 1] = value
    if out[1:3] == ["sim", "generate"]:
        out += ["--image-size", "32", "--settle-steps", "2"]
    return out


BLOCKS = readme_blocks()


def test_the_readme_marks_its_runnable_blocks() -> None:
    assert len(BLOCKS) >= 2
    for block in BLOCKS:
        assert block and all(c[0] == "vla" for c in block), block


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs_in_order(
    index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    block = BLOCKS[index]
    if any("../shared" in a for c in block for a in c):
        if not (SHARED / "fixtures").is_dir():
            pytest.skip(f"the block reads ../shared/fixtures, not present at {SHARED}")
        block = [[a.replace("../shared", str(SHARED)) for a in c] for c in block]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VLA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("VLA_DEBUG", raising=False)
    for argv in block:
        rc = main(shrink(argv)[1:])
        out, err = capsys.readouterr()
        assert rc == 0, f"`{shlex.join(argv)}` failed in order: {err or out}"
        assert re.search(r"\S", out), f"`{shlex.join(argv)}` printed nothing"
