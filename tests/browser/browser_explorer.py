"""The explorer in a real browser, used as a newcomer uses it: JupyterLab serves
notebooks/explorer.ipynb, chromium runs all its cells from the command palette, then clicks
Step, Step and Run; the panel must reach the last step and show a different decoded image.

    make browser-test      # installs chromium (apt) and playwright (the `browser` extra) if missing

Playwright drives Debian's chromium (/usr/bin/chromium), not a browser of its own, which cannot
be downloaded here. The file name does not match `test_*.py`, so `pytest tests` (make test)
leaves it alone and the make target names it; a missing chromium or playwright is a failure.

Screenshots go to outputs/browser/. The server, its kernel and the Lab's engines all carry one
marker in their environment; after the test, pass or fail, every process with it must be gone.
"""

import base64
import io
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import sync_playwright

from xdit_lab.distributed import free_port

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = "notebooks/explorer.ipynb"
SHOTS = REPO / "outputs" / "browser"
CHROMIUM = "/usr/bin/chromium"
KERNEL_IDLE = re.compile(r"^Python \(xdit-lab\) \| Idle$")  # the status bar, kernel connected and idle
MARKER = "XDIT_LAB_BROWSER_TEST"  # set in the server's environment, inherited by kernel and engines

SERVER_START_S = 60  # jupyter lab answering /api/status
RUN_ALL_S = 120  # every cell executed: the Lab started (~10 s on 2 busy cores), the panel drawn
CLICK_S = 60  # one button's answer (Run: the remaining steps of the digits model)
CLEANUP_S = 30  # after the server stops: kernel, engines, controller gone


# ---- the server -------------------------------------------------------------------------------------


def processes_with(marker_value: str) -> dict[int, str]:
    """pid -> command line of every process whose environment carries the marker."""
    found = {}
    needle = f"{MARKER}={marker_value}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        except OSError:  # gone meanwhile, or not ours
            continue
    return found


@pytest.fixture
def jupyter(tmp_path):
    """JupyterLab on 127.0.0.1 with a token, serving a copy of the notebooks (autosave must not
    rewrite the committed notebook); all its state in tmp_path. Stopped, and checked gone, after."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `make browser-test` installs it (apt-get install chromium)")
    root = tmp_path / "root"
    (root / "notebooks").mkdir(parents=True)
    shutil.copy(REPO / NOTEBOOK, root / NOTEBOOK)
    token, port, marker = secrets.token_hex(16), free_port(), secrets.token_hex(8)
    env = dict(
        os.environ,
        **{MARKER: marker},
        IPYTHONDIR=str(tmp_path / "ipython"),
        JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
        JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
        JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"),
    )
    # No news toast over the panel (and no request to the internet for it).
    notification = tmp_path / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    notification.parent.mkdir(parents=True)
    notification.write_text('{"fetchNews": "false", "checkForUpdates": false}')
    # Every cell rendered: by default JupyterLab renders only the cells near the view, and a cell
    # pushed below it by the panel's figures shows an empty prompt, as if it had never run.
    tracker = tmp_path / "settings" / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text('{"windowingMode": "none"}')
    SHOTS.mkdir(parents=True, exist_ok=True)
    for old in SHOTS.glob("*.png"):  # no screenshot of an earlier run may pass for this one's
        old.unlink()
    log = open(SHOTS / "jupyter.log", "w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--allow-root",
            "--ip=127.0.0.1",
            f"--port={port}",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
            "--ServerApp.port_retries=0",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=stop_with_parent,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + SERVER_START_S
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(
                        f"jupyter lab did not answer within {SERVER_START_S} s (exit code {server.poll()}); "
                        f"its log:\n{(SHOTS / 'jupyter.log').read_text()[-3000:]}"
                    )
                time.sleep(0.5)
        yield f"{url}/lab/tree/{NOTEBOOK}?token={token}"
    finally:
        stop_server(server)
        log.close()
        left = wait_gone(marker)
        if left:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            pytest.fail(
                f"still running {CLEANUP_S} s after jupyter lab stopped (now killed):\n"
                + "\n".join(f"  {pid}: {cmd}" for pid, cmd in left.items())
            )


def stop_with_parent() -> None:
    """In the server's process, before it starts: SIGTERM when pytest ends, even killed (Linux's
    PR_SET_PDEATHSIG), so that the server still shuts its kernel down, and the kernel its Lab."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def stop_server(server) -> None:
    """SIGTERM: the server shuts its kernels down (and the Lab its engines); SIGKILL if it hangs."""
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=CLEANUP_S)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)


