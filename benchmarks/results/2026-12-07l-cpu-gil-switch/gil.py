# The sampler's thread beside a busy Python thread (Dynamo/Inductor compiling in the background):
# 20 steps of 200 small torch calls, alone and beside it at four GIL switch intervals.
# 2-core CPU, Python 3.11, torch 2.13.0+cpu, 2026-12-07: .venv/bin/python gil.py > gil.txt
import sys, threading, time, torch
x = torch.randn(64, 64)
def step():
    y = x
    for _ in range(200):   # ~200 small torch op calls, each releasing and retaking the GIL
        y = y * 1.0001 + 0.0
    return y
def busy(stop):
    n = 0
    while not stop.is_set():   # pure-Python work, like Dynamo tracing / Inductor codegen
        for i in range(1000): n += i * i
def measure(label, interval):
    sys.setswitchinterval(interval)
    stop = threading.Event()
    t = threading.Thread(target=busy, args=(stop,)); t.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    for _ in range(20): step()
    dt = time.perf_counter() - t0
    stop.set(); t.join()
    print(f"{label:30s} switchinterval {interval*1e3:6.2f} ms: 20 steps {dt*1e3:8.1f} ms", flush=True)
torch.set_num_threads(1)
t0 = time.perf_counter()
for _ in range(20): step()
print(f"{'alone':30s} 20 steps {(time.perf_counter()-t0)*1e3:8.1f} ms")
for iv in (0.005, 0.001, 0.0002, 0.00005):
    measure("with a busy thread", iv)
