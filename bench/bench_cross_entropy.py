"""Memory and speed of the fused ``nx.cross_entropy`` against the unfused
loss (``nx.einsum`` + ``nx.logsumexp`` + take by label).

The figure is ``jax.jit(jax.value_and_grad(loss)).lower(...).compile()
.memory_analysis().temp_size_in_bytes``: compiled only, from
``ShapeDtypeStruct``s, never run, so the large size (tokens 8192, hidden
2048, vocab 128256, bf16) needs no memory. Programs:

- ``cpu``: one CPU device, positional axes;
- ``h100``: the same, compiled deviceless for an H100 (XLA's GPU compiler;
  needs the ``compile`` extra: skipped without it);
- ``vocab-parallel``: an ``nx.xmap`` with the vocab on 4 devices (CPU, and
  deviceless H100s), the tokens replicated (``vocab``) or on a second mesh
  axis (``dp x mp``: tokens over 2, vocab over 2); per device temp, and the
  HLO must hold no all-gather of anything the size of a tokens x
  vocab-shard block.

``python -m bench.bench_cross_entropy`` prints the table at the large size
(bench/README.md quotes it); under pytest each program is compiled at a small
size and at the large one, and both the bytes and the HLO check are asserted.
The small size also runs, and its result is checked against the unfused one.

Speed (``python -m bench.bench_cross_entropy``, or ``--speed`` / ``--memory``
for one part): wall time of ``jit(value_and_grad(loss))`` and of ``jit(loss)``
at ``SPEED_SIZE`` on this process's CPU device, f32 and bf16. Each round runs
the fused and the unfused program once each, alternating which goes first;
the figure is the median over rounds of the per-round ratio (a shared,
noisy machine moves both programs of a round alike).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import statistics
import sys
import time

# The vocab-parallel figures need 4 CPU devices (pytest: bench/conftest.py);
# the speed run keeps the one device.
if __name__ == "__main__" and ("--speed" not in sys.argv[1:] or "--memory" in sys.argv[1:]):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import nxops as nx
from tests._tolerances import assert_close
from nxops.measure._cases import unfused_loss


@dataclasses.dataclass(frozen=True)
class Size:
    tokens: int
    hidden: int
    vocab: int
    dtype: str = "bfloat16"


SIZES = {"small": Size(64, 32, 1000), "large": Size(8192, 2048, 128256)}
SPEED_SIZE = Size(2048, 512, 32768)
SPEED_ROUNDS = 7
VOCAB_DEVICES = 4
GOAL = 0.02   # the fused temp at most 2% of the unfused one (at the large size)


# --- the two losses, positional and vocab-parallel ---------------------------


# The memory figures are the recompute backward's (what ``auto`` takes at the
# large size); the stored one (``auto`` at the small and the speed sizes)
# holds an f32 dw and blocks of logits by design (docs/cross_entropy.md).
MEMORY_BACKWARD = "recompute"


def fused_loss(h, w, labels, backward="auto"):
    return jnp.mean(nx.cross_entropy(h, w, labels, hidden=1, vocab=1, backward=backward))


memory_fused_loss = functools.partial(fused_loss, backward=MEMORY_BACKWARD)


def fused_body(h, w, labels, backward=MEMORY_BACKWARD):
    return nx.cross_entropy(h, w, labels, hidden=1, vocab="vocab", backward=backward)


def unfused_body(h, w, labels):
    logits = nx.einsum("th,h->t", h, w)    # this vocab position's logit per token
    mine = labels == nx.axis_index("vocab")
    picked = nx.sum(jnp.where(mine, logits, 0).astype(jnp.float32), "vocab")
    return nx.logsumexp(logits, "vocab").astype(jnp.float32) - picked


def vocab_parallel(body):
    """jnp.mean of the per-token losses of an xmap with the vocab on mesh axis 'v'."""
    xmapped = nx.xmap(body, in_axes=[[...], [None, "vocab"], [...]], out_axes=[...],
                      axis_resources={"vocab": "v"})
    return lambda h, w, labels: jnp.mean(xmapped(h, w, labels))


def per_token(body):
    """``body`` for one named token: h [hidden], labels a scalar."""
    return lambda h, w, label: body(h[None], w, label[None])[0]


def data_and_vocab_parallel(body):
    """jnp.mean of the per-token losses, the tokens on mesh axis 'd' and the vocab on 'v'."""
    xmapped = nx.xmap(per_token(body), in_axes=[["tok", None], [None, "vocab"], ["tok"]],
                      out_axes=["tok"], axis_resources={"tok": "d", "vocab": "v"})
    return lambda h, w, labels: jnp.mean(xmapped(h, w, labels))


# name: (mesh shape, its axes, the program, h's and the labels' sharding)
LAYOUTS = {"vocab": ((VOCAB_DEVICES,), ("v",), vocab_parallel, P()),
           "dp x mp": ((2, VOCAB_DEVICES // 2), ("d", "v"), data_and_vocab_parallel, P("d"))}


# --- compiling and reading ---------------------------------------------------


def operand_structs(size: Size, mesh=None, tokens_spec=None):
    tokens_spec = P() if tokens_spec is None else tokens_spec
    sharding = (lambda spec: NamedSharding(mesh, spec)) if mesh is not None else (lambda spec: None)
    return (jax.ShapeDtypeStruct((size.tokens, size.hidden), size.dtype,
                                 sharding=sharding(tokens_spec)),
            jax.ShapeDtypeStruct((size.hidden, size.vocab), size.dtype,
                                 sharding=sharding(P(None, "v"))),
            jax.ShapeDtypeStruct((size.tokens,), jnp.int32, sharding=sharding(tokens_spec)))


def compile_step(loss, structs):
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(*structs).lower().compile()


def temp_bytes(compiled) -> int:
    return int(compiled.memory_analysis().temp_size_in_bytes)


def large_all_gathers(compiled, size: Size, devices: int) -> list:
    """All-gathers whose result holds at least a tokens x vocab-shard block."""
    block = size.tokens * (size.vocab // devices)
    return [c for c in nx.hlo.collectives(compiled.as_text())
            if c.kind == "all-gather" and any(math.prod(s) >= block for s in c.result_shapes)]


def largest_all_reduce(compiled) -> int:
    """Bytes of the program's largest all-reduce result (as compiled: XLA:CPU
    sums 16-bit floats in f32, so there it is the f32 size)."""
    return max((c.buffer_bytes for c in nx.hlo.collectives(compiled.as_text())
                if c.kind == "all-reduce"), default=0)


def cpu_figures(size: Size) -> dict[str, int]:
    structs = operand_structs(size)
    return {impl: temp_bytes(compile_step(loss, structs))
            for impl, loss in (("fused", memory_fused_loss), ("unfused", unfused_loss))}


def _cuda_compile_available() -> bool:
    try:
        from tests._deviceless import gpu   # only when asked: it loads XLA's GPU compiler
    except ImportError:
        return False
    return gpu.compile_available("h100")


def h100_figures(size: Size) -> dict[str, int]:
    from tests._deviceless import gpu
    mesh = gpu.gpu_mesh("h100", (1,), ("v",))
    structs = operand_structs(size, mesh)
    with jax.set_mesh(mesh):
        return {impl: temp_bytes(compile_step(loss, structs))
                for impl, loss in (("fused", memory_fused_loss), ("unfused", unfused_loss))}


def stored_figures(size: Size) -> dict[str, int]:
    """Deviceless H100, ``backward="in_forward"`` (the gradients made in the
    forward pass: an f32 dw and blocks of logits held by design): the XLA
    loop's softmax (``fused``) and the Pallas kernel's (``unfused`` is the
    unfused program's, for scale)."""
    from tests._deviceless import gpu
    mesh = gpu.gpu_mesh("h100", (1,), ("v",))
    structs = operand_structs(size, mesh)
    stored = functools.partial(fused_loss, backward="in_forward")
    figures = {}
    with jax.set_mesh(mesh):
        for impl, kernel in (("fused", "xla"), ("pallas", "pallas")):
            with nx.kernels.use(f"cross_entropy={kernel}"):
                figures[impl] = temp_bytes(compile_step(stored, structs))
        figures["unfused"] = temp_bytes(compile_step(unfused_loss, structs))
    return figures


def vocab_mesh(layout: str = "vocab"):
    shape, axes = LAYOUTS[layout][:2]
    return jax.make_mesh(shape, axes, devices=jax.devices("cpu")[:VOCAB_DEVICES])


def h100_vocab_mesh(layout: str = "vocab"):
    from tests._deviceless import gpu
    return gpu.gpu_mesh("h100", *LAYOUTS[layout][:2])


def vocab_parallel_figures(size: Size, mesh=None, layout: str = "vocab") -> dict[str, object]:
    mesh = mesh if mesh is not None else vocab_mesh(layout)
    _, _, program, tokens_spec = LAYOUTS[layout]
    structs = operand_structs(size, mesh, tokens_spec)
    figures: dict[str, object] = {}
    with jax.set_mesh(mesh):
        for impl, body in (("fused", fused_body), ("unfused", unfused_body)):
            compiled = compile_step(program(body), structs)
            figures[impl] = temp_bytes(compiled)
            figures[f"{impl}_large_all_gathers"] = len(large_all_gathers(compiled, size,
                                                                         VOCAB_DEVICES))
            figures[f"{impl}_largest_all_reduce"] = largest_all_reduce(compiled)
    return figures


def table(size: Size) -> str:
    f32 = dataclasses.replace(size, dtype="float32")
    rows = [("CPU", cpu_figures(size)), ("CPU, float32 inputs", cpu_figures(f32))]
    rows += [(f"{layout}, {VOCAB_DEVICES} CPU devices (per device)",
              vocab_parallel_figures(size, layout=layout)) for layout in LAYOUTS]
    if _cuda_compile_available():
        rows += [("H100 (deviceless)", h100_figures(size))]
        rows += [(f"{layout}, {VOCAB_DEVICES} H100s (deviceless, per device)",
                  vocab_parallel_figures(size, h100_vocab_mesh(layout), layout))
                 for layout in LAYOUTS]
    lines = [f"tokens {size.tokens}, hidden {size.hidden}, vocab {size.vocab}, {size.dtype} "
             f"unless said; temp bytes of jit(value_and_grad(loss))",
             "", "| program | fused | unfused | fused / unfused | largest all-reduce |",
             "|---|---|---|---|---|"]
    for name, figures in rows:
        fused, unfused = figures["fused"], figures["unfused"]
        reduce = figures.get("fused_largest_all_reduce")
        lines.append(f"| {name} | {fused:,} | {unfused:,} | {fused / unfused:.4f} | "
                     f"{'' if reduce is None else f'{reduce:,}'} |")
    if _cuda_compile_available():
        lines += ["", stored_table(SPEED_SIZE)]
    return "\n".join(lines)


def stored_table(size: Size) -> str:
    figures = stored_figures(size)
    return "\n".join([
        f"backward=\"in_forward\", H100 (deviceless), tokens {size.tokens}, hidden "
        f"{size.hidden}, vocab {size.vocab}, {size.dtype}: temp bytes of jit(value_and_grad)",
        "", "| softmax | fused | unfused | fused / unfused |", "|---|---|---|---|",
        *(f"| {name} | {figures[impl]:,} | {figures['unfused']:,} | "
          f"{figures[impl] / figures['unfused']:.4f} |"
          for name, impl in (("XLA loop", "fused"), ("Pallas kernel", "pallas")))])


# --- pytest ------------------------------------------------------------------


def _record(benchmark, size_name, program, figures, dtype="bfloat16"):
    """The bytes (the timed figure is only the compile: the entry is for its extra_info)."""
    benchmark.group = f"cross_entropy-memory-{program}"
    benchmark.extra_info.update(op=f"cross_entropy temp bytes, {program}", size=size_name,
                                program=program, dtype=dtype, backend="fused vs unfused",
                                **{k: v for k, v in figures.items()})
    benchmark.extra_info["ratio"] = figures["fused"] / figures["unfused"]


def _check_goal(size_name, figures):
    """At the large size: fused temp <= 2% of the unfused one."""
    if size_name == "large":
        assert figures["fused"] <= GOAL * figures["unfused"], figures


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("size_name", ["small", "large"])
def test_memory_cpu(benchmark, size_name, dtype):
    size = dataclasses.replace(SIZES[size_name], dtype=dtype)
    figures = benchmark.pedantic(cpu_figures, (size,), rounds=1, iterations=1)
    _record(benchmark, size_name, "cpu", figures, dtype)
    _check_goal(size_name, figures)


@pytest.mark.parametrize("size_name", ["small", "large"])
def test_memory_h100(benchmark, size_name):
    if not _cuda_compile_available():
        pytest.skip("no deviceless CUDA compile here (needs the compile extra)")
    figures = benchmark.pedantic(h100_figures, (SIZES[size_name],), rounds=1, iterations=1)
    _record(benchmark, size_name, "h100", figures)
    _check_goal(size_name, figures)


# Per device, vocab-parallel: the fused temp at most 5% of the unfused one
# (the recompute backward's token blocks bound its f32 buffers). On CPU both
# programs hold the same floor: shard_map's transpose all-reduces each
# replicated input's cotangent (dh over the vocab's axis, and w's over the
# tokens' in dp x mp), and XLA:CPU promotes a 16-bit all-reduce to f32 (its
# operand and result, both f32, live together). At the large size that is
# 128 MiB (dh) with the tokens replicated, 6.4% of the unfused temp on JAX
# 0.12, and 1.05 GB (w's) in dp x mp; the fused program holds 4.4 MB and
# 408 bytes beyond it (bench/README.md). On CPU the goal is therefore on the
# bytes beyond that floor.
VOCAB_PARALLEL_GOAL = 0.05


def all_reduce_floor(figures) -> int:
    """The bytes of the fused program's largest all-reduce, operand and
    result, which the unfused program holds as well."""
    assert figures["unfused_largest_all_reduce"] >= figures["fused_largest_all_reduce"], figures
    return 2 * figures["fused_largest_all_reduce"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("target", ["cpu", "h100"])
@pytest.mark.parametrize("size_name", ["small", "large"])
def test_memory_vocab_parallel(benchmark, size_name, target, layout):
    if target == "h100" and not _cuda_compile_available():
        pytest.skip("no deviceless CUDA compile here (needs the compile extra)")
    mesh = h100_vocab_mesh(layout) if target == "h100" else vocab_mesh(layout)
    figures = benchmark.pedantic(vocab_parallel_figures, (SIZES[size_name], mesh, layout),
                                 rounds=1, iterations=1)
    _record(benchmark, size_name, f"vocab-parallel {layout} {target}", figures)
    assert figures["fused_large_all_gathers"] == 0, figures
    # At the small size the loop's fixed buffers outweigh a few KB of logits
    # (JAX 0.12: 160 KB fused vs 136 KB unfused): compared only large.
    if size_name == "large":
        floor = all_reduce_floor(figures) if target == "cpu" else 0
        assert figures["fused"] - floor <= VOCAB_PARALLEL_GOAL * (figures["unfused"] - floor), \
            figures


def test_small_values_match():
    """The programs measured compute the same loss and gradients (small size, run)."""
    size = SIZES["small"]
    k = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(k[0], (size.tokens, size.hidden), size.dtype)
    w = (jax.random.normal(k[1], (size.hidden, size.vocab)) / size.hidden**0.5).astype(size.dtype)
    labels = jax.random.randint(k[2], (size.tokens,), 0, size.vocab)
    want = jax.value_and_grad(lambda h, w: unfused_loss(h.astype(jnp.float32),
                                                        w.astype(jnp.float32), labels),
                              argnums=(0, 1))(h, w)
    steps = [(None, jax.value_and_grad(fused_loss, argnums=(0, 1)))]
    steps += [(vocab_mesh(layout), jax.value_and_grad(LAYOUTS[layout][2](fused_body),
                                                      argnums=(0, 1)))
              for layout in LAYOUTS]
    for mesh, step in steps:
        with jax.set_mesh(mesh if mesh is not None else vocab_mesh()):
            got = step(h, w, labels)
        for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert_close(np.asarray(g, np.float32), r, jnp.bfloat16, scale=np.abs(r).max())


# --- speed --------------------------------------------------------------------


def speed_operands(size: Size):
    k = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(k[0], (size.tokens, size.hidden), size.dtype)
    w = (jax.random.normal(k[1], (size.hidden, size.vocab)) / size.hidden**0.5).astype(size.dtype)
    return h, w, jax.random.randint(k[2], (size.tokens,), 0, size.vocab)


def _seconds(fn, args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def speed_figures(size: Size, program: str, rounds: int = SPEED_ROUNDS) -> dict[str, float]:
    """Median seconds of each and the median per-round fused / unfused ratio."""
    wrap = (lambda f: jax.value_and_grad(f, argnums=(0, 1))) if program == "value_and_grad" \
        else (lambda f: f)
    fns = {impl: jax.jit(wrap(loss)) for impl, loss in (("fused", fused_loss),
                                                          ("unfused", unfused_loss))}
    args = speed_operands(size)
    for fn in fns.values():
        jax.block_until_ready(fn(*args))     # compile and warm, untimed
    times: dict[str, list[float]] = {"fused": [], "unfused": []}
    for r in range(rounds):
        order = ("fused", "unfused") if r % 2 == 0 else ("unfused", "fused")
        for impl in order:
            times[impl].append(_seconds(fns[impl], args))
    ratios = [f / u for f, u in zip(times["fused"], times["unfused"])]
    return {"fused": statistics.median(times["fused"]),
            "unfused": statistics.median(times["unfused"]), "ratio": statistics.median(ratios)}


def speed_table(size: Size = SPEED_SIZE, rounds: int = SPEED_ROUNDS) -> str:
    lines = [f"tokens {size.tokens}, hidden {size.hidden}, vocab {size.vocab}, CPU; median of "
             f"{rounds} interleaved rounds", "",
             "| program | dtype | fused s | unfused s | fused / unfused |", "|---|---|---|---|---|"]
    for program in ("value_and_grad", "forward"):
        for dtype in ("float32", "bfloat16"):
            fig = speed_figures(dataclasses.replace(size, dtype=dtype), program, rounds)
            lines.append(f"| {program} | {dtype} | {fig['fused']:.3f} | {fig['unfused']:.3f} | "
                         f"{fig['ratio']:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    parts = set(sys.argv[1:]) or {"--memory", "--speed"}
    if "--memory" in parts:
        print(table(SIZES["large"]))
    if "--speed" in parts:
        print(speed_table())
