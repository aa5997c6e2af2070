"""What a new user runs first, checked for silent wrong results: ``vla model init`` never overwrites a checkpoint
unless told, refuses stats that miss an embodiment (and ``model info`` / the model card say which embodiments have
none), computes stats of a fresh dataset itself, writes a card whose numbers are the config's; ``vla data merge``
keeps every split and names the feature two datasets differ in; ``vla --version``, ``python -m vla``, ``--help``
defaults and ``vla data show``'s readable summary.

Everything is written here (tiny checkpoints, small LeRobot datasets); nothing needs ``../shared``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vla.cli import main
from vla.data.readers.lerobot import LeRobotReader
from vla.data.writers.lerobot import LeRobotWriter
from vla.data.writers.synthetic import make_lerobot_dataset
from vla.embodiments import get_embodiment

WIDOWX = get_embodiment("widowx_bridge")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("VLA_DEBUG", raising=False)
    monkeypatch.setenv("VLA_CACHE_DIR", str(tmp_path / "cache"))


def run_cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def user_error(capsys: pytest.CaptureFixture[str], *argv: object) -> str:
    """Run a command that must fail with one ``error: ...`` line (exit 2, no traceback); return that line."""
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2 and out == "" and "Traceback" not in err, (rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def widowx_dataset(root: Path, **kwargs: object) -> Path:
    """A fresh LeRobot v3.0 ``widowx_bridge`` dataset (generic key map) without stats."""
    args: dict[str, object] = dict(num_episodes=3, episode_length=6, cameras={"front": (24, 32)},
                                   state_dim=WIDOWX.state_dim, action_dim=WIDOWX.action_dim, fps=5, video=False,
                                   robot_type="widowx_bridge")  # fmt: skip
    return make_lerobot_dataset(root, **(args | kwargs))


@pytest.fixture(scope="module")
def widowx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return widowx_dataset(tmp_path_factory.mktemp("data") / "widowx")


# ---- vla model init / info / card ------------------------------------------------------------------------------


def test_init_computes_stats_of_a_fresh_dataset_and_never_overwrites_silently(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = widowx_dataset(tmp_path / "fresh")
    assert not (data / "meta" / "vla_stats.json").exists()
    ckpt = tmp_path / "ckpt"
    init = ("model", "init", "tiny_smolvlm", "--out", ckpt, "--embodiment", "widowx_bridge")
    rc, out, err = run_cli(capsys, *init, "--stats-from", data)
    assert rc == 0, err
    stats_file = data / "meta" / "vla_stats.json"
    assert stats_file.is_file() and f"wrote {stats_file}" in err, err  # says where the stats went
    assert out.strip() == f"wrote {ckpt} (normalization stats from {stats_file})"
    assert "Loading weights" not in out + err and "model shards" not in err, err  # no transformers bars
    assert (ckpt / "norm_stats.json").is_file()
    before = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}

    line = user_error(capsys, *init)  # same --out, no --overwrite: refused, nothing touched
    assert str(ckpt) in line and "--overwrite" in line
    assert {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before

    rc, out, err = run_cli(capsys, *init, "--overwrite")
    assert rc == 0, err
    assert not (ckpt / "norm_stats.json").exists(), "--overwrite writes the new checkpoint (without stats)"

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    line = user_error(capsys, "model", "init", "tiny_smolvlm", "--out", folder, "--embodiment", "widowx_bridge",
                      "--overwrite")  # fmt: skip
    assert "not a vla checkpoint" in line and [p.name for p in folder.iterdir()] == ["notes.txt"]


def test_init_refuses_stats_that_miss_an_embodiment(
    widowx: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["data", "stats", str(widowx)]) == 0
    capsys.readouterr()
    out = tmp_path / "ur5e"
    line = user_error(capsys, "model", "init", "tiny_smolvlm", "--out", out, "--embodiment", "sim_ur5e",
                      "--stats-from", widowx)  # fmt: skip
    assert "no normalization stats for sim_ur5e" in line and "widowx_bridge" in line
    assert not out.exists()


def test_info_and_card_name_embodiments_without_stats(
    widowx: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint whose stats cover widowx_bridge only (e.g. stats copied in by hand): info and card say so."""
    from vla.models.hub import from_pretrained, model_card

    assert main(["data", "stats", str(widowx)]) == 0
    ckpt = tmp_path / "two"
    rc, _, err = run_cli(capsys, "model", "init", "tiny_smolvlm", "--out", ckpt, "--embodiment", "widowx_bridge",
                         "--embodiment", "sim_ur5e")  # fmt: skip
    assert rc == 0, err
    (ckpt / "norm_stats.json").write_bytes((widowx / "meta" / "vla_stats.json").read_bytes())
    rc, out, err = run_cli(capsys, "model", "info", ckpt)
    assert rc == 0, err
    stats_line = next(line for line in out.splitlines() if line.startswith("normalization stats:"))
    assert "for widowx_bridge;" in stats_line and "no stats for sim_ur5e" in stats_line
    assert "Loading weights" not in out + err
    rc, out, _ = run_cli(capsys, "model", "info", ckpt, "--json")
    assert json.loads(out)["norm_stats"] == {"widowx_bridge": True, "sim_ur5e": False}
    card = model_card(from_pretrained(ckpt))
    assert "no stats for sim_ur5e" in card
    rows = {r.split("|")[1].strip(): r for r in card.splitlines() if r.startswith("| sim_ur5e") or
            r.startswith("| widowx_bridge")}  # fmt: skip
    assert rows["sim_ur5e"].rstrip().endswith("| **none** |") and rows["widowx_bridge"].rstrip().endswith(
        "| yes |"
    )


