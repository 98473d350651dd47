"""How long ``nx.xmap`` takes to reach its first result, against the same
program written by hand with ``jax.shard_map`` (its twin), in one run.

Programs, each ``jax.jit(jax.value_and_grad(loss))`` over the (dp=2, mp) mesh
with the batch on ``dp`` and the model shards on ``mp``:

- ``fg_mlp``: Megatron's column- then row-parallel MLP written with the f/g
  operators (custom_vjps around ``psum``; ``tests/_megatron.py``); its twin a
  ``shard_map(check_vma=True)`` with the same f/g (g's bwd casting its
  cotangent to varying, as that typing asks), which computes nxops' values
  and gradients (``tests/xmap/test_fg_custom_rules.py`` checks both, and
  that both compile to the same all-reduces);
- ``fg_mlp_check_vma_false``: the same nxops program against the
  ``shard_map(check_vma=False)`` program with the same f/g, which computes
  other gradients (x's 1/mp of nxops', the weights' 1/mp of theirs), for
  comparison with earlier tables;
- ``training_step``: the Megatron-style block of ``bench_training.py``
  (``psum`` over the shards, vocab logits, cross-entropy, ``pmean``);
- ``gptj_stack``: GPT-J's layer (``tests/_megatron.py``: layer norm,
  attention and MLP in parallel, f/g operators) stacked ``GPTJ_LAYERS`` times, at toy width (tracing cost
  grows with the layers, not the width); its twin a ``check_vma=True``
  ``shard_map`` as ``fg_mlp``'s.

Per sample, one fresh process (``subprocess``) times the first call of a
fresh jitted step (trace + lower + compile + run), then, for another fresh
function object in the same process, ``.lower`` (trace + lower) and
``.compile()``. Samples alternate nxops and twin (which goes first
alternates per round); the table holds the medians.

    python -m bench.bench_first_call --rounds 5 --programs fg_mlp training_step
    python -m bench.bench_first_call --rounds 3 --programs gptj_stack
    python -m bench.bench_first_call --lower-in-process 15 --programs fg_mlp training_step
    python -m bench.bench_first_call --calls-per-lower 3 --programs fg_mlp training_step
    python -m bench.bench_first_call --calls-first-call --programs fg_mlp training_step
    python -m bench.bench_first_call --worker fg_mlp 2 xmap  # one sample, as JSON
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

DP = 2
PROGRAMS = ("fg_mlp", "fg_mlp_check_vma_false", "training_step", "gptj_stack")
IMPLS = ("xmap", "twin")
GPTJ_LAYERS = 28


def _setup_devices(n: int = 8) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


# -- the programs: (step factory, operands, partition specs) ------------------


def _fg_mlp(mp: int, typed_twin: bool = True):
    import jax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    import nxops as nx
    from tests._megatron import fg_operators, fg_operators_typed

    T, D, H = 64, 512, 2048

    def body(operators):
        def mlp(x, w1, w2):
            f, g = operators()
            return g(jax.nn.gelu(f(x) @ w1) @ w2)
        return mlp

    k = jax.random.split(jax.random.key(0), 3)
    operands = (jax.random.normal(k[0], (DP, T, D)),
                jax.random.normal(k[1], (mp, D, H // mp)) / D**0.5,
                jax.random.normal(k[2], (mp, H // mp, D)) / H**0.5)
    specs = (P("dp"), P("mp"), P("mp"))

    def xmapped():
        return nx.xmap(body(lambda: fg_operators(nx.psum, "s")),
                       (["b", ...], ["s", ...], ["s", ...]), ["b", ...],
                       axis_resources={"b": "dp", "s": "mp"})

    def twin():
        operators = ((lambda: fg_operators_typed("mp")) if typed_twin
                     else lambda: fg_operators(lax.psum, "mp"))
        local = lambda x, w1, w2: body(operators)(x[0], w1[0], w2[0])[None]
        return jax.shard_map(local, in_specs=specs, out_specs=P("dp"), check_vma=typed_twin)
    return {"xmap": xmapped, "twin": twin}, operands, specs


def _training_step(mp: int):
    import jax
    from jax.sharding import PartitionSpec as P

    import nxops as nx
    from bench.bench_training import IN_AXES, named_block, shard_map_twin

    B, D, H, V = 32, 256, 1024, 512
    resources = {"batch": "dp", "shard": "mp"}
    k = jax.random.split(jax.random.key(0), 5)
    operands = (jax.random.normal(k[0], (mp, D, H // mp)) / D**0.5,
                jax.random.normal(k[1], (mp, H // mp, D)) / H**0.5,
                jax.random.normal(k[2], (D, V)) / D**0.5,
                jax.random.normal(k[3], (DP, B, D)),
                jax.random.randint(k[4], (DP, B), 0, V))
    specs = (P("mp"), P("mp"), P(), P("dp"), P("dp"))
    return {"xmap": lambda: nx.xmap(lambda *a: named_block(*a), IN_AXES, [],
                                    axis_resources=resources),
            "twin": lambda: shard_map_twin(resources, jax.sharding.get_abstract_mesh())[0]
            }, operands, specs


def _gptj_stack(mp: int, layers: int = GPTJ_LAYERS):
    import jax

    from tests._megatron import gptj_params, gptj_stack

    T, D, HEADS, HEAD_DIM, FFN = 16, 64, 8, 8, 256
    keys = jax.random.split(jax.random.key(0), layers + 1)
    params = [gptj_params(k, shards=mp, model=D, heads=HEADS, head_dim=HEAD_DIM, ffn=FFN)
              for k in keys[1:]]
    operands = (params, jax.random.normal(keys[0], (DP, T, D)))
    xmapped, twin, specs = gptj_stack(layers, HEAD_DIM)
    return {"xmap": xmapped, "twin": twin}, operands, specs


BUILDERS = {"fg_mlp": _fg_mlp,
            "fg_mlp_check_vma_false": lambda mp: _fg_mlp(mp, typed_twin=False),
            "training_step": _training_step, "gptj_stack": _gptj_stack}


def _step(make):
    """A fresh ``jit(value_and_grad(loss))`` around a fresh program."""
    import jax
    import jax.numpy as jnp
    program = make()
    loss = lambda *a: jnp.mean(program(*a) ** 2)
    return jax.jit(jax.value_and_grad(loss, argnums=0))


@contextlib.contextmanager
def _on_mesh(program: str, mp: int, gptj_layers: int):
    """Inside the (dp, mp) mesh: the program's makers (nxops and twin) and its
    operands placed by their specs."""
    _setup_devices()
    import jax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    mesh = jax.make_mesh((DP, mp), ("dp", "mp"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[:DP * mp])
    with jax.set_mesh(mesh):
        build = BUILDERS[program]
        makers, operands, specs = (build(mp, gptj_layers) if program == "gptj_stack"
                                   else build(mp))
        args = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)),
                            operands, specs, is_leaf=lambda s: isinstance(s, PartitionSpec))
        yield makers, args


def worker(program: str, mp: int, impl: str, gptj_layers: int = GPTJ_LAYERS) -> dict:
    """One sample in this (fresh) process: first call, then trace + lower and compile."""
    _setup_devices()
    import jax
    import jax.numpy as jnp

    with _on_mesh(program, mp, gptj_layers) as (makers, args):
        jax.block_until_ready(jax.jit(lambda a: a + 1)(jnp.ones(2)))   # the runtime, started
        start = time.perf_counter()
        value = jax.block_until_ready(_step(makers[impl])(*args))
        first_call = time.perf_counter() - start
        step = _step(makers[impl])
        start = time.perf_counter()
        lowered = step.lower(*args)
        traced = time.perf_counter()
        lowered.compile()
        compiled = time.perf_counter()
    return {"first_call_s": first_call, "trace_lower_s": traced - start,
            "compile_s": compiled - traced, "loss": float(value[0])}


def lower_ratios(program: str, mp: int, repeats: int, gptj_layers: int = GPTJ_LAYERS) -> dict:
    """In this process: ``repeats`` rounds of trace + lower of a fresh step,
    nxops and twin alternating (ABBA), after one warm-up each. Returns the
    medians and the median of the per-round ratios, steadier than fresh
    processes for this part (no process start in the spread)."""
    with _on_mesh(program, mp, gptj_layers) as (makers, args):
        times: dict = {impl: [] for impl in IMPLS}
        for r in range(repeats + 1):
            for impl in (IMPLS if r % 2 == 0 else IMPLS[::-1]):
                step = _step(makers[impl])
                start = time.perf_counter()
                step.lower(*args)
                if r:   # round 0 warms up
                    times[impl].append(time.perf_counter() - start)
    ratios = [x / t for x, t in zip(times["xmap"], times["twin"])]
    return {"xmap_s": statistics.median(times["xmap"]), "twin_s": statistics.median(times["twin"]),
            "ratio": statistics.median(ratios)}


def _calls(run) -> int:
    """The Python function calls (and C calls) ``run()`` makes."""
    calls = [0]

    def hook(frame, event, arg):
        if event in ("call", "c_call"):
            calls[0] += 1
    sys.setprofile(hook)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls[0]


def first_call_calls(program: str, mp: int, impl: str, gptj_layers: int = GPTJ_LAYERS) -> int:
    """In this (fresh) process: the Python calls of the first call of a
    jitted step (trace + lower + compile + run), caches cold as a user's."""
    _setup_devices()
    import jax
    import jax.numpy as jnp

    with _on_mesh(program, mp, gptj_layers) as (makers, args):
        jax.block_until_ready(jax.jit(lambda a: a + 1)(jnp.ones(2)))   # the runtime, started
        step = _step(makers[impl])
        return _calls(lambda: jax.block_until_ready(step(*args)))


