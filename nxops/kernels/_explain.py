"""``nx.kernels.explain``: which implementation each op of a program uses."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from jax.extend import core as jex_core

from nxops._platforms import normalize_platform
from nxops.kernels import _autotune
from nxops.kernels._reports import Report, collect_reports
from nxops.kernels._selection import current_selection


@dataclasses.dataclass(frozen=True)
class Explanation:
    """The kernel choices of one program, for one platform.

    Examples:
        >>> report = nx.kernels.explain(lambda v: nx.sum(v, 0), jax.ShapeDtypeStruct((8,), jnp.float32))
        >>> print(str(report).splitlines()[0])
        nxops kernels on cpu (NXOPS_KERNELS=auto):
    """

    platform: str
    selection: str
    reports: tuple[Report, ...]

    def backends(self) -> dict[str, set[str]]:
        """``{op: {backend, ...}}`` over the whole program."""
        out: dict[str, set[str]] = {}
        for r in self.reports:
            out.setdefault(r.op, set()).add(r.choice.kernel.backend)
        return out

    def __str__(self) -> str:
        head = f"nxops kernels on {self.platform} (NXOPS_KERNELS={self.selection}):"
        if not self.reports:
            return head + "\n  (no nxops kernel ops in this program)"
        table = [("op", "operands", "kernel", "why")]
        table += [(r.op, r.operands, r.choice.kernel.name, r.choice.describe()) for r in self.reports]
        # Columns as wide as their longest entry (operand lists can be long).
        widths = [max(len(row[i]) for row in table) for i in range(3)]
        rows = ["  " + " ".join([*(c.ljust(w) for c, w in zip(row, widths)), row[3]]).rstrip()
                for row in table]
        kernels = {r.choice.kernel.name: r.choice.kernel.description for r in self.reports}
        legend = [f"  {name}: {text}" for name, text in kernels.items() if text]
        return "\n".join([head, *rows, *(["kernels:", *legend] if legend else [])])


def explain(fn: Callable[..., Any], *args: Any, platform: str | None = None,
            **kwargs: Any) -> Explanation:
    """Traces and lowers ``fn(*args, **kwargs)`` for ``platform`` (default: the
    default backend) and reports the kernel chosen for each nxops op.

    Lowering for another platform works on CPU, so ``platform="cuda"`` (or
    ``"gpu"``) or ``"tpu"`` shows what would run there. Nothing is executed.

    Examples:
        >>> x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
        >>> report = nx.kernels.explain(lambda v: nx.logsumexp(v, 1), x, platform="cpu")
        >>> print(report.platform, report.backends())    # auto takes XLA on cpu
        cpu {'reduce': {'xla'}}
    """
    # JAX says "gpu" for CUDA devices (jax.default_backend()), the registry "cuda".
    platform = normalize_platform(platform or jax.default_backend(), "nx.kernels.explain")
    # Executes nothing, so no autotuning: it shows what the tables choose.
    with collect_reports(platform) as reports, _autotune.suppressed():
        closed = jax.make_jaxpr(fn)(*args, **kwargs)
        # A fresh function object, so that no cached lowering skips the rules.
        fresh = jax.jit(lambda *flat: jex_core.jaxpr_as_fun(closed)(*flat))
        flat_args = jax.tree_util.tree_leaves((args, kwargs))
        fresh.trace(*flat_args).lower(lowering_platforms=(platform,))
    return Explanation(platform, str(current_selection()), tuple(reports))
