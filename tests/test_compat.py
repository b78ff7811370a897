"""The node pack's check of ComfyUI's comfy-kitchen when ComfyUI loads it (comfyui/compat.py)."""
import logging
from importlib.metadata import PackageNotFoundError

import pytest

from comfy_modelopt.comfyui import compat


@pytest.mark.parametrize("found, outcome", [
    ("0.2.40", "ok"), ("0.3.1", "ok"), ("0.2.24", "note"), ("0.2.30.post1", "note"), ("0.2.23", "refused"),
    ("0.1.9", "refused"), (None, "missing")])
def test_kitchen_version_named_at_load(monkeypatch, caplog, found, outcome):
    def version(name):
        assert name == "comfy-kitchen"
        if found is None:
            raise PackageNotFoundError(name)
        return found
    monkeypatch.setattr(compat, "version", version)
    caplog.set_level(logging.INFO)
    if outcome in ("refused", "missing"):
        with pytest.raises(ImportError, match="needs comfy-kitchen" + (f" >= 0.2.24 \\(found {found}\\)"
                                                                        if found else "")):
            compat.check_kitchen()
        return
    assert compat.check_kitchen() == found
    noted = [r.getMessage() for r in caplog.records if "INT8 attention runtime" in r.getMessage()]
    assert bool(noted) == (outcome == "note"), noted