@pytest.mark.parametrize("chunk", [8, 3])
def test_card_numbers_are_the_configs(tmp_path: Path, capsys: pytest.CaptureFixture[str], chunk: int) -> None:
    ckpt = tmp_path / "ckpt"
    rc, _, err = run_cli(capsys, "model", "init", "tiny_smolvlm", "--out", ckpt, "--embodiment", "widowx_bridge",
                         "--embodiment", "sim_panda", "--set", f"chunk_length={chunk}",
                         "--set", "flow.num_steps=7")  # fmt: skip
    assert rc == 0, err
    cfg = json.loads((ckpt / "config.json").read_text())["model"]
    card = (ckpt / "README.md").read_text()
    assert cfg["chunk_length"] == chunk
    assert f"`chunk_length: {cfg['chunk_length']}` steps" in card
    assert f"({cfg['flow']['num_steps']} Euler steps by default)" in card
    assert f"`{cfg['backbone']['pretrained']}`" in card
    header = next(line for line in card.splitlines() if line.startswith("| name |"))
    col = [c.strip() for c in header.split("|")].index("chunk")
    for name in cfg["embodiments"]:
        row = next(line for line in card.splitlines() if line.startswith(f"| {name} |"))
        spec = get_embodiment(name)
        assert int(row.split("|")[col]) == min(spec.chunk_length, cfg["chunk_length"]), row


# ---- vla data merge --------------------------------------------------------------------------------------------


def _two_split_dataset(root: Path, seed: int, state_dim: int = WIDOWX.state_dim) -> Path:
    """A LeRobot v3.0 dataset with a ``train`` and a ``val`` split (2 + 1 episodes)."""
    rng = np.random.default_rng(seed)
    feats = {"observation.state": {"dtype": "float32", "shape": [state_dim]},
             "action": {"dtype": "float32", "shape": [WIDOWX.action_dim]}}  # fmt: skip
    with LeRobotWriter(root, 5, feats, robot_type="widowx_bridge", mode="create") as w:
        for split, n in (("train", 2), ("val", 1)):
            for e in range(n):
                frames = {"observation.state": rng.normal(size=(4, state_dim)).astype(np.float32),
                          "action": rng.normal(size=(4, WIDOWX.action_dim)).astype(np.float32)}  # fmt: skip
                w.add_episode(frames, "pick", {"origin": f"{root.name}/{split}/{e}"}, split=split)
        with pytest.raises(ValueError, match="one after another"):
            w.add_episode(frames, "pick", split="train")
    return root


