"""Is an SDXL cldm ControlNet's eager forward host-bound at 1024x1024, batch 2? eager (GPU idle at its start),
eager back to back, CUDA graph replay; and the stock SDXL UNet's forward for scale."""
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
import architectures  # noqa: E402

architectures.setup_comfy()
import comfy.cldm.cldm  # noqa: E402
import comfy.ops  # noqa: E402

from attachments import random_weights  # noqa: E402

mc = architectures.model_config("sdxl", "full")
config = dict(mc.unet_config)
config.pop("out_channels", None)
with torch.device("meta"):
    net = comfy.cldm.cldm.ControlNet(hint_channels=3, operations=comfy.ops.disable_weight_init, **config)
sd = random_weights(net, 11, scale=0.5)
dev, dt = torch.device("cuda"), torch.float16
net = comfy.cldm.cldm.ControlNet(hint_channels=3, operations=comfy.ops.disable_weight_init, device=dev.type,
                                 **{**config, "dtype": dt})
net.load_state_dict({k: v.to(dt) for k, v in sd.items()}, strict=False)
net = net.to(dev, dt).eval()
B = 2
kw = dict(x=torch.randn(B, 4, 128, 128, device=dev, dtype=dt), hint=torch.randn(B, 3, 1024, 1024, device=dev, dtype=dt),
          timesteps=torch.full((B,), 500.0, device=dev, dtype=dt),
          context=torch.randn(B, 77, 2048, device=dev, dtype=dt), y=torch.randn(B, 2816, device=dev, dtype=dt))


def run():
    with torch.no_grad():
        return net(**kw)


for _ in range(3):
    run()
torch.cuda.synchronize()
# each call from an idle GPU (as after a host sync)
ts = []
for _ in range(10):
    torch.cuda.synchronize()
    t = time.perf_counter()
    run()
    th = time.perf_counter() - t
    torch.cuda.synchronize()
    ts.append((th, time.perf_counter() - t))
print("eager from idle: host %.2f ms, wall %.2f ms" % (1e3 * min(a for a, _ in ts), 1e3 * min(b for _, b in ts)))
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(20):
    run()
torch.cuda.synchronize()
print("eager back to back: %.2f ms per call" % (1e3 * (time.perf_counter() - t) / 20))
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    run()
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    out = run()
torch.cuda.synchronize()
ref = run()
g.replay()
torch.cuda.synchronize()
err = max(float((a - b).float().norm() / b.float().norm().clamp_min(1e-9)) for a, b in zip(out["output"], ref["output"]))
t = time.perf_counter()
for _ in range(20):
    g.replay()
torch.cuda.synchronize()
print("graph replay: %.2f ms per call (rel err %.2e)" % (1e3 * (time.perf_counter() - t) / 20, err))
print("kernels per eager call:", end=" ")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
    run()
    torch.cuda.synchronize()
print(sum(1 for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA))