def wait_gone(marker) -> dict[int, str]:
    deadline = time.monotonic() + CLEANUP_S
    while (left := processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


# ---- the test ---------------------------------------------------------------------------------------


@pytest.mark.timeout(180, func_only=True)  # the fixture's start and cleanup have their own timeouts
def test_run_all_then_step_step_run(jupyter):
    started = time.monotonic()
    failure = None
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], timeout=60_000)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.set_default_timeout(30_000)  # any single action that does not happen fails, not hangs
            try:
                drive(page, jupyter)
            except Exception as error:  # noqa: BLE001 - any failure: report it with what the page says
                failure = f"{type(error).__name__}: {error}\n\nthe page's error text:\n{failure_text(page)}"
        finally:
            browser.close()
    if failure:
        pytest.fail(f"{failure}\n\nscreenshots: {SHOTS}", pytrace=False)
    print(f"browser test: {time.monotonic() - started:.0f} s in the browser")


def drive(page, url):
    page.goto(url, timeout=60_000)
    # The kernel is started and connected: the status bar names it, idle.
    page.get_by_text(KERNEL_IDLE).wait_for(timeout=60_000)
    shot(page, "01-opened")

    run_all_cells(page)
    wait_for(
        page,
        "the end of Run All Cells",
        lambda: all_cells_ran(page),
        RUN_ALL_S,
        seen=lambda: f"prompts {prompts(page)}, kernel idle: {kernel_idle(page)}",
    )
    panel = page.locator(".xdit-lab-status")
    panel.wait_for(timeout=10_000)
    panel.scroll_into_view_if_needed()
    shot(page, "02-run-all")
    tables = page.get_by_text("Lab (cluster ")  # the rank table's caption
    assert tables.count() == 1, f"the rank table is shown {tables.count()} times"
    first = status(page)
    assert " of 20 " in first and "(done)" not in first, f"after Run All Cells the status line says {first!r}"
    before = latent_png(page)
    (SHOTS / "latent-before.png").write_bytes(before)
    step = int(first.split("step ")[1].split(" of")[0])
    click(page, "Step", f"step {step + 1} of 20")
    shot(page, "03-step")
    click(page, "Step", f"step {step + 2} of 20")
    shot(page, "04-step")
    click(page, "Run", "step 20 of 20 (done)")
    page.locator("img.xdit-lab-view-latent").scroll_into_view_if_needed()
    shot(page, "05-run")
    after = latent_png(page)
    (SHOTS / "latent-after.png").write_bytes(after)
    fraction = changed_fraction(before, after)
    print(f"decoded image: {fraction:.1%} of its pixels changed from {first!r} to step 20")
    # (a new title alone, "step 1" to "step 20" over the same image, changes about 1% of the pixels)
    assert fraction > 0.05, f"the decoded image barely changed ({fraction:.1%} of its pixels) from step {step} to 20"
    # each step measured against the serial run, and drawn in the step history
    assert "from serial" in status(page), f"the status line after Run says {status(page)!r}"
    assert page.locator("img.xdit-lab-view-history").count() == 1, "no step history after Run"
    # planning mode, for more GPUs than this Lab has: typed in, then Plan
    field = page.locator(".xdit-lab-plan-gpus input")
    field.fill("16")
    field.press("Enter")
    page.get_by_role("button", name="Plan", exact=True).click()
    plan = page.locator(".xdit-lab-plan")
    wait_for(page, "the plan for 16 GPUs", lambda: "16 GPUs, pixart" in plan.inner_text(), CLICK_S)
    plan.scroll_into_view_if_needed()
    shot(page, "06-plan")


# ---- the page ---------------------------------------------------------------------------------------


def failure_text(page) -> str:
    try:
        error = page.locator(".xdit-lab-error")
        if error.count():
            error.scroll_into_view_if_needed(timeout=2_000)
        shot(page, "failure")
        return page_errors(page)
    except Exception as error:  # noqa: BLE001 - the page itself may be gone
        return f"(the page could not be read: {error})"


def status(page) -> str:
    return page.locator(".xdit-lab-status").inner_text(timeout=5_000)