def calls_per_lower(program: str, mp: int, repeats: int, gptj_layers: int = GPTJ_LAYERS) -> dict:
    """In this process: the Python function calls (and C calls) one trace +
    lower of a fresh step makes, per implementation, after one warm-up each.
    The same count on any load, so a steady proxy for the time it takes."""
    with _on_mesh(program, mp, gptj_layers) as (makers, args):
        counts: dict = {impl: [] for impl in IMPLS}
        for r in range(repeats + 1):
            for impl in IMPLS:
                step = _step(makers[impl])
                n = _calls(lambda: step.lower(*args))
                if r:   # round 0 warms up
                    counts[impl].append(n)
    return {impl: statistics.median(counts[impl]) for impl in IMPLS}


def _sample(program: str, mp: int, impl: str, gptj_layers: int, *flags: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.bench_first_call", "--worker", program,
                          str(mp), impl, "--gptj-layers", str(gptj_layers), *flags],
                         capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_same_loss(what: str, samples: dict) -> None:
    losses = {impl: samples[impl]["loss"] for impl in IMPLS}
    if abs(losses["xmap"] - losses["twin"]) > 1e-4 * max(1.0, abs(losses["twin"])):
        raise AssertionError(f"{what}: the losses differ: {losses}")


def test_every_program_runs():
    """The benchmark's code, untimed and in this process (CI keeps it from
    rotting): each program, the GPT-J stack at 2 layers, gives the twin's loss."""
    for program in PROGRAMS:
        check_same_loss(program, {impl: worker(program, 2, impl, gptj_layers=2) for impl in IMPLS})


