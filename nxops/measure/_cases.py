"""The cases ``python -m nxops.measure`` times, by the names a run's JSON
lines use (``bench/gpu_runs/`` holds the runs so far).

Section ``kernels``: one nxops op per program, its operand a program argument.
Section ``programs``: small whole programs around the ops (epilogues, fused
producers, gradients, an xmapped MLP with a cross-entropy over 'classes').
Section ``cross_entropy``: ``nx.cross_entropy``'s value and gradient beside
the unfused program it replaces. Section ``attention``: ``nx.attention``'s
forward and value_and_grad (xla, pallas and, where it can take the call,
cuDNN). Where a name gives no shape (programs), the shapes here are
reconstructions, said in each case's ``note``.

``scale`` divides every size (at least 8 is kept): ``--dry`` runs them on CPU
at ``scale=64``.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp

import nxops as nx

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
REDUCERS = {"sum": nx.sum, "max": nx.max, "lse": nx.logsumexp}
REDUCE_AXES = {"rows": 1, "cols": 0, "all": (0, 1)}


@dataclasses.dataclass(frozen=True)
class GpuCase:
    """One measured program: ``fn(*args)`` with ``args`` of ``shapes``."""

    name: str
    section: str
    fn: Callable[..., Any]
    shapes: tuple[tuple[tuple[int, ...], Any], ...]
    note: str = ""
    # Whether its times stand for its ops' table case (an operand XLA fuses
    # into the op is a different case: `auto` keeps XLA there anyway).
    feeds_table: bool = True

    def args(self) -> list[jax.ShapeDtypeStruct]:
        return [jax.ShapeDtypeStruct(s, d) for s, d in self.shapes]

    def arrays(self, seed: int = 0) -> list[jax.Array]:
        keys = jax.random.split(jax.random.key(seed), len(self.shapes))
        return [jax.random.normal(k, s, jnp.float32).astype(d) for k, (s, d) in zip(keys, self.shapes)]


def _dims(text: str, scale: int) -> tuple[int, ...]:
    return tuple(max(8, int(d) // scale) if scale > 1 else int(d) for d in text.split("x"))


def _einsum(spec: str):
    return lambda *xs: nx.einsum(spec, *xs)


def _grad_matmul(a, b):
    return jax.grad(lambda a, b: nx.einsum("ij,jk->ik", a, b).astype(jnp.float32).sum(),
                    argnums=(0, 1))(a, b)


def _named_sum(x):
    return jax.vmap(lambda row: nx.sum(row, "i"), axis_name="i")(x)


def _pdot_named_k(a, b):
    return jax.vmap(lambda x, y: nx.pdot(x, y, "k"), in_axes=(1, 0), axis_name="k")(a, b)


def _kernel_case(name: str, scale: int) -> GpuCase:
    """A ``kernels`` case from its name: layout_op_RxC_dtype, matmul_N_dtype, ..."""
    parts = name.split("_")
    dtype = DTYPES[parts[-1]]
    if parts[0] in REDUCE_AXES:
        layout, op, dims = parts[0], parts[1], _dims(parts[2], scale)
        axes = REDUCE_AXES[layout]
        return GpuCase(name, "kernels", lambda x: REDUCERS[op](x, axes), ((dims, dtype),))
    if parts[0] == "named":    # named_vmap_sum_RxC: a sum over a vmap-bound name
        return GpuCase(name, "kernels", _named_sum, ((_dims(parts[3], scale), dtype),))
    if parts[0] in ("matmul", "grad"):
        (n,) = _dims(parts[-2], scale)
        fn = _grad_matmul if parts[0] == "grad" else _einsum("ij,jk->ik")
        return GpuCase(name, "kernels", fn, (((n, n), dtype), ((n, n), dtype)))
    if parts[0] in ("skinny", "odd"):
        m, k, n = _dims(parts[1], scale)
        return GpuCase(name, "kernels", _einsum("ij,jk->ik"), (((m, k), dtype), ((k, n), dtype)))
    if parts[0] == "batched":
        b, n = _dims(parts[1], scale)
        return GpuCase(name, "kernels", _einsum("bij,bjk->bik"),
                       (((b, n, n), dtype), ((b, n, n), dtype)))
    if parts[0] == "pdot":
        (n,) = _dims(parts[3], scale)
        return GpuCase(name, "kernels", _pdot_named_k, (((n, n), dtype), ((n, n), dtype)))
    raise ValueError(f"no kernels case named {name!r}")


KERNEL_NAMES = tuple(
    [f"{layout}_{op}_{size}_{dt}" for size in ("16384x8192", "4096x4096") for dt in ("f32", "bf16")
     for layout, op in (("rows", "sum"), ("cols", "sum"), ("rows", "max"), ("rows", "lse"),
                        ("cols", "lse"), ("all", "sum"))]
    + ["matmul_4096_bf16", "matmul_8192_bf16", "matmul_4096_f32", "skinny_8x4096x4096_bf16",
       "skinny_128x4096x4096_bf16", "odd_1000x3000x500_bf16", "batched_16x1024_bf16",
       "pdot_named_k_4096_bf16", "grad_matmul_4096_bf16", "named_vmap_sum_4096x4096_f32"])


# --- programs ----------------------------------------------------------------------

MLP = dict(batch=8192, inputs=4096, hidden=4096, classes=16384)


def _mlp_predict(w1, w2, images):
    hidden = jax.nn.relu(nx.pdot(images, w1, "inputs"))
    logits = nx.pdot(hidden, w2, "hidden")
    return logits - nx.logsumexp(logits, "classes")


def _mlp_xmapped():
    return nx.xmap(_mlp_predict,
                   in_axes=(["inputs", "hidden", ...], ["hidden", "classes", ...],
                            ["batch", "inputs", ...]),
                   out_axes=["batch", "classes", ...])


def _mlp_grad(w1, w2, images):
    return jax.grad(lambda w1, w2: _mlp_xmapped()(w1, w2, images).astype(jnp.float32).mean(),
                    argnums=(0, 1))(w1, w2)


def _program_case(name: str, scale: int) -> GpuCase:
    dtype = DTYPES[name.split("_")[-1]]
    square = _dims("4096x4096", scale)
    sized = re.search(r"_(\d+x\d+)_", name)
    dims = _dims(sized.group(1), scale) if sized else square
    note = "" if sized else "reconstructed: 4096^2 operands"
    parts = name.split("_")
    if parts[0] in REDUCE_AXES and parts[1] in REDUCERS:
        op, axes = REDUCERS[parts[1]], REDUCE_AXES[parts[0]]
        return GpuCase(name, "programs", lambda x: op(x, axes) * 2, ((dims, dtype),),
                       note + "; an epilogue (x2)")
    if name.startswith("sum_exp_mul_rows"):
        return GpuCase(name, "programs", lambda v, w: nx.sum(jnp.exp(v) * w, 1),
                       ((dims, dtype), (dims, dtype)), note + "; a fused producer",
                       feeds_table=False)
    if name.startswith("gelu_matmul_bias"):
        n = square[0]
        return GpuCase(name, "programs", lambda a, b, c: jax.nn.gelu(nx.einsum("ij,jk->ik", a, b) + c),
                       (((n, n), dtype), ((n, n), dtype), ((n,), dtype)), note)
    if name.startswith("mlp_xmap"):
        m = {k: max(8, v // scale) for k, v in MLP.items()}
        shapes = (((m["inputs"], m["hidden"]), dtype), ((m["hidden"], m["classes"]), dtype),
                  ((m["batch"], m["inputs"]), dtype))
        fn = _mlp_grad if "grad" in name else (lambda *a: _mlp_xmapped()(*a))
        return GpuCase(name, "programs", fn, shapes, f"reconstructed: MLP {MLP}")
    case = _kernel_case(name, scale)    # matmuls as in the kernels section
    return dataclasses.replace(case, section="programs")


PROGRAM_NAMES = (
    "rows_sum_f32", "cols_sum_f32", "all_sum_f32", "rows_lse_f32", "rows_sum_bf16",
    "cols_sum_bf16", "all_sum_bf16", "rows_lse_bf16", "rows_lse_16384x4096_bf16",
    "sum_exp_mul_rows_bf16", "matmul_4096_bf16", "gelu_matmul_bias_bf16",
    "grad_matmul_4096_bf16", "skinny_8x4096x4096_bf16", "skinny_128x4096x4096_bf16",
    "mlp_xmap_fwd_bf16", "mlp_xmap_grad_bf16")


# --- the fused cross-entropy and the unfused program it replaces ----------------
# Forward + backward (value_and_grad by h and w) at a Llama-3 vocabulary; the
# summary gives fused / unfused, both under the same backend (goal: <= 1.0).

XENT = dict(tokens=8192, hidden=2048, vocab=128256)
XENT_NAMES = ("xent_fused_grad_bf16", "xent_unfused_grad_bf16")
# The stored backward (the gradients made in the forward pass): under the
# pallas backend its softmax is the kernel's, between XLA's matmuls.
XENT_STORED = "xent_fused_stored_grad_bf16"


def fused_loss(h, w, labels):
    """The mean of ``nx.cross_entropy`` over the tokens."""
    return jnp.mean(nx.cross_entropy(h, w, labels, hidden=1, vocab=1))


def fused_stored_loss(h, w, labels):
    """``fused_loss`` with the gradients made in the forward pass."""
    return jnp.mean(nx.cross_entropy(h, w, labels, hidden=1, vocab=1, backward="in_forward"))


def unfused_loss(h, w, labels):
    """The same loss as it is written without the fused op: the logits held."""
    logits = nx.einsum("th,hv->tv", h, w)
    picked = jnp.take_along_axis(logits, labels[:, None], 1)[:, 0]
    return jnp.mean(nx.logsumexp(logits, 1).astype(jnp.float32) - picked.astype(jnp.float32))


def _xent_case(name: str, scale: int) -> GpuCase:
    t, h, v = (max(8, XENT[k] // scale) for k in ("tokens", "hidden", "vocab"))
    loss = {XENT_STORED: fused_stored_loss, XENT_NAMES[0]: fused_loss}.get(name, unfused_loss)

    def step(hidden, w):   # labels made in the program: GpuCase draws float operands
        labels = (jnp.arange(t, dtype=jnp.int32) * 7919) % v
        return jax.value_and_grad(loss, argnums=(0, 1))(hidden, w, labels)
    return GpuCase(name, "cross_entropy", step, (((t, h), jnp.bfloat16), ((h, v), jnp.bfloat16)),
                   f"tokens x hidden x vocab {t}x{h}x{v}", feeds_table=False)


# --- attention: nx.attention, forward and value_and_grad -------------------------
# attn_{causal,full}_{fwd,grad}_HxTxD_dtype: H heads of T tokens, head dim D,
# positional (q, k, v [H, T, D]). The forward without the logsumexp is the
# call cuDNN may take (not causal); value_and_grad times the forward and the
# backward kernels together (one table entry decides both).

ATTENTION_NAMES = ("attn_causal_fwd_16x8192x128_bf16", "attn_causal_grad_16x8192x128_bf16",
                   "attn_full_fwd_16x4096x128_bf16")


def _attention_case(name: str, scale: int) -> GpuCase:
    _, mask, mode, size, dt = name.split("_")
    shape = _dims(size, scale)
    causal = mask == "causal"

    def attend(q, k, v):
        return nx.attention(q, k, v, seq=1, q_seq=1, causal=causal)

    def value_and_grad(q, k, v):
        return jax.value_and_grad(lambda *a: jnp.sum(attend(*a).astype(jnp.float32) ** 2),
                                  argnums=(0, 1, 2))(q, k, v)
    return GpuCase(name, "attention", value_and_grad if mode == "grad" else attend,
                   ((shape, DTYPES[dt]),) * 3, "heads x tokens x head dim")


def case(section: str, name: str, scale: int = 1) -> GpuCase:
    """The case a run's line names."""
    build = {"kernels": _kernel_case, "programs": _program_case, "cross_entropy": _xent_case,
             "attention": _attention_case}
    return build[section](name, scale)


def all_cases(scale: int = 1) -> list[GpuCase]:
    # Attention first: no GPU has measured its kernels yet, and a run cut
    # at its time limit keeps the cases it finished.
    return ([case("attention", n, scale) for n in ATTENTION_NAMES]
            + [case("kernels", n, scale) for n in KERNEL_NAMES]
            + [case("programs", n, scale) for n in PROGRAM_NAMES]
            + [case("cross_entropy", n, scale) for n in (*XENT_NAMES, XENT_STORED)])
