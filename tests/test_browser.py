"""Real-browser test: JupyterLab headless, notebook 00 in Debian's chromium via playwright.

Run All, move the speedup widget's slider, assert its output changed; keep a screenshot
(build/artifacts/browser_00_roofline.png).
"""
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = ROOT / "build" / "artifacts"
pytestmark = [pytest.mark.browser, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian chromium not installed (apt-get install chromium)")
    shutil.copy(ROOT / "notebooks" / "00_roofline.ipynb", tmp_path / "00_roofline.ipynb")
    port = _free_port()
    env = dict(os.environ, SPECBOOK_FAST="1")
    env.pop("MPLBACKEND", None)
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         "--ServerApp.token=", "--ServerApp.password=", "--ServerApp.disable_check_xsrf=True",
         f"--ServerApp.root_dir={tmp_path}", "--LabApp.expose_app_in_browser=True", "--allow-root"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(120):
        try:
            urllib.request.urlopen(url + "/api", timeout=1)
            break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("JupyterLab did not start: " + (tmp_path / "lab.log").read_text()[-2000:])
    yield url
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()


def _widget_text(page) -> str:
    loc = page.locator(".jp-OutputArea-output:has-text('expected speedup=')").last
    return loc.inner_text() if loc.count() else ""


def test_notebook_00_runs_and_widget_reacts(lab):
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(lab + "/lab/tree/00_roofline.ipynb")
        page.wait_for_selector(".jp-Notebook", timeout=120_000)
        page.wait_for_function("window.jupyterapp && window.jupyterapp.shell.currentWidget", timeout=120_000)
        page.wait_for_function("window.jupyterapp.shell.currentWidget.sessionContext?.session?.kernel?.status === 'idle'",
                               timeout=120_000)
        # Run All through the real menu (Run > Run All Cells)
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
        # the widget's slider appears once the last cells ran
        page.wait_for_selector(".widget-slider .noUi-handle, .widget-hslider .noUi-handle", timeout=900_000)
        page.wait_for_function("document.body.innerText.includes('SPECBOOK_SUMMARY')", timeout=300_000)
        errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']:has-text('Error')")
        assert errors.count() == 0, errors.first.inner_text()
        before = _widget_text(page)
        assert "expected speedup=" in before
        handle = page.locator(".noUi-handle").first  # alpha
        handle.scroll_into_view_if_needed()
        handle.click()
        for _ in range(10):
            page.keyboard.press("ArrowRight")
        deadline = time.time() + 60
        after = before
        while after == before and time.time() < deadline:
            page.wait_for_timeout(500)
            after = _widget_text(page)
        assert after != before and "expected speedup=" in after
        page.screenshot(path=str(ARTIFACTS / "browser_00_roofline.png"), full_page=False)
        browser.close()
