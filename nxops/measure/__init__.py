"""Measures this machine's GPU and writes the tables `auto` reads there.

    python -m nxops.measure [--dry] [--out DIR] [--table-dir DIR] [-k TEXT]
                            [--program module:fn] [--time-limit SECONDS]
    python -m nxops.measure --from-run RUN.jsonl [--commit REV] [--table-dir DIR]

Data flows one way: the cases (``_cases``) are timed (``_timing``), the
times become a table (``_table``), and `auto` reads the table
(``nxops.kernels._measured``). The table of this GPU's architecture goes to
``NXOPS_MEASURED_DIR`` (default ``~/.cache/nxops/measured``), which `auto`
reads before the tables shipped with nxops; ``nx.kernels.explain`` names the
table that decided each case.

``--program module:fn`` adds a program of the user's: ``fn()`` returns
``(function, args)`` (arrays or ``jax.ShapeDtypeStruct``s). It is timed under
each backend like the catalogue's cases, and where its nxops ops share one
table case, its times decide that case (a program mixing cases is reported,
not tabled). ``--show`` prints what `auto` takes from this GPU's tables.
"""
from nxops.measure._cli import main

__all__ = ["main"]
