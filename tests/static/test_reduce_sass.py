"""The one-pass reductions (logsumexp over rows and columns, bf16 column
sums), Pallas and Triton, compiled for an H100 with no GPU and read
from their machine code (SASS: ptxas and nvdisasm from the nvidia wheels):
every operand load is 128 bits wide, each element is loaded once (the main
loop loads exactly the bytes a step advances), the loop folds its tiles
without crossing threads, nothing spills, and the grid fills 132 SMs."""
import math

import jax.numpy as jnp
import pytest

from tests._extras import missing_extra, require_gpu_compile

require_gpu_compile()

from tests._deviceless import gpu, sass

BACKENDS = ["pallas", "triton"]
SHAPES = [(16384, 8192), (4096, 4096)]
CASES = [("logsumexp", 1, "float32"), ("logsumexp", 1, "bfloat16"),
         ("logsumexp", 0, "float32"), ("logsumexp", 0, "bfloat16"), ("sum", 0, "bfloat16")]
SM_COUNT = gpu.ARCHS["h100"].sm_count

try:
    sass.nvdisasm_path()
except FileNotFoundError as missing:   # a venv made before the compile extra had it
    pytest.skip(str(missing), allow_module_level=True)


def _compile(backend, op, axis, dtype, shape):
    report = gpu.compile_reduction(backend, op, axis, dtype, shape, "h100")
    kernels = [k for k in report.kernels if k.name.startswith("nxops")]
    assert kernels, [k.name for k in report.kernels]
    return kernels


@pytest.fixture(scope="module", params=BACKENDS)
def compiled(request):
    backend = request.param
    if backend == "triton" and (reason := missing_extra("triton", "triton", "jax_triton")):
        pytest.skip(reason)
    return backend, {(case, shape): _compile(backend, *case, shape) for case in CASES
                     for shape in SHAPES}


@pytest.mark.parametrize("shape", SHAPES, ids=["16384x8192", "4096^2"])
@pytest.mark.parametrize("case", CASES, ids=[f"{op}-{'rows' if a else 'cols'}-{d}"
                                             for op, a, d in CASES])
def test_one_pass_of_128_bit_loads_filling_every_sm(compiled, case, shape):
    backend, reports = compiled
    op, axis, dtype = case
    first, *second = reports[case, shape]
    plan = sass.first_pass_plan(backend, axis, dtype, shape)
    assert first.grid[:len(plan.grid)] == plan.grid, (first.grid, plan)
    # The grid fills the GPU: at least a CTA per SM, and the SMs can hold it.
    assert first.blocks >= SM_COUNT and first.ctas_per_sm >= 4, first
    for k in (first, *second):
        assert (k.spill_stores, k.spill_loads) == (0, 0), k
        assert set(sass.kernel_loads(k).widths) == {128}, (k.name, sass.kernel_loads(k).widths)
    loads = sass.kernel_loads(first)
    threads = math.prod(first.threads)
    assert sass.loads_per_element(loads, plan, threads, jnp.dtype(dtype).itemsize) == 1.0, \
        (loads, plan, threads)
    # The pieces tile the reduced dim: every element is in exactly one.
    n_reduced = shape[axis]
    assert (plan.n_pieces - 1) * plan.piece_len < n_reduced <= plan.n_pieces * plan.piece_len
    # The step's tiles are folded in registers: no shuffle, barrier or shared memory.
    assert loads.loop_exchanges == (), loads
    if op == "logsumexp" and loads.loop_widths:
        # One exp an element plus one a lane per step (the rescale).
        lanes = math.prod(plan.block) // threads
        assert loads.exp_per_loop == lanes * (plan.unroll + 1), loads
    if second:   # the partials' pass: small next to the first
        (k,) = second
        assert k.blocks * math.prod(k.threads) <= first.blocks * threads, (first, k)