def test_merge_keeps_every_split(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = _two_split_dataset(tmp_path / "a", 0), _two_split_dataset(tmp_path / "b", 1)
    out = tmp_path / "merged"
    rc, _, err = run_cli(capsys, "data", "merge", a, b, "--out", out)
    assert rc == 0, err
    assert json.loads((out / "meta" / "info.json").read_text())["splits"] == {"train": "0:4", "val": "4:6"}
    reader = LeRobotReader(out)
    origins = {s: [reader.episode_metadata(s, e)["origin"] for e in range(reader.num_episodes(s))]
               for s in reader.splits()}  # fmt: skip
    assert origins == {
        "train": ["a/train/0", "a/train/1", "b/train/0", "b/train/1"],
        "val": ["a/val/0", "b/val/0"],
    }
    src = LeRobotReader(b)
    np.testing.assert_array_equal(
        reader.read_episode("val", 1).steps["action"], src.read_episode("val", 0).steps["action"]
    )
    before = {f: f.read_bytes() for f in out.rglob("*") if f.is_file()}
    rc, again, err = run_cli(capsys, "data", "merge", a, b, "--out", out)  # the same command: already done
    assert rc == 0 and {f: f.read_bytes() for f in out.rglob("*") if f.is_file()} == before, (again, err)
    line = user_error(capsys, "data", "merge", b, a, "--out", out)  # another merge into it: refused
    assert "--overwrite" in line
    assert "one of the sources" in user_error(capsys, "data", "merge", a, b, "--out", a)
    rc, _, err = run_cli(capsys, "data", "merge", b, "--out", out, "--overwrite")
    assert rc == 0, err
    assert LeRobotReader(out).num_episodes("train") == 2


def test_merge_names_the_differing_feature_and_both_shapes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = _two_split_dataset(tmp_path / "a", 0), _two_split_dataset(tmp_path / "b", 1, state_dim=8)
    line = user_error(capsys, "data", "merge", a, b, "--out", tmp_path / "m")
    assert "observation.state: tensor [7] vs tensor [8]" in line, line
    assert len(line) < 400, "one short line, not dict dumps"


# ---- conventions ---------------------------------------------------------------------------------------------


def test_version_and_python_dash_m(capsys: pytest.CaptureFixture[str]) -> None:
    import vla

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"vla {vla.__version__}"
    res = subprocess.run([sys.executable, "-m", "vla", "--version"], capture_output=True, text=True, cwd=REPO,
                         timeout=120)  # fmt: skip
    assert res.returncode == 0 and res.stdout.strip() == f"vla {vla.__version__}", res.stderr


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["sim", "generate"], ["(default: 1)", "(default: 0)", "(default: none)", "(default: 128)"]),
        (["model", "init"], ["(default: 0)"]),
        (["data", "convert"], ["(default: av1)"]),
    ],
)
def test_help_shows_defaults(capsys: pytest.CaptureFixture[str], argv: list[str], needles: list[str]) -> None:
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    text = re.sub(r"\s+", " ", capsys.readouterr().out)
    for needle in needles:
        assert needle in text, (needle, text)


# ---- configs and mixtures as the README shows them -------------------------------------------------------------


def test_data_presets_load_by_name_and_unknown_names_list_the_known_ones() -> None:
    from vla.config import ConfigError, DataConfig, load_config

    assert load_config(DataConfig, "droid", ["batch_size=4"]).batch_size == 4  # the folder follows the class
    with pytest.raises(ConfigError) as e:
        load_config(DataConfig, "drod")
    msg = str(e.value)
    assert "Did you mean droid?" in msg and "Known: bridge, droid" in msg and "  " not in msg


def test_bridge_mixture_resolves_the_fixture_linked_as_its_comment_says(
    bridge_fixture: Path, tmp_path: Path
) -> None:
    from vla.data.mixture import resolve_mixture

    comment = (REPO / "data_mixtures" / "bridge.yaml").read_text()
    assert "oxe_bridge_dataset_octo_debug data/oxe/bridge_dataset" in comment
    (tmp_path / "oxe").mkdir()
    (tmp_path / "oxe" / "bridge_dataset").symlink_to(bridge_fixture.parent)
    resolved = resolve_mixture("bridge", tmp_path / "oxe")
    assert [(d.name, d.path.resolve(), d.format) for d in resolved.datasets] == [
        ("bridge_dataset", bridge_fixture.resolve(), "rlds")
    ]


# ---- previews --------------------------------------------------------------------------------------------------


