"""``vla eval report`` renders in a real browser: headless Chromium (Debian's ``chromium``, installed by ``make
test`` when missing) loads the self-contained page offline, every image and video element must load (checked by
a script injected into a copy of the page), and a screenshot is taken. A page with a broken image must fail the
same check (so the check can fail)."""

from __future__ import annotations

import contextlib
import html
import json
import os
import shutil
import signal
import subprocess
import sys
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


# Chromium runs under a small init: a Python process that is a Linux child subreaper (Chromium's orphaned helpers
# come back to it, not to the pytest worker, which is one too: tests/conftest.py), starts the browser in a process
# group of its own with normal scheduling, reaps every exit at once, and once the browser has exited kills and
# reaps what is left of its group. Chromium once hung a run: started from a pytest worker that SVT-AV1 had made
# real-time (SCHED_FIFO 99, see vla.runtime.undo_realtime), it spun at that priority on both cores, so neither
# pytest-timeout nor anything else ran until make's deadline. Now a browser that does not finish fails this test
# after BROWSER_TIMEOUT s: the init's whole session is killed and nothing is waited on further.
BROWSER_INIT = """
import ctypes, os, signal, sys, time
ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
browser = os.fork()
if browser == 0:
    os.setpgid(0, 0)
    # never real-time, whatever the caller is (0x40000000: the SCHED_RESET_ON_FORK flag bit)
    if os.sched_getscheduler(0) & ~0x40000000 in (os.SCHED_FIFO, os.SCHED_RR):
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    os.execv(sys.argv[1], sys.argv[1:])
try:
    os.setpgid(browser, browser)  # also here: no race with the child's own call
except OSError:
    pass
code, deadline = None, None
while True:
    try:
        pid, status = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        break
    if pid == browser:
        code, deadline = os.waitstatus_to_exitcode(status), time.monotonic() + 5
    if pid == 0:
        if deadline is not None and time.monotonic() > deadline:  # the browser is gone: so is what it left
            left = [browser]  # its process group, and every child of ours (a helper in a session of its own)
            for stat in filter(str.isdigit, os.listdir("/proc")):
                try:
                    text = open(f"/proc/{stat}/stat").read()
                except (OSError, ValueError):
                    continue
                if text[text.rindex(")") + 2 :].split()[1] == str(os.getpid()):
                    left.append(-int(stat))
            for target in left:
                try:
                    os.killpg(target, signal.SIGKILL) if target > 0 else os.kill(-target, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 5
        time.sleep(0.05)
sys.exit(code if code is not None and code >= 0 else 1)
"""
BROWSER_TIMEOUT = 120
BROWSER_FLAGS = ("--headless", "--no-sandbox", "--no-zygote", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-crash-reporter", "--disable-breakpad", "--no-first-run")  # fmt: skip


def _run_browser(exe: str, args: list[str], tmp: Path) -> str:
    """Run headless Chromium with ``args`` under ``BROWSER_INIT`` and return its stdout; a non-zero exit or a run
    over ``BROWSER_TIMEOUT`` s fails the test with the command and the end of Chromium's stderr."""
    out, err = tmp / "chromium.stdout", tmp / "chromium.stderr"
    cmd = [exe, *BROWSER_FLAGS, f"--user-data-dir={tmp / 'profile'}", *args]
    with out.open("wb") as fo, err.open("wb") as fe:
        init = subprocess.Popen([sys.executable, "-c", BROWSER_INIT, *cmd], stdout=fo, stderr=fe,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        code = init.wait(timeout=BROWSER_TIMEOUT)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        if code is None:
            _kill_session(init)
    stderr = err.read_text(errors="replace")[-2000:]
    if code is None:
        pytest.fail(f"Chromium did not finish in {BROWSER_TIMEOUT} s (killed): {' '.join(cmd)}\n{stderr}")
    if code != 0:
        pytest.fail(f"Chromium exited with {code}: {' '.join(cmd)}\n{stderr}")
    return out.read_text(errors="replace")


def _kill_session(init: subprocess.Popen) -> None:
    """SIGKILL every process of ``init``'s session and reap ``init`` (a browser that did not finish), waiting at
    most 10 s: a process stuck in the kernel is left behind and named rather than hanging the run."""
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getsid(int(entry.name)) == init.pid:
                os.kill(int(entry.name), signal.SIGKILL)
    try:
        init.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"Chromium's init (pid {init.pid}) did not end 10 s after SIGKILL: stuck in the kernel")


def _browser_check(exe: str, page: Path, tmp: Path) -> dict:
    """Load a copy of ``page`` with the checker script in headless Chromium (no network) and return its verdict."""
    probe = tmp / f"{page.stem}_probe.html"
    probe.write_text(page.read_text().replace("</body>", CHECK + "</body>"))
    stdout = _run_browser(exe, ["--virtual-time-budget=15000", "--proxy-server=127.0.0.1:9", "--dump-dom",
                                probe.as_uri()], tmp)  # fmt: skip
    start = stdout.find('data-check="')
    stderr = (tmp / "chromium.stderr").read_text(errors="replace")
    assert start >= 0, f"the checker did not run: {stdout[-1000:]}\nChromium's stderr: {stderr[-2000:]}"
    value = stdout[start + len('data-check="') :].split('"', 1)[0]
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
    _run_browser(exe, ["--hide-scrollbars", "--window-size=1200,1600", f"--screenshot={shot}", page.as_uri()],
                 tmp_path)  # fmt: skip
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    # the same check on a page with a broken image and a broken video reports them
    broken = tmp_path / "broken.html"
    broken.write_text('<html><body><img src="data:image/png;base64,AAAA"><video src="data:video/mp4;base64,AAAA">'
                      "</video></body></html>")  # fmt: skip
    bad = _browser_check(exe, broken, tmp_path)
    assert bad["broken_images"] == 1 and bad["broken_videos"] == 1, bad
