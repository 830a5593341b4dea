"""The one-row projections as the engine's table runs them, for ncu: 3 iterations of qkv, o, gate_up, down
(SiLU fused); profile the last iteration's 4 launches."""
import torch

from ouro_backend.kernels import linear

dev, dt = "cuda", torch.bfloat16
shapes = {"qkv": (6144, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)}
ws = {k: torch.randn(*s, device=dev, dtype=dt) / 50 for k, s in shapes.items()}
x = torch.randn(1, 2048, device=dev, dtype=dt)
gu = torch.randn(1, 11264, device=dev, dtype=dt)
wn = torch.rand(2048, device=dev, dtype=dt) + 0.5
for _ in range(3):
    linear(x, ws["qkv"])
    linear(x, ws["o"])
    linear(x, ws["gate_up"])
    linear(gu, ws["down"], silu_x=True)
torch.cuda.synchronize()
print("done")
