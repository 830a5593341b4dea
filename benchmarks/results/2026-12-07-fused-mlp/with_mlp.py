"""Run a module with the fused MLP's one-row table entry replaced: with_mlp.py CONFIG [--down-t] -m module args...
CONFIG is an MlpConfig name (mlp_c16_k128_h128_w4) or 'off' (OURO_FUSED_MLP=0). --down-t: every layer's down
weight stored transposed after the model loads (its [H, I] view of an [I, H] copy)."""

import os
import runpy
import sys

name = sys.argv.pop(1)
if sys.argv[1] == "--down-t":
    sys.argv.pop(1)
    from ouro_backend.model import ouro

    init = ouro.OuroModel.__init__

    def init_t(self, *a, **kw):
        init(self, *a, **kw)
        for ly in self.layers:
            ly.down = ly.down.t().contiguous().t()
        print("down stored transposed", flush=True)

    ouro.OuroModel.__init__ = init_t
if name == "off":
    os.environ["OURO_FUSED_MLP"] = "0"
else:
    from ouro_backend.kernels import decode_mlp

    c, k, h, w = (int(p[1:]) for p in name.split("_")[1:])
    cfg = decode_mlp.MlpConfig(c, k, h, w)
    assert cfg.name == name, (cfg.name, name)
    decode_mlp.FUSED_MLP_TABLE[(11264, 2048)] = ((1, cfg),)
    print("fused MLP at one row:", cfg.name, flush=True)
assert sys.argv[1] == "-m", sys.argv
mod = sys.argv.pop(2)
sys.argv.pop(1)
runpy.run_module(mod, run_name="__main__", alter_sys=True)