def page_errors(page) -> str:
    """The panel's error area and any stderr or error output of the notebook, as text."""
    texts = []
    for selector in (".xdit-lab-error", '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'):
        for element in page.locator(selector).all():
            text = element.inner_text(timeout=2_000).strip()
            if text:
                texts.append(f"[{selector}]\n{text}")
    return "\n".join(texts) or "(no error text on the page)"


def wait_for(page, what: str, condition, timeout_s: float, *, seen=None):
    """Poll condition() until it returns something true; fail early when the panel shows an error.
    `seen()`, when given, says in the failure what the page showed instead."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        if page.locator(".xdit-lab-error").count() and page.locator(".xdit-lab-error").inner_text().strip():
            raise AssertionError(f"the panel shows an error while waiting for {what}")
        page.wait_for_timeout(500)
    raise AssertionError(f"no {what} within {timeout_s:g} s" + (f"; the page showed {seen()}" if seen else ""))


def run_all_cells(page):
    """Run All Cells from the command palette (Ctrl+Shift+C), and see it start: the saved notebook
    already shows execution counts, so wait for a cell to be queued or running ([*])."""
    page.get_by_role("tab", name="explorer.ipynb").click()  # the notebook is the current widget
    palette = page.locator(".lm-CommandPalette-input")
    for _ in range(3):  # the shortcut may come before the app listens for it
        page.keyboard.press("Control+Shift+C")
        try:
            palette.wait_for(state="visible", timeout=5_000)
            break
        except PlaywrightTimeout:
            continue
    palette.fill("Run All Cells")
    page.locator(".lm-CommandPalette-item.lm-mod-active", has_text="Run All Cells").wait_for(timeout=5_000)
    page.keyboard.press("Enter")
    wait_for(page, "a running cell after Run All Cells", lambda: "*" in " ".join(prompts(page)), 30)


def prompts(page) -> list[str]:
    return [p.inner_text() for p in page.locator(".jp-CodeCell .jp-InputArea-prompt").all()]


def kernel_idle(page) -> bool:
    return page.get_by_text(KERNEL_IDLE).count() > 0


def all_cells_ran(page) -> bool:
    """Every code cell has an execution count, none is queued or running, and the kernel is idle."""
    found = prompts(page)
    return kernel_idle(page) and bool(found) and all(any(c.isdigit() for c in p) and "*" not in p for p in found)


def latent_png(page) -> bytes:
    """The bytes of the decoded image the panel shows (the widget's PNG, read from its blob URL)."""
    image = page.locator("img.xdit-lab-view-latent")
    assert image.count() == 1, f"{image.count()} decoded images on the page, expected 1"
    data = image.evaluate("""async (img) => {
        const bytes = new Uint8Array(await (await fetch(img.src)).arrayBuffer());
        let text = ''; for (const b of bytes) text += String.fromCharCode(b); return btoa(text); }""")
    return base64.b64decode(data)


def changed_fraction(before: bytes, after: bytes) -> float:
    a, b = (Image.open(io.BytesIO(png)).convert("RGB") for png in (before, after))
    assert a.size == b.size, f"the decoded image changed size: {a.size} -> {b.size}"
    return float((np.asarray(a) != np.asarray(b)).any(axis=2).mean())


def shot(page, name):
    page.screenshot(path=str(SHOTS / f"{name}.png"))


def click(page, name: str, expect: str):
    """Click a panel button; wait for `expect` in the status line and for the views it drew. The
    status line is updated first, and each refresh makes new image widgets, so the old latent
    image is marked and the new one awaited, loaded, with the kernel idle again."""
    page.locator("img.xdit-lab-view-latent").evaluate("img => img.dataset.old = 'yes'")
    buttons = page.get_by_role("button", name=name, exact=True)
    assert buttons.count() == 1, f"{buttons.count()} buttons named {name!r}"
    buttons.click()
    wait_for(page, f"{expect!r} in the status line after {name}", lambda: expect in status(page), CLICK_S)
    fresh = page.locator("img.xdit-lab-view-latent:not([data-old])")
    wait_for(
        page,
        f"the decoded image after {name}",
        lambda: (
            fresh.count() == 1 and fresh.evaluate("img => img.complete && img.naturalWidth > 0") and kernel_idle(page)
        ),
        CLICK_S,
    )
