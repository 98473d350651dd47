import sys, time
import numpy as np
from tests.oracle import _composed as C, _runner as run
n, d, count, seed = 8, 4, int(sys.argv[1]), int(sys.argv[2])
rng = np.random.default_rng(seed)
programs = [p for p in C.draw_programs(rng, 6 * count, n, ["f32", "c64", "bf16", "f16"]) if "megatron_fg" in p.wrappers]
# force some
programs += C.draw_programs(rng, count, n, ["f32", "c64"], wrappers=["megatron_fg", "scan", "cond", "checkpoint", "nested_xmap", "plain", "switch_per_position"])
programs = [p for p in programs if "megatron_fg" in p.wrappers][:count]
print(len(programs), [str(p) for p in programs])
group = run.Group(programs, n, d, seed)
for pl in run.PLACEMENTS[n]:
    t = time.time()
    f = run.check_placement(group, pl)
    print(pl.id, len(f), round(time.time() - t, 1), f[:3])
print(dict(run.COUNTS))
