"""ouro-bench with the decode table's one-row entries replaced by a loop_bench tune's choices (argv[1])."""
import json
import sys

from benchmarks.kernels.loop_bench import SHAPE_NAMES
from ouro_backend.kernels import projections
from ouro_backend.kernels.projections import LinearConfig

table = json.load(open(sys.argv[1]))["table"]  # loop_bench tune's choices: {shape name: {M: config or null}}
table_for = projections.config_for


def pick(N, K, M):  # what loop_bench's tune does to the table, from its output
    e = table.get(SHAPE_NAMES.get((N, K), ""), {}).get(str(M), "absent")
    if e == "absent":
        return table_for(N, K, M)
    return None if e is None else LinearConfig(**e)


projections.config_for = pick
print("table override:", table, flush=True)
from ouro_backend.entrypoints.bench import main  # noqa: E402

sys.exit(main(sys.argv[2:]))