def test_preview_shows_raw_and_converted_data_alike_with_named_cameras_and_dims(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Same camera slots in the same order and the same named state/action traces for an RLDS dataset and its
    LeRobot conversion; camera panels carry their label."""
    from vla.data.preview import episode_content
    from vla.data.readers import open_dataset
    from vla.data.writers.rlds import droid_features, synthetic_droid_episode, write_rlds

    rng = np.random.default_rng(5)
    write_rlds(tmp_path / "droid" / "1.0.0", "droid", {"train": [synthetic_droid_episode(rng, 6, (24, 32, 3))]},
               *droid_features((24, 32, 3)))  # fmt: skip
    assert main(["data", "convert", str(tmp_path / "droid"), str(tmp_path / "conv"), "--to", "lerobot",
                 "--no-video"]) == 0  # fmt: skip
    contents = []
    for path in (tmp_path / "droid", tmp_path / "conv"):
        reader = open_dataset(path)
        contents.append(episode_content(reader, "train", 0, reader.read_episode("train", 0).steps))
    (raw_cams, raw_traces), (conv_cams, conv_traces) = contents
    assert [c[0].split()[0] for c in raw_cams] == [c[0].split()[0] for c in conv_cams] == [
        "primary", "secondary", "wrist"
    ]  # fmt: skip
    assert list(raw_traces) == list(conv_traces) == ["franka_droid state", "franka_droid action"]
    spec = get_embodiment("franka_droid")
    for title, names in (
        ("franka_droid state", spec.state_names()),
        ("franka_droid action", spec.action_names()),
    ):
        assert raw_traces[title][2] == conv_traces[title][2] == names
        np.testing.assert_array_equal(raw_traces[title][1], conv_traces[title][1])
    out = tmp_path / "p.gif"
    capsys.readouterr()
    assert main(["data", "preview", str(tmp_path / "conv"), "--out", str(out)]) == 0
    from PIL import Image

    with Image.open(out) as gif:
        frame = np.asarray(gif.convert("RGB"))
    strip = frame[:12, :80].astype(float)  # the label strip: dark with light text
    assert (strip < 40).mean() > 0.6 and (strip > 200).any()


def test_long_data_commands_show_episode_progress_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """convert / validate / merge / stats: a bar with episode counts on stderr (on a terminal, or progress=True)."""
    from vla.data.convert import convert_dataset
    from vla.data.merge import merge_datasets
    from vla.data.stats import compute_stats
    from vla.data.validate import validate_dataset

    src = widowx_dataset(tmp_path / "src")
    capsys.readouterr()
    for run in (
        lambda p: convert_dataset(src, tmp_path / "c", progress=p),
        lambda p: validate_dataset(src, progress=p),
        lambda p: merge_datasets([src], tmp_path / "m", progress=p, overwrite=True),
        lambda p: compute_stats(src, progress=p),
    ):
        run(False)
        assert "3/3" not in capsys.readouterr().err
        shutil.rmtree(tmp_path / "c", ignore_errors=True)
        run(True)
        err = capsys.readouterr().err
        assert "3/3" in err and "ep" in err, err
        shutil.rmtree(tmp_path / "c", ignore_errors=True)


def test_merge_of_datasets_with_png_images_keeps_the_frames(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = widowx_dataset(tmp_path / "a", num_episodes=2)
    b = widowx_dataset(tmp_path / "b", num_episodes=1, seed=3)
    rc, _, err = run_cli(capsys, "data", "merge", a, b, "--out", tmp_path / "m")
    assert rc == 0, err
    merged, src = LeRobotReader(tmp_path / "m"), LeRobotReader(b)
    key = "observation.images.front"
    frames = list(range(6))
    np.testing.assert_array_equal(
        merged.read_images("train", 2, frames, [key])[key], src.read_images("train", 0, frames, [key])[key]
    )


def test_stats_coverage_accepts_per_dataset_keys(widowx: Path) -> None:
    """A checkpoint keyed as training keyed its stats (``<embodiment>@<dataset>`` only) covers that embodiment."""
    from vla.data.normalize import StatsFile
    from vla.data.stats import compute_stats
    from vla.models.hub import stats_coverage

    full = compute_stats(widowx, progress=False)
    per_dataset = StatsFile(stats={k: v for k, v in full.stats.items() if "@" in k})
    assert list(per_dataset.stats) == ["widowx_bridge@widowx"]
    assert stats_coverage(per_dataset, ["widowx_bridge", "sim_ur5e"]) == {
        "widowx_bridge": True,
        "sim_ur5e": False,
    }
    half = StatsFile(stats={"widowx_bridge": {"state": full.stats["widowx_bridge"]["state"]}})
    assert stats_coverage(half, ["widowx_bridge"]) == {"widowx_bridge": False}  # action stats missing
