#!/usr/bin/env python3
"""The user's path in a real ComfyUI server, driven over HTTP as a client drives it.

Takes the files `user_path.py --keep-files DIR` leaves (the 16-bit model and the file Save Quantized
Model wrote after Calibrate -> Quantize Model), starts ComfyUI's own `main.py` the default way
(cudaMallocAsync on CUDA 13 builds; this project and one benchmark node linked into its
custom_nodes), and queues over `POST /prompt`:
  1. the 16-bit model (stock Load Diffusion Model) x N prompts of different seeds
  2. the quantized file (Load Quantized Model, its default runtime) x N prompts, the same seeds
  3. a switch back to the 16-bit model and again to the quantized one (2 prompts each): ComfyUI keeps
     or unloads models as it decides, the graphs are freed and captured again where it unloads
Each prompt: a random conditioning (the benchmark's node; no text encoder), an empty latent, KSampler
(euler/simple) and Save Latent.  Per prompt: the server's own execution_start -> execution_success
time from /history.  Reports steady time per prompt (best of prompts 2..N), spread, the ratio to the
16-bit model, the switch runs, the device's free VRAM after each phase, final-latent difference vs the
16-bit latent of the same seed, and every WARNING/ERROR line the server logged (a runtime that turns
itself off must not be silent).  Prints a table; writes server_path_<model>_<format>.json to --out.
Usage (COMFYUI_PATH set):
  python benchmarks/user_path.py --model flux --runs 2 --skip-stock-file --keep-files /tmp/files --out DIR
  python benchmarks/server_path.py --model flux --files /tmp/files --prompts 8 --out DIR
  (--cpu-tiny for both: a CPU smoke run of a tiny model, the server started with --cpu)
"""
import argparse, glob, json, os, shutil, signal, socket, subprocess, sys, time, urllib.error, urllib.request

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="flux")
ap.add_argument("--files", required=True, help="the folder user_path.py --keep-files wrote")
ap.add_argument("--format", default="float8_e4m3fn")
ap.add_argument("--prompts", type=int, default=8)
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--out", default=os.environ.get("OUT", "verify_out"))
ap.add_argument("--cpu-tiny", action="store_true")
ap.add_argument("--log-recompiles", action="store_true", help="the server logs each Dynamo recompilation and its reason")
ap.add_argument("--py-spy", default=None, metavar="BIN",
                help="run the server under this py-spy binary (py-spy record, every thread, collapsed stacks to "
                     "server_pyspy.txt in --out): where a first prompt's seconds go")
ap.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                help="one more argument for main.py (repeatable), e.g. --server-arg=--reserve-vram "
                     "--server-arg=110: a GPU as small as what is left, where switching models evicts part of one")
ap.add_argument("--runtime", default=None, help="Load Quantized Model's runtime (default: the node's default, as the UI "
                "fills it in)")
ap.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for one phase")
A = ap.parse_args()

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLUX = A.model == "flux"
RES = {"args": vars(A), "phases": [], "server_warnings": []}

# The benchmark's conditioning: the same random tensors user_path.py's conds() makes (seed 7)
NODE = '''
import torch

class BenchRandomConditioning:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"kind": (["flux", "sdxl"],), "tiny": ("BOOLEAN", {"default": False})}}
    RETURN_TYPES = ("CONDITIONING", "CONDITIONING")
    FUNCTION = "make"
    CATEGORY = "benchmark"

    def make(self, kind, tiny):
        g = torch.Generator().manual_seed(7)
        if kind == "flux":
            ctx = torch.randn(1, 16 if tiny else 512, 256 if tiny else 4096, generator=g)
            pooled = torch.randn(1, 768, generator=g)
            extra = {"pooled_output": pooled, "guidance": 3.5}
        else:
            ctx = torch.randn(1, 77, 2048, generator=g)
            pooled = torch.randn(1, 1280, generator=g)
            extra = {"pooled_output": pooled, "width": 1024, "height": 1024}
        return [[ctx, dict(extra)]], [[torch.zeros_like(ctx), dict(extra)]]

NODE_CLASS_MAPPINGS = {"BenchRandomConditioning": BenchRandomConditioning}
'''


def log(*a):
    print("[server]", *a, flush=True)


