"""The repository stands alone: code, comments, configs and data files cite public sources (papers, dataset cards,
upstream files), never documents that live outside the repository (a team's design notes or fact sheets)."""

from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("vla", "tests", "scripts", "benchmarks", "configs", "data_mixtures", "model_cards")
TOP_LEVEL = ("README.md", "Makefile", "pyproject.toml")
SUFFIXES = {".py", ".yaml", ".yml", ".md", ".sh", ".sbatch", ".json", ".toml", ""}
# Written in pieces so that this file does not match itself.
OUTSIDE = re.compile(
    "|".join(
        ["DESIGN" + r"(?:\.md| §)", "shared/" + "reference", r"(?:oxe_datasets|robot_kinematics)\.m" + "d"]
    )
)


def _text_files() -> list[Path]:
    files = [REPO_ROOT / name for name in TOP_LEVEL]
    for folder in FOLDERS:
        files += sorted((REPO_ROOT / folder).rglob("*"))
    return [p for p in files if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts]


def test_no_file_points_to_documents_outside_the_repository() -> None:
    hits = [
        f"{path.relative_to(REPO_ROOT)}:{i}: {line.strip()}"
        for path in _text_files()
        for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not hits, "cite the public source instead:\n" + "\n".join(hits)


def test_the_pattern_catches_each_kind_of_reference() -> None:
    design = "DESIGN"
    for line in (
        f"({design} §4)",
        f"see {design}.md",
        "../shared/" + "reference/x",
        "oxe_datasets.m" + "d §3",
    ):
        assert OUTSIDE.search(line), line
    assert not OUTSIDE.search("../shared/fixtures/oxe_bridge_dataset_octo_debug")
