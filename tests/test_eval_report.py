"""``vla eval report`` renders in a real browser: headless Chromium (Debian's ``chromium``, installed by ``make
test`` when missing) loads the self-contained page offline, every image and video element must load (checked by
a script injected into a copy of the page), and a screenshot is taken. A page with a broken image must fail the
same check (so the check can fail)."""

from __future__ import annotations

import html
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from vla.cli import main
from vla.eval.rollout import EvalConfig, evaluate

CHECK = """<script>
window.addEventListener("load", () => {
  const imgs = [...document.images], vids = [...document.querySelectorAll("video")];
  const ready = (v) => new Promise((res) => {
    if (v.readyState >= 2) return res(true);
    v.addEventListener("loadeddata", () => res(true), {once: true});
    v.addEventListener("error", () => res(false), {once: true});
    setTimeout(() => res(v.readyState >= 2), 8000);
  });
  Promise.all(vids.map(ready)).then((ok) => {
    document.body.setAttribute("data-check", JSON.stringify({
      images: imgs.length, broken_images: imgs.filter((i) => !(i.complete && i.naturalWidth > 0)).length,
      videos: vids.length, broken_videos: ok.filter((x) => !x).length, video_widths: vids.map((v) => v.videoWidth),
      external: [...document.querySelectorAll("[src]")].filter((e) => !e.getAttribute("src").startsWith("data:")).length,
    }));
  });
});
</script>"""


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip(
            "headless Chromium not installed (`make test` installs Debian's chromium when run as root)"
        )
    return exe


def _browser_check(exe: str, page: Path, tmp: Path) -> dict:
    """Load a copy of ``page`` with the checker script in headless Chromium (no network) and return its verdict."""
    probe = tmp / f"{page.stem}_probe.html"
    probe.write_text(page.read_text().replace("</body>", CHECK + "</body>"))
    out = subprocess.run(
        [exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--virtual-time-budget=15000",
         "--proxy-server=127.0.0.1:9", f"--user-data-dir={tmp / 'profile'}", "--dump-dom", probe.as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    start = out.stdout.find('data-check="')
    assert start >= 0, f"the checker did not run: {out.stderr[-2000:]}"
    value = out.stdout[start + len('data-check="') :].split('"', 1)[0]
    return json.loads(html.unescape(value))


def test_report_renders_in_chromium(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    exe = _chromium()
    kw = {"embodiment": "widowx", "task": "reach", "episodes": 2, "image_size": 32, "video_every": 1}
    evaluate(EvalConfig(policy="expert", out=str(tmp_path / "expert"), **kw), progress_bar=False)
    evaluate(EvalConfig(policy="random", out=str(tmp_path / "random"), max_steps=6, **kw), progress_bar=False)
    csv = tmp_path / "real.csv"
    csv.write_text("policy,success_rate\nexpert,0.9\nrandom,0.05\n")
    assert main(["eval", "gap", str(tmp_path / "expert"), str(tmp_path / "random"), "--reference", str(csv),
                 "--out", str(tmp_path / "gap")]) == 0  # fmt: skip
    page = tmp_path / "report" / "report.html"
    assert main(["eval", "report", str(tmp_path / "expert"), str(tmp_path / "random"), str(tmp_path / "gap"),
                 "--out", str(page)]) == 0  # fmt: skip
    text = page.read_text()
    assert "seed" in text and "randomization record" in text and "MMRV" in text
    check = _browser_check(exe, page, tmp_path)
    # overview plot + gap scatter; a success video of each expert episode and a failure video of each random one
    assert check["images"] == 2 and check["videos"] == 4, check
    assert check["broken_images"] == 0 and check["broken_videos"] == 0, check
    assert check["external"] == 0 and all(w == 32 for w in check["video_widths"]), check
    shot = tmp_path / "report.png"
    subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1200,1600",
                    f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, timeout=120, check=True)  # fmt: skip
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    # the same check on a page with a broken image and a broken video reports them
    broken = tmp_path / "broken.html"
    broken.write_text('<html><body><img src="data:image/png;base64,AAAA"><video src="data:video/mp4;base64,AAAA">'
                      "</video></body></html>")  # fmt: skip
    bad = _browser_check(exe, broken, tmp_path)
    assert bad["broken_images"] == 1 and bad["broken_videos"] == 1, bad
