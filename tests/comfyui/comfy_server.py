"""A real ComfyUI server for the tests and the workflow builder: ``main.py --cpu`` with this
repository in custom_nodes and a models folder of the caller's (--extra-model-paths-config),
driven over HTTP as a user's client drives it.

``COMFY_MODELOPT_TEST_SERVER_GPU=1``: ``main.py`` as shipped on the GPU instead (dynamic VRAM,
cudaMallocAsync), with the caller's PYTHONPATH less this repository (a GPU machine whose packages
come from a folder on it)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMFYUI_PATH = os.environ.get("COMFYUI_PATH", "")
GPU = bool(os.environ.get("COMFY_MODELOPT_TEST_SERVER_GPU"))  # main.py as shipped on the GPU (see above)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, base, models_dir):
        self.port = free_port()
        cfg = base / "extra_model_paths.yaml"
        folders = "".join(f"  {d}: {d}\n" for d in sorted(os.listdir(models_dir)))  # each a model folder
        cfg.write_text(f"modelopt_test:\n  base_path: {models_dir}\n  is_default: true\n{folders}")
        (base / "custom_nodes").mkdir()
        os.symlink(ROOT, base / "custom_nodes" / "comfy-modelopt")
        self.log = open(base / "server.log", "w")
        # the pack must import on its own (from custom_nodes), not from the caller's path
        path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                if p and os.path.realpath(p) != os.path.realpath(ROOT)] if GPU else []
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
        extra = ["--cpu"]
        if GPU:  # a GPU machine without the frontend's package: an empty web root (no browser here)
            (base / "web").mkdir()
            (base / "web" / "index.html").write_text("<html></html>")
            extra = ["--front-end-root", str(base / "web"), "--disable-auto-launch"]
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(COMFYUI_PATH, "main.py"), *extra, "--listen", "127.0.0.1",
             "--port", str(self.port), "--base-directory", str(base), "--extra-model-paths-config", str(cfg)],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=str(base))
        self.url = f"http://127.0.0.1:{self.port}"
        self.base = base
        deadline = time.time() + 240
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("ComfyUI exited:\n" + (base / "server.log").read_text()[-4000:])
            try:
                self.get("/object_info/KSampler")
                return
            except (urllib.error.URLError, ConnectionError):
                time.sleep(1)
        raise RuntimeError("ComfyUI did not start in time")

    def get(self, path):
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def post(self, path: str, doc: dict) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(doc).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            body = r.read()
        return json.loads(body) if body.strip() else {}

    def queue(self, workflow: dict) -> str:
        """Queue ``workflow`` as a client does; its prompt id.  Refused or partly dropped workflows
        (ComfyUI's input validation) raise AssertionError with ComfyUI's words."""
        try:
            answer = self.post("/prompt", {"prompt": workflow})
        except urllib.error.HTTPError as e:
            raise AssertionError(f"ComfyUI refused the workflow: {e.read().decode()[:2000]}") from None
        # ComfyUI queues what validates and drops outputs whose nodes do not: fail on any of it
        if answer.get("node_errors"):
            raise AssertionError(f"ComfyUI dropped outputs: {json.dumps(answer['node_errors'])[:2000]}")
        return answer["prompt_id"]

    def cancel(self, prompt_id: str, timeout: float = 600) -> None:
        """Stop a queued or running prompt (the UI's Cancel) and wait until the queue is empty.  The
        interrupt is sent until it stops: ComfyUI clears the flag when a prompt starts executing,
        so one sent while the prompt was still moving from the queue to the executor is lost."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            q = self.get("/queue")
            if not q["queue_running"] and not q["queue_pending"]:
                return
            self.post("/queue", {"delete": [prompt_id]})
            self.post("/interrupt", {})
            time.sleep(1)
        raise AssertionError("the cancelled prompt did not stop")

    def run(self, workflow: dict, timeout: float = 1800) -> dict:
        prompt_id = self.queue(workflow)
        deadline = time.time() + timeout
        while time.time() < deadline:
            hist = self.get(f"/history/{prompt_id}")
            if prompt_id in hist and hist[prompt_id].get("status", {}).get("completed") is not None:
                entry = hist[prompt_id]
                if entry["status"].get("status_str") != "success":
                    errors = [m[1] for m in entry["status"].get("messages", []) if m[0] == "execution_error"]
                    said = "; ".join(f"{e.get('node_type')}: {e.get('exception_type')}: "
                                     f"{str(e.get('exception_message'))[:1000]}" for e in errors)
                    raise AssertionError(f"workflow failed: {said or json.dumps(entry['status'])[-2000:]}")
                return entry
            time.sleep(2)
        raise AssertionError("workflow timed out")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
