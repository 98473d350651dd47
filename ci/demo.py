"""The named toy network of the old xmap tutorial, on 8 simulated CPU devices.

Runs the same named program under several axis_resources, checks the losses
agree with the positional network, shows SerialLoop's lower temp memory, and
prints which kernel each nxops op uses. ``NXOPS_KERNELS=pallas python
ci/demo.py`` runs the Pallas kernels (interpret mode on CPU).
"""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

import nxops as nx
from nxops import SerialLoop, xmap
from nxops.kernels._selection import current_selection


def named_predict(w1, w2, image):
    hidden = jax.nn.relu(nx.pdot(image, w1, "inputs"))
    logits = nx.pdot(hidden, w2, "hidden")
    return logits - nx.logsumexp(logits, "classes")


def named_loss(w1, w2, images, labels):
    predictions = named_predict(w1, w2, images)
    num_classes = nx.psum(1, "classes")  # static, as lax.psum was in the tutorial
    targets = nx.one_hot(labels, num_classes, axis="classes")
    losses = nx.psum(targets * predictions, "classes")
    return -nx.pmean(losses, "batch")


def positional_loss(w1, w2, images, labels):
    logits = jax.nn.relu(images @ w1) @ w2
    predictions = logits - jax.nn.logsumexp(logits, axis=1, keepdims=True)
    return -jnp.mean(jnp.sum(jax.nn.one_hot(labels, w2.shape[1]) * predictions, axis=1))


IN_AXES = [["inputs", "hidden", ...], ["hidden", "classes", ...],
           ["batch", "inputs", ...], ["batch", ...]]


def main():
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    w1 = jax.random.normal(k1, (64, 32)) / 8
    w2 = jax.random.normal(k2, (32, 8)) / 6
    images = jax.random.normal(k3, (128, 64))
    labels = jax.random.randint(k4, (128,), 0, 8)
    args = (w1, w2, images, labels)
    mesh = jax.make_mesh((4, 2), ("x", "y"))  # Explicit axes, JAX's default
    print(f"NXOPS_KERNELS={current_selection()}, devices: {len(jax.devices())} x "
          f"{jax.devices()[0].platform}, mesh {dict(mesh.shape)}")

    want = float(positional_loss(*args))
    print(f"  positional network             loss = {want:.6f}")
    with jax.set_mesh(mesh):
        for resources in [{}, {"batch": "x"}, {"hidden": "x"}, {"batch": "x", "hidden": "y"}]:
            loss = xmap(named_loss, in_axes=IN_AXES, out_axes=[...], axis_resources=resources)
            got = float(loss(*args))
            ok = np.isclose(got, want, rtol=1e-5, atol=1e-5)
            print(f"  axis_resources={str(resources):<30} loss = {got:.6f}  "
                  f"{'agrees' if ok else 'DIFFERS'}")
            assert ok, (resources, got, want)

    # Memory: the per-example predictions under a SerialLoop over the batch.
    predict_axes = [["inputs", "hidden", ...], ["hidden", "classes", ...],
                    ["batch", "inputs", ...]]
    wide = (jax.random.normal(k1, (64, 2048)) / 8, jax.random.normal(k2, (2048, 8)) / 45, images)
    temps = {}
    for resources in [{}, {"batch": SerialLoop(8)}]:
        predict = xmap(named_predict, predict_axes, ["batch", "classes", ...],
                       axis_resources=resources)
        temps[str(resources)] = predict.lower(*wide).compile().memory_analysis().temp_size_in_bytes
        if resources:
            plain = xmap(named_predict, predict_axes, ["batch", "classes", ...])
            np.testing.assert_allclose(predict(*wide), plain(*wide), rtol=1e-4, atol=1e-4)
    print("  temp memory of named_predict, batch 128, hidden 2048:")
    for name, size in temps.items():
        print(f"    axis_resources={name:<28} {size:>9,d} bytes")

    loss = xmap(named_loss, in_axes=IN_AXES, out_axes=[...],
                axis_resources={"batch": "x", "hidden": "y"})
    with jax.set_mesh(mesh):
        print(nx.kernels.explain(loss, *args))
        # The same program lowered (not run) for GPU and TPU from this CPU:
        for platform in ("cuda", "tpu"):
            report = nx.kernels.explain(loss, *args, platform=platform)
            kernels = sorted({r.choice.kernel.name for r in report.reports})
            print(f"  lowered for {platform}: {', '.join(kernels)}")


if __name__ == "__main__":
    main()
