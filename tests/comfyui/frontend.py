"""ComfyUI's own frontend in headless Chromium, driven as a user does: open a workflow the way the
template browser opens it, measure what the canvas draws, press Run.  Used by test_frontend.py and
by make_workflows.py (the template thumbnails are screenshots taken here).

Needs Playwright (``pip install playwright``) and a Chromium (``CHROMIUM``, default
/usr/bin/chromium: Debian's ``chromium`` package)."""
from __future__ import annotations

import contextlib
import os

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
PACK = "comfy-modelopt"  # the folder name in custom_nodes: the template browser's category
VIEWPORT = {"width": 1920, "height": 1080}  # a common desktop window; the layouts are checked at it
THUMBNAIL_WIDTH = 640

# The template browser's own call (the frontend's loadWorkflowTemplate): the workflow from the
# pack's example_workflows route, loaded with openSource "template" - which fits it to the window -
# then each node's rectangle as drawn (title bar included, grown to show every widget).
OPEN_TEMPLATE = """async ([module, name]) => {
  const wf = await (await fetch(`/api/workflow_templates/${module}/${encodeURIComponent(name)}.json`)).json();
  await window.app.loadGraphData(wf, true, true, name, {openSource: 'template'});
  await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  const c = window.app.canvas;
  return {scale: c.ds.scale, low_quality: c.low_quality,
          nodes: window.app.graph._nodes.map(n => ({id: n.id, type: n.type, title: n.title, rect: [...n.boundingRect]}))};
}"""


def available() -> str | None:
    """Why the browser cannot run here, or None."""
    if not os.path.exists(CHROMIUM):
        return f"no Chromium at {CHROMIUM} (set CHROMIUM; Debian: apt install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright is not installed (pip install playwright)"
    return None


@contextlib.contextmanager
def page_on(server_url: str):
    """A page of ComfyUI's frontend at ``server_url``, loaded, its first-visit dialogs closed; the
    page errors it raised are collected in ``page.errors``."""
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--no-first-run", "--disable-sync"])
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.errors = []
            page.on("pageerror", lambda e: page.errors.append(str(e)))
            page.goto(server_url, wait_until="domcontentloaded")
            page.wait_for_function("() => window.app && window.app.graph", timeout=180_000)
            page.wait_for_timeout(2000)  # the template browser opens itself on a first visit
            page.keyboard.press("Escape")
            yield page
        finally:
            browser.close()


def open_template(page, name: str) -> dict:
    """Open example workflow ``name`` (file name without .json) as the template browser does."""
    return page.evaluate(OPEN_TEMPLATE, [PACK, name])


def overlaps(nodes: list) -> list:
    """Pairs of node titles whose drawn rectangles intersect."""
    out = []
    for i, a in enumerate(nodes):
        ax, ay, aw, ah = a["rect"]
        for b in nodes[i + 1:]:
            bx, by, bw, bh = b["rect"]
            if ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah:
                out.append((a["title"], b["title"]))
    return out


def close_toasts(page) -> None:
    for button in page.locator(".p-toast-close-button").all():
        with contextlib.suppress(Exception):
            button.click(timeout=1000)


# the graph's rectangle on the page (CSS pixels): its nodes' drawn rectangles, through the view
GRAPH_ON_PAGE = """() => {
  const c = window.app.canvas, box = c.canvas.getBoundingClientRect();
  const r = window.app.graph._nodes.map(n => n.boundingRect);
  const lo = c.ds.convertOffsetToCanvas([Math.min(...r.map(b => b[0])), Math.min(...r.map(b => b[1]))]);
  const hi = c.ds.convertOffsetToCanvas([Math.max(...r.map(b => b[0] + b[2])), Math.max(...r.map(b => b[1] + b[3]))]);
  return [box.left + lo[0], box.top + lo[1], hi[0] - lo[0], hi[1] - lo[1]];
}"""


def thumbnail(page, path: str, width: int = THUMBNAIL_WIDTH) -> None:
    """The graph as it opened (the window's panels, minimap and notices left out), as a JPEG
    ``width`` pixels wide: the template card's picture."""
    import io

    from PIL import Image
    close_toasts(page)
    page.evaluate("() => window.app.extensionManager.setting.set('Comfy.Minimap.Visible', false)")
    page.wait_for_timeout(300)
    x, y, w, h = page.evaluate(GRAPH_ON_PAGE)
    pad = 12
    png = page.screenshot(clip={"x": max(x - pad, 0), "y": max(y - pad, 0), "width": w + 2 * pad, "height": h + 2 * pad})
    img = Image.open(io.BytesIO(png)).convert("RGB")
    img = img.resize((width, round(img.height * width / img.width)), Image.LANCZOS)
    img.save(path, "JPEG", quality=82, optimize=True)
