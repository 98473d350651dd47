"""Reading the kernel custom calls out of a program lowered for cuda or tpu.

``jax.jit(f).trace(*args).lower(lowering_platforms=(p,)).as_text()`` on CPU
holds, per Pallas kernel, a ``__gpu$xla.gpu.triton`` custom call (cuda, with
the launch grid, warps and stages in its backend config) or a
``tpu_custom_call`` (tpu, whose config carries the Mosaic module as MLIR
bytecode: parsing it verifies the module, and its attributes give the grid
(``iteration_bounds``) and the block shapes (``window_bounds``)).
"""
import base64
import json
import re

import jax
from jax._src.lib import tpu as tpu_dialect
from jax._src.lib.mlir import ir

from nxops.kernels._gpu_target import kernel_mesh

TRITON_CALL = "__gpu$xla.gpu.triton"
MOSAIC_CALL = "tpu_custom_call"
CALL_TARGET = {"cuda": TRITON_CALL, "tpu": MOSAIC_CALL}


def lower_text(fn, *args, platform):
    """``fn`` lowered for ``platform`` on this CPU machine. Kernels called
    directly (not through an nxops op) are traced in the mesh the ops give them:
    for cuda it names the target GPU, which JAX >= 0.11 needs without a GPU."""
    with jax.sharding.use_abstract_mesh(kernel_mesh(platform)):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def triton_calls(text):
    """``[{name, grid, num_warps, num_stages}]`` of every Triton kernel call."""
    calls = []
    for line in text.splitlines():
        if TRITON_CALL not in line:
            continue
        grab = lambda key: int(re.search(rf"{key} = (\d+) : i32", line).group(1))
        calls.append(dict(name=re.search(r'name = "([^"]*)"', line).group(1),
                          grid=(grab("grid_x"), grab("grid_y"), grab("grid_z")),
                          num_warps=grab("num_warps"), num_stages=grab("num_stages")))
    return calls


def mosaic_calls(text):
    """``[{name, grid, blocks, module}]`` of every Mosaic kernel call; the
    module is parsed (and so verified) from its serialized bytecode."""
    calls = []
    for line in text.splitlines():
        if MOSAIC_CALL not in line:
            continue
        escaped = re.search(r'backend_config = "(.*?)"[,}]', line).group(1)
        config = json.loads(re.sub(r"\\([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), escaped))
        body = base64.b64decode(config["custom_call_config"]["body"])
        with ir.Context() as context:
            tpu_dialect.register_dialect(context)
            context.allow_unregistered_dialects = True
            module = str(ir.Module.parse(body))
        ints = lambda s: tuple(int(v) for v in s.split(","))
        calls.append(dict(
            name=re.search(r'sym_name = "([^"]*)"', module).group(1),
            grid=ints(re.search(r"iteration_bounds = array<i64: ([^>]*)>", module).group(1)),
            blocks=[ints(b) for b in re.findall(r"window_bounds = array<i64: ([^>]*)>", module)],
            module=module))
    return calls


def kernel_calls(text, platform):
    return triton_calls(text) if platform == "cuda" else mosaic_calls(text)