def run(programs, mps, rounds: int, gptj_layers: int = GPTJ_LAYERS) -> list[dict]:
    rows = []
    for program in programs:
        for mp in mps:
            samples: dict = {impl: [] for impl in IMPLS}
            for r in range(rounds):
                for impl in (IMPLS if r % 2 == 0 else IMPLS[::-1]):
                    samples[impl].append(_sample(program, mp, impl, gptj_layers))
            check_same_loss(f"{program} mp={mp}", {impl: samples[impl][0] for impl in IMPLS})
            median = {impl: {k: statistics.median(s[k] for s in samples[impl])
                             for k in ("trace_lower_s", "compile_s", "first_call_s")}
                      for impl in IMPLS}
            rows.append({"program": program, "mp": mp, "rounds": rounds, **median})
            print(_row(rows[-1]), flush=True)
    return rows


HEADER = ("| program | mp | trace + lower, xmap / twin | compile, xmap / twin "
          "| first call, xmap / twin |\n|---|---|---|---|---|")


def _row(row: dict) -> str:
    x, t = row["xmap"], row["twin"]
    cells = [f"{x[k]:.2f} / {t[k]:.2f} s = **{x[k] / t[k]:.2f}x**"
             for k in ("trace_lower_s", "compile_s", "first_call_s")]
    return f"| {row['program']} | {row['mp']} | " + " | ".join(cells) + " |"


def _table(args, columns: str, cell) -> None:
    """A markdown table: a row per program and mp, ``cell(program, mp)`` the rest."""
    print(f"| program | mp | {columns} |\n|" + "---|" * (3 + columns.count("|")))
    for program in args.programs:
        for mp in args.mp:
            print(f"| {program} | {mp} | {cell(program, mp)} |", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", nargs=3, metavar=("PROGRAM", "MP", "IMPL"))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--programs", nargs="+", default=list(PROGRAMS), choices=PROGRAMS)
    parser.add_argument("--mp", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--gptj-layers", type=int, default=GPTJ_LAYERS)
    parser.add_argument("--lower-in-process", type=int, metavar="ROUNDS",
                        help="only trace + lower, ROUNDS interleaved rounds in this process")
    parser.add_argument("--calls-per-lower", type=int, metavar="ROUNDS",
                        help="only count the Python calls of one trace + lower (median of ROUNDS)")
    parser.add_argument("--calls-first-call", action="store_true",
                        help="only count the Python calls of the first call, in a fresh process")
    args = parser.parse_args(argv)
    if args.worker:
        program, mp, impl = args.worker
        print(json.dumps(first_call_calls(program, int(mp), impl, args.gptj_layers)
                         if args.calls_first_call else
                         worker(program, int(mp), impl, args.gptj_layers)))
        return
    if args.calls_first_call:
        def first_calls(program, mp):
            c = {impl: _sample(program, mp, impl, args.gptj_layers, "--calls-first-call")
                 for impl in IMPLS}
            return f"{c['xmap']} / {c['twin']} = **{c['xmap'] / c['twin']:.2f}x**"
        _table(args, "Python calls of the first call (fresh process), xmap / twin", first_calls)
        return
    if args.calls_per_lower:
        def calls(program, mp):
            c = calls_per_lower(program, mp, args.calls_per_lower, args.gptj_layers)
            return f"{c['xmap']:.0f} / {c['twin']:.0f} = **{c['xmap'] / c['twin']:.2f}x**"
        _table(args, "Python calls per trace + lower, xmap / twin", calls)
        return
    if args.lower_in_process:
        def lower(program, mp):
            r = lower_ratios(program, mp, args.lower_in_process, args.gptj_layers)
            return f"{r['xmap_s']:.3f} / {r['twin_s']:.3f} s | **{r['ratio']:.2f}x**"
        _table(args, "trace + lower, xmap / twin (medians) | median per-round ratio", lower)
        return
    print(HEADER, flush=True)
    run(args.programs, args.mp, args.rounds, args.gptj_layers)


if __name__ == "__main__":
    main()
