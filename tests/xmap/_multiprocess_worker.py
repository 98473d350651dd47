"""One process of the multi-process test, and the programs both it and the
single-process reference run.

As a script: ``python _multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT.npz``
joins ``jax.distributed`` on 127.0.0.1 (4 CPU devices per process), runs
``run_all`` on a (2, 4) mesh spanning every process and, on process 0, saves
the results.
"""
import os
import sys

import numpy as np

SHAPES = {"x": (8, 4), "w1": (4, 8), "w2": (8, 3), "v": (8, 8)}


def global_inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    arrays = {k: (rng.standard_normal(s) / 2).astype(np.float32) for k, s in SHAPES.items()}
    arrays["labels"] = rng.integers(0, 3, 8).astype(np.int32)
    return arrays


def run_all(mesh, make_input) -> dict[str, np.ndarray]:
    """Every program on ``mesh``; ``make_input(name, array, pspec)`` builds a global input."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import PartitionSpec as P

    import nxops as nx

    g = global_inputs()
    x = make_input("x", g["x"], P("data"))
    w1, w2 = make_input("w1", g["w1"], P()), make_input("w2", g["w2"], P())
    labels, v = make_input("labels", g["labels"], P()), make_input("v", g["v"], P())

    def per_example_loss(x, w1, w2, label):
        hidden = jax.nn.relu(nx.einsum("<inputs>,<inputs,hidden>-><hidden>", x, w1))
        logits = nx.einsum("<hidden>,<hidden>c->c", hidden, w2)
        return jax.nn.logsumexp(logits) - logits[label]

    loss = nx.xmap(per_example_loss, (["batch", "inputs"], ["inputs", "hidden"], ["hidden", ...],
                                      ["batch"]), ["batch"],
                   axis_resources={"batch": ("data", nx.SerialLoop(2)), "hidden": "model"})
    total = lambda w1, w2: jnp.sum(loss(x, w1, w2, labels))
    results = {"loss": total(w1, w2)}
    results["grad_w1"], results["grad_w2"] = jax.grad(total, argnums=(0, 1))(w1, w2)

    collectives = {
        "psum": (lambda v: nx.psum(v, "a"), [...]),
        "pmax": (lambda v: nx.pmax(v, "a"), [...]),
        "pmin": (lambda v: nx.pmin(v, "a"), [...]),
        "pmean": (lambda v: nx.pmean(v, "a"), [...]),
        "all_gather": (lambda v: nx.all_gather(v, "a"), [...]),
        "untile": (lambda v: nx.untile(v, {"a": 0}), [...]),
        "psum_scatter": (lambda v: nx.psum_scatter(v, "a", tiled=True), ["a", ...]),
        "all_to_all": (lambda v: nx.all_to_all(v, "a", 0, 0, tiled=True), ["a", ...]),
        "ppermute": (lambda v: nx.ppermute(v, "a", [(i, (i + 1) % 8) for i in range(8)]),
                     ["a", ...]),
        "axis_index": (lambda v: v * 0 + nx.axis_index("a"), ["a", ...]),
    }
    for name, (body, out_axes) in collectives.items():
        results[name] = nx.xmap(body, ["a", ...], out_axes,
                                axis_resources={"a": ("data", "model")})(v)
    return {k: np.asarray(multihost_utils.process_allgather(r, tiled=True))
            if jax.process_count() > 1 else np.asarray(r) for k, r in results.items()}


def _refusals(mesh) -> dict[str, np.ndarray]:
    """What must fail with an NxopsError across processes (1 = it did)."""
    import jax

    import nxops as nx

    f = nx.xmap(lambda v: nx.untile(v, {"a": 0}), ["a", ...], [...],
                axis_resources={"a": ("data", "model")})
    out = {}
    local = jax.device_put(np.ones((8, 2), np.float32), jax.local_devices()[0])
    for name, call in (("local_input", lambda: f(local)),):
        try:
            call()
            out[name] = np.int32(0)
        except nx.NxopsError as e:
            out[name] = np.int32("make_array_from_process_local_data" in str(e))
    g = jax.make_array_from_callback((8, 2), jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec()), lambda idx: np.ones((8, 2), np.float32)[idx])
    try:
        with nx.kernels.use("collective=pallas"):
            f(g)
        out["pallas_collective"] = np.int32(0)
    except nx.NxopsError as e:
        out["pallas_collective"] = np.int32("between processes" in str(e))
    return out


def main(process_id: int, num_processes: int, port: int, out_path: str) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    from jax.sharding import NamedSharding

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=num_processes, process_id=process_id,
                               initialization_timeout=60)
    mesh = jax.make_mesh((2, 4), ("data", "model"))

    def make_input(name, array, pspec):
        sharding = NamedSharding(mesh, pspec)
        if name == "x":   # this process's rows only
            rows = sorted({idx[0].indices(array.shape[0])[:2]
                           for idx in sharding.addressable_devices_indices_map(array.shape).values()})
            start, stop = rows[0][0], rows[-1][1]
            return jax.make_array_from_process_local_data(sharding, array[start:stop], array.shape)
        return jax.make_array_from_callback(array.shape, sharding, lambda idx: array[idx])

    with jax.set_mesh(mesh):
        results = run_all(mesh, make_input)
        results.update(_refusals(mesh))
    if process_id == 0:
        np.savez(out_path, **results)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
