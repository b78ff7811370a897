import sys
sys.path.insert(0, "benchmarks")
import quality_real as qr
from comfy_modelopt import w4a8
w4a8.INT8_MIN_ROWS = 1  # every call on the int8 way, per-sample ones too
qr.run(qr.os.path.join(qr.os.path.expanduser("~"), ".cache", "comfy-modelopt"), only={"nvfp4"}, which="terrain",
       variants=["W4A8 int8 (Turing/Ampere, the pack's runtime): default"], floors=False)