def http(path, body=None):
    req = urllib.request.Request(URL + path, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:  # the server says why (a prompt's validation errors)
        raise SystemExit(f"{path}: HTTP {e.code}: {e.read().decode(errors='replace')[:3000]}") from None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workflow(loader, seed, prefix):
    res = 64 if A.cpu_tiny else 1024
    latent = ("EmptySD3LatentImage" if FLUX else "EmptyLatentImage", {"width": res, "height": res, "batch_size": 1})
    nodes = {"1": loader,
             "2": ("BenchRandomConditioning", {"kind": A.model, "tiny": A.cpu_tiny}),
             "3": latent,
             "4": ("KSampler", {"model": ["1", 0], "seed": seed, "steps": A.steps, "cfg": 1.0 if FLUX else 7.0,
                                "sampler_name": "euler", "scheduler": "simple", "positive": ["2", 0],
                                "negative": ["2", 1], "latent_image": ["3", 0], "denoise": 1.0}),
             "5": ("SaveLatent", {"samples": ["4", 0], "filename_prefix": prefix})}
    return {k: {"class_type": c, "inputs": i} for k, (c, i) in nodes.items()}


def run_phase(label, loader, seeds, prefix):
    """Queues one prompt per seed at once (a queue, as a user's client does) and waits for all."""
    ids = [http("/prompt", {"prompt": workflow(loader, s, f"bench/{prefix}_{s}"), "client_id": "bench"})["prompt_id"]
           for s in seeds]
    t0 = time.time(); hist = {}
    while len(hist) < len(ids):
        if time.time() - t0 > A.timeout:
            raise SystemExit(f"{label}: {len(ids) - len(hist)} prompts not done after {A.timeout} s")
        if SERVER.poll() is not None:
            raise SystemExit(f"{label}: the server exited with {SERVER.returncode} (log: {LOG})")
        for i in ids:
            if i not in hist:
                h = http(f"/history/{i}").get(i)
                if h and h.get("status", {}).get("completed") is not None:
                    hist[i] = h
        time.sleep(0.2)
    times = []
    for i in ids:
        st = hist[i]["status"]
        if st.get("status_str") != "success":
            raise SystemExit(f"{label}: prompt {i} failed: {json.dumps(st)[:2000]}")
        ev = {m[0]: m[1].get("timestamp") for m in st["messages"]}
        times.append((ev["execution_success"] - ev["execution_start"]) / 1000.0)
    vram = http("/system_stats")["devices"][0]
    row = {"phase": label, "prompt_s": [round(t, 3) for t in times],
           "steady_s": round(min(times[1:] or times), 3),
           "spread": round(max(times[1:] or times) / min(times[1:] or times) - 1, 4),
           "vram_free_gib": round(vram.get("vram_free", 0) / 2**30, 2),
           "torch_vram_free_gib": round(vram.get("torch_vram_free", 0) / 2**30, 2)}
    log(json.dumps(row))
    RES["phases"].append(row)
    return row


def latents(prefix):
    from safetensors.torch import load_file
    out = {}
    for f in glob.glob(os.path.join(BASE, "output", "bench", f"{prefix}_*.latent")):
        seed = int(os.path.basename(f)[len(prefix) + 1:].split("_")[0])
        out.setdefault(seed, load_file(f)["latent_tensor"].float())
    return out


def main():
    global URL, SERVER, LOG, BASE
    STARTUP_LINES = 0
    os.makedirs(A.out, exist_ok=True)
    BASE = os.path.abspath(os.path.join(A.out, "comfy-base"))
    shutil.rmtree(BASE, ignore_errors=True)
    models = os.path.join(BASE, "models", "diffusion_models")
    nodes = os.path.join(BASE, "custom_nodes")
    os.makedirs(models); os.makedirs(nodes); os.makedirs(os.path.join(BASE, "user"))
    sixteen = f"bench-{A.model}-16bit.safetensors"
    quant = f"bench-{A.model}-{A.format}.safetensors"
    for f in (sixteen, quant):
        path = os.path.abspath(os.path.join(A.files, f))
        if not os.path.isfile(path):
            raise SystemExit(f"{path}: not found - make it with user_path.py --model {A.model} --keep-files {A.files}")
        os.symlink(path, os.path.join(models, f))
    os.symlink(PROJECT, os.path.join(nodes, "comfy-modelopt"))
    with open(os.path.join(nodes, "bench_conditioning.py"), "w") as f:
        f.write(NODE)
    web = os.path.join(BASE, "web"); os.makedirs(web)
    with open(os.path.join(web, "index.html"), "w") as f:
        f.write("<!doctype html><title>benchmark</title>")
    port = free_port()
    URL = f"http://127.0.0.1:{port}"
    LOG = os.path.join(A.out, "server.log")
    cmd = [sys.executable, os.path.join(os.environ["COMFYUI_PATH"], "main.py"), "--listen", "127.0.0.1",
           "--port", str(port), "--base-directory", BASE, "--disable-auto-launch",
           "--database-url", "sqlite:///" + os.path.join(BASE, "user", "comfyui.db"),
           "--front-end-root", web] + ["--cpu"] * A.cpu_tiny + A.server_arg  # an empty web root: no browser here
    if A.py_spy:  # sampled, all threads: ComfyUI runs prompts on a worker thread (cProfile sees one thread)
        cmd = [os.path.abspath(A.py_spy), "record", "--format", "raw", "--threads", "--rate", "200", "--nonblocking",
               "-o", os.path.join(A.out, "server_pyspy.txt"), "--"] + cmd
    log(" ".join(cmd))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # ComfyUI's own choice (cudaMallocAsync on CUDA 13 builds)
    if A.log_recompiles:
        env["TORCH_LOGS"] = "recompiles"
    with open(LOG, "w") as logf:
        SERVER = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=BASE,
                                  start_new_session=bool(A.py_spy))
    try:
        t0 = time.time()
        while True:
            try:
                RES["system_stats"] = http("/system_stats"); break
            except OSError:
                if SERVER.poll() is not None or time.time() - t0 > 300:
                    raise SystemExit(f"the server did not start (log: {LOG}):\n" + open(LOG).read()[-3000:])
                time.sleep(1)
        log(f"server up in {time.time() - t0:.1f} s")
        with open(LOG) as f:
            STARTUP_LINES = len(f.readlines())
        stock = ("UNETLoader", {"unet_name": sixteen, "weight_dtype": "default"})
        spec = http("/object_info/ModelOptUNetLoader")["ModelOptUNetLoader"]["input"]["required"]["runtime"]
        RES["loader_runtime"] = A.runtime or spec[1]["default"]  # by default what a user gets: as the UI fills it in
        offered = spec[1].get("options") or spec[0]  # the V3 schema's COMBO lists them under options
        if RES["loader_runtime"] not in offered:
            raise SystemExit(f"--runtime {A.runtime!r}: the node offers {offered}")
        ours = ("ModelOptUNetLoader", {"unet_name": quant, "runtime": RES["loader_runtime"]})
        seeds = list(range(A.prompts))
        r16 = run_phase("16-bit, Load Diffusion Model", stock, seeds, "b16")
        rq = run_phase(f"{A.format}, Load Quantized Model ({'default runtime' if A.runtime is None else A.runtime})", ours, seeds, "q")
        rq["vs_16bit"] = round(r16["steady_s"] / rq["steady_s"], 3)
        s16 = run_phase("switch: 16-bit again", stock, [100, 101], "b16s")
        sq = run_phase("switch: quantized again", ours, [100, 101], "qs")
        sq["vs_16bit"] = round(s16["steady_s"] / sq["steady_s"], 3)
        sq["vs_first_quantized_phase"] = round(rq["steady_s"] / sq["steady_s"], 3)
        for phase, (b, q) in ((rq, ("b16", "q")), (sq, ("b16s", "qs"))):  # the switch too: replays after it
            ref, got = latents(b), latents(q)
            diffs = [float((got[s] - ref[s]).norm() / ref[s].norm().clamp_min(1e-12)) for s in ref if s in got]
            phase["rel_vs_16bit"] = round(sum(diffs) / max(len(diffs), 1), 5)
    finally:
        if A.py_spy:  # py-spy writes its stacks on SIGINT; the server under it goes with its session
            SERVER.send_signal(signal.SIGINT)
        else:
            SERVER.terminate()
        try:
            SERVER.wait(60)
        except subprocess.TimeoutExpired:
            SERVER.kill()
        if A.py_spy:
            try:
                os.killpg(SERVER.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    with open(LOG) as f:  # from the first prompt on (at start ComfyUI lists the optional packages a machine lacks)
        lines = f.readlines()[STARTUP_LINES:]
        RES["pack_log"] = [line.rstrip() for line in lines if "[comfy-modelopt]" in line or "Recompiling" in line]
        RES["server_warnings"] = [line.rstrip() for line in lines
                                  if any(w in line for w in ("WARNING", "ERROR", "Traceback", "turned off", "falls back",
                                                             "out of memory"))]
    with open(os.path.join(A.out, f"server_path_{A.model}_{A.format}.json"), "w") as f:
        json.dump(RES, f, indent=1)
    print("\n| phase | prompts (s) | steady | spread | vs 16-bit | free VRAM GiB |\n|---|---|---|---|---|---|")
    for r in RES["phases"]:
        print(f"| {r['phase']} | {', '.join(f'{t:.2f}' for t in r['prompt_s'])} | {r['steady_s']:.3f} | "
              f"{100 * r['spread']:.1f}% | {r.get('vs_16bit', '')} | {r['vram_free_gib']} |")
    print(f"final latent vs 16-bit (same seeds): {rq['rel_vs_16bit']}; after the switch: {sq['rel_vs_16bit']}")
    print("server WARNING/ERROR lines:", len(RES["server_warnings"]))
    for line in RES["server_warnings"][:40]:
        print("  ", line)


if __name__ == "__main__":
    main()
