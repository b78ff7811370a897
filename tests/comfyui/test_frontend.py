"""The shipped workflows in ComfyUI's own frontend, as a user meets them: a real server
(COMFYUI_PATH) with stand-in weights of the SD1.5 layout, its web UI in headless Chromium at
1920x1080 (tests/comfyui/frontend.py).

- Each example_workflows/*.json loads the way a dropped file does without a page error, and the
  prompt the frontend builds for it (``app.graphToPrompt``, what Run sends) is the one
  tests/comfyui/workflow_ui.to_api builds - the conversion test_server.py queues them with.
- Opened the way the template browser opens it (fitted to the window), no two nodes overlap at the
  size the frontend draws them (every widget shown), and the zoom it opens at draws node text (not
  the low-quality boxes); its card in the template browser shows its thumbnail.
- The quick workflows, run from the page with the Run button in their numbered order, finish and
  show their images (both samplers', the comparison, the report chart) and the report's text.

Needs Playwright and a Chromium; skipped with the reason otherwise.
"""
from __future__ import annotations

import json
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
if not COMFYUI_PATH:
    pytest.skip("COMFYUI_PATH is not set: the frontend test SKIPPED", allow_module_level=True)
import frontend  # noqa: E402

if frontend.available():
    pytest.skip(f"{frontend.available()}: the frontend test SKIPPED", allow_module_level=True)

import architectures as models  # noqa: E402
import make_workflows  # noqa: E402
from comfy_server import Server  # noqa: E402
from workflow_ui import to_api  # noqa: E402

from comfy_modelopt.safetensors_io import write_file  # noqa: E402

NAMES = [n[:-len(".json")] for n in make_workflows.WORKFLOWS]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tmp_path_factory.mktemp("frontend")
    models_dir = base / "models"
    for sub in ("checkpoints", "diffusion_models"):
        (models_dir / sub).mkdir(parents=True)
    # the one file the workflows' notes name: stand-in weights in SD1.5's layout
    write_file(str(models_dir / "checkpoints" / make_workflows.CHECKPOINT), models.sd15_checkpoint())
    srv = Server(base, models_dir)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def page(server):
    with frontend.page_on(server.url) as p:
        yield p
        assert not p.errors, p.errors


def test_shipped_workflows_load_in_the_frontend_and_queue_what_the_tests_queue(server, page):
    info = server.get("/object_info")
    for name in make_workflows.WORKFLOWS:
        with open(os.path.join(make_workflows.FOLDER, name)) as f:
            ui = json.load(f)
        queued = page.evaluate("async (wf) => { await window.app.loadGraphData(wf); "
                               "return (await window.app.graphToPrompt()).output; }", ui)
        queued = {k: {kk: vv for kk, vv in v.items() if kk != "_meta"} for k, v in queued.items()}
        assert queued == to_api(ui, info), name


def test_templates_open_laid_out_readable_and_with_thumbnails(page):
    bad = {}
    for name in NAMES:
        view = frontend.open_template(page, name)
        problems = [f"{a!r} overlaps {b!r}" for a, b in frontend.overlaps(view["nodes"])]
        if view["low_quality"]:
            problems.append(f"opens at {view['scale']:.0%}, where node text is not drawn")
        if not os.path.exists(os.path.join(make_workflows.FOLDER, name + ".jpg")):
            problems.append("no thumbnail (make_workflows.py --thumbnails)")
        if problems:
            bad[name] = problems
    assert not bad, bad
    # the template browser itself: the pack's category lists every workflow, and each card shows its
    # thumbnail (the frontend's placeholder where the picture is missing is not THUMBNAIL_WIDTH wide)
    page.locator(".side-bar-button", has_text="Templates").first.click()
    page.get_by_text(frontend.PACK, exact=True).first.click()
    page.wait_for_timeout(2000)
    cards = page.evaluate("""(names) => Object.fromEntries(names.map(name => {
        const dialog = document.querySelector('[role=dialog]') || document;
        const title = [...dialog.querySelectorAll('*')].find(e => e.children.length === 0 &&
                                                                   e.textContent.trim() === name);
        let card = title, img = null;
        for (let i = 0; card && !img && i < 8; i++) { card = card.parentElement; img = card && card.querySelector('img'); }
        return [name, img ? (img.complete ? img.naturalWidth : -1) : null];
    }))""", NAMES)
    page.keyboard.press("Escape")
    assert cards == {n: frontend.THUMBNAIL_WIDTH for n in NAMES}, cards


def _drawn_outputs(page) -> dict:
    """title -> what the node shows after a run: its images' pixel sizes, or its text's length."""
    return page.evaluate("""() => Object.fromEntries(window.app.graph._nodes.map(n => [n.title,
        n.imgs ? n.imgs.map(i => [i.naturalWidth, i.naturalHeight])
               : (n.widgets || []).filter(w => w.name === 'preview_text' || w.type === 'customtext' ||
                                               w.name === 'preview').map(w => String(w.value || '').length)]))""")


def _run_from_page(page, server, timeout: float = 1500) -> None:
    before = len(server.get("/history"))
    page.get_by_role("button", name="Run", exact=True).first.click()
    deadline = time.time() + timeout
    while time.time() < deadline:
        time.sleep(2)
        q = server.get("/queue")
        if not q["queue_running"] and not q["queue_pending"] and len(server.get("/history")) > before:
            break
    else:
        raise AssertionError("the run did not finish")
    entry = list(server.get("/history").values())[-1]
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
    page.wait_for_timeout(1500)  # the executed messages reach the canvas


@pytest.mark.parametrize("name", [n for n in NAMES if "(quick)" in n])
def test_quick_workflows_run_from_the_page_and_show_their_results(page, server, name):
    frontend.open_template(page, name)
    _run_from_page(page, server)
    shown = _drawn_outputs(page)
    images = ["Image"] if "Load" in name else ["Quantized", "16-bit", "16-bit | quantized | difference",
                                                 "Report (chart)"]
    texts = ["Report (checked when loading)"] if "Load" in name else ["Report"]
    missing = [t for t in images if not shown.get(t) or not all(w > 0 and h > 0 for w, h in shown[t])]
    missing += [t for t in texts if not shown.get(t) or not max(shown[t]) > 100]
    assert not missing, (missing, shown)
