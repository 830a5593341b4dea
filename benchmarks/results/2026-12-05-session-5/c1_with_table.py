"""ouro-bench with the decode table's entries at the row counts a loop_bench tune covered (argv[1]) replaced by
the tune's choices; every other row count keeps the table."""
import json
import sys

from ouro_backend.kernels import projections
from ouro_backend.kernels.projections import LinearConfig

table = json.load(open(sys.argv[1]))["table"]
NAMES = {(6144, 2048): "qkv", (2048, 2048): "o", (11264, 2048): "gate_up", (2048, 5632): "down"}
table_for = projections.config_for


def pick(N, K, M):
    e = table.get(NAMES.get((N, K), ""), {}).get(str(M), "absent")
    if e == "absent":
        return table_for(N, K, M)
    return None if e is None else LinearConfig(**e)


projections.config_for = pick
print("table override:", {k: v for k, v in table.items()}, flush=True)
from ouro_backend.entrypoints.bench import main  # noqa: E402

sys.exit(main(sys.argv[2:]))
