"""The shipped workflows in ComfyUI's own frontend: a real server (COMFYUI_PATH) and its web UI in
headless Chromium.  Each example_workflows/*.json loads onto the canvas the way a dropped file
does (``app.loadGraphData``) without a page error, and the prompt the frontend builds for it
(``app.graphToPrompt``, what Queue sends) is the one tests/comfyui/workflow_ui.to_api builds -
the conversion test_server.py queues the workflows with.

Needs Playwright (``pip install playwright``) and a Chromium (``CHROMIUM``, default
/usr/bin/chromium: Debian's ``chromium`` package); skipped with the reason otherwise.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
if not COMFYUI_PATH:
    pytest.skip("COMFYUI_PATH is not set: the frontend test SKIPPED", allow_module_level=True)
if not os.path.exists(CHROMIUM):
    pytest.skip(f"no Chromium at {CHROMIUM} (set CHROMIUM; Debian: apt install chromium): the frontend test "
                f"SKIPPED", allow_module_level=True)
playwright = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install "
                                                                "playwright): the frontend test SKIPPED")

import make_workflows  # noqa: E402
from comfy_server import Server  # noqa: E402
from workflow_ui import to_api  # noqa: E402


def test_shipped_workflows_load_in_the_frontend_and_queue_what_the_tests_queue(tmp_path):
    (tmp_path / "models").mkdir()
    server = Server(tmp_path, tmp_path / "models")
    try:
        info = server.get("/object_info")
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=[
                "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                "--no-first-run", "--disable-sync"])
            page = browser.new_page()
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server.url, wait_until="domcontentloaded")
            page.wait_for_function("() => window.app && window.app.graph", timeout=180_000)
            for name in make_workflows.WORKFLOWS:
                with open(os.path.join(make_workflows.FOLDER, name)) as f:
                    ui = json.load(f)
                queued = page.evaluate("async (wf) => { await window.app.loadGraphData(wf); "
                                       "return (await window.app.graphToPrompt()).output; }", ui)
                queued = {k: {kk: vv for kk, vv in v.items() if kk != "_meta"} for k, v in queued.items()}
                assert queued == to_api(ui, info), name
            browser.close()
        assert not errors, errors
    finally:
        server.stop()
