"""ComfyUI's two workflow formats, for the shipped example workflows.

``Graph`` builds a UI-format workflow (what ComfyUI's canvas saves and loads, what
``example_workflows/`` ships): nodes with positions, their inputs (sockets and widgets, in the
node definition's order), links, and ``widgets_values`` in the order the frontend writes them.
``to_api`` turns such a workflow into the API format ``POST /prompt`` takes, the way the
frontend does when you press Queue: link inputs become ``[node id, output slot]``, widget values
are matched to the node definition's widget inputs in order (an INT with a "control after
generate" widget carries one extra value), notes and bypassed nodes are left out.  Both read the
node definitions from a running server's ``/object_info``.
"""
from __future__ import annotations

WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")
NOTE_TYPES = ("Note", "MarkdownNote")


def _inputs(info: dict) -> list[tuple[str, str, dict]]:
    """(name, type, options) of a node definition's inputs, required then optional, in order."""
    out = []
    for section in ("required", "optional"):
        spec = info["input"].get(section, {})
        for name in info.get("input_order", {}).get(section, list(spec)):
            entry = spec[name]
            kind = entry[0]
            options = entry[1] if len(entry) > 1 and isinstance(entry[1], dict) else {}
            out.append((name, "COMBO" if isinstance(kind, list) else kind, options))
    return out


def _is_widget(kind: str) -> bool:
    return kind in WIDGET_TYPES


class Graph:
    """A UI-format workflow under construction: ``add`` a node (its widget values by name, the
    rest from the definition's defaults), ``link`` an output to an input, ``note`` a text."""

    def __init__(self, object_info: dict):
        self.info = object_info
        self.nodes, self.links = [], []

    def add(self, kind: str, pos: tuple, title: str | None = None, size: tuple = (320, 120), **widgets) -> int:
        info = self.info[kind]
        node_id = len(self.nodes) + 1
        inputs, values = [], []
        for name, typ, options in _inputs(info):
            entry = {"name": name, "type": typ, "link": None}
            if _is_widget(typ):
                entry["widget"] = {"name": name}
                if name not in widgets and "default" not in options:
                    raise ValueError(f"{kind}: widget {name!r} has no default; give it a value")
                values.append(widgets.pop(name, options.get("default")))
                if options.get("control_after_generate"):
                    values.append("fixed")
            inputs.append(entry)
        if widgets:
            raise ValueError(f"{kind} has no widgets {sorted(widgets)}")
        outputs = [{"name": name, "type": typ, "links": [], "slot_index": i}
                   for i, (name, typ) in enumerate(zip(info.get("output_name", info["output"]), info["output"]))]
        node = {"id": node_id, "type": kind, "pos": list(pos), "size": list(size), "flags": {}, "order": node_id - 1,
                "mode": 0, "inputs": inputs, "outputs": outputs, "properties": {"Node name for S&R": kind},
                "widgets_values": values}
        if title:
            node["title"] = title
        self.nodes.append(node)
        return node_id

    def note(self, text: str, pos: tuple, size: tuple = (420, 260), title: str = "Read me") -> int:
        node_id = len(self.nodes) + 1
        self.nodes.append({"id": node_id, "type": "MarkdownNote", "pos": list(pos), "size": list(size), "flags": {},
                           "order": node_id - 1, "mode": 0, "inputs": [], "outputs": [], "properties": {},
                           "widgets_values": [text], "title": title, "color": "#432", "bgcolor": "#653"})
        return node_id

    def link(self, src: int, output: int | str, dst: int, input_name: str) -> None:
        s, d = self.nodes[src - 1], self.nodes[dst - 1]
        slot = output if isinstance(output, int) else next(i for i, o in enumerate(s["outputs"]) if o["name"] == output)
        target = next(i for i, x in enumerate(d["inputs"]) if x["name"] == input_name)
        link_id = len(self.links) + 1
        typ = s["outputs"][slot]["type"]
        self.links.append([link_id, src, slot, dst, target, typ])
        s["outputs"][slot]["links"].append(link_id)
        d["inputs"][target]["link"] = link_id

    def ui(self) -> dict:
        return {"last_node_id": len(self.nodes), "last_link_id": len(self.links), "nodes": self.nodes,
                "links": self.links, "groups": [], "config": {}, "extra": {"ds": {"scale": 0.8, "offset": [0, 0]}},
                "version": 0.4}


def to_api(ui: dict, object_info: dict) -> dict:
    """The API-format prompt the frontend queues for UI-format workflow ``ui``."""
    links = {l[0]: l for l in ui["links"]}
    prompt = {}
    for node in ui["nodes"]:
        if node["type"] in NOTE_TYPES or node.get("mode", 0) in (2, 4):  # notes; muted or bypassed nodes
            continue
        info = object_info[node["type"]]
        values = list(node.get("widgets_values", []))
        linked = {x["name"]: links[x["link"]] for x in node.get("inputs", []) if x.get("link") is not None}
        inputs = {}
        for name, typ, options in _inputs(info):
            if _is_widget(typ):
                if not values:
                    raise ValueError(f"node {node['id']} ({node['type']}): no value for widget {name!r}")
                inputs[name] = values.pop(0)
                if options.get("control_after_generate"):
                    values.pop(0)
            if name in linked:
                _, origin, slot, *_ = linked[name]
                inputs[name] = [str(origin), slot]
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return prompt
