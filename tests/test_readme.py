"""The README's example runs and gives the value it implies (uniform logits
over 3 classes: a loss of log 3); the measured-table claims match the table."""
import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs(capsys):
    text = README.read_text()
    example = re.search(r"## A short example\s+```python\n(.*?)```", text, re.S).group(1)
    exec(compile(example, "README example", "exec"), {})
    printed = capsys.readouterr().out.strip()
    np.testing.assert_allclose(float(printed), np.log(3), rtol=1e-6)


# The measured-table claims: the README's explain example and bench/README.md's
# "what auto takes today", rendered against the shipped table. A kernel's
# version hash changes with every edit of its source: the hashes are compared
# as hashes (12 hex digits), everything else as written.
HASH = re.compile(r"\b[0-9a-f]{12}\b")


def _same_but_hashes(written: str, rendered: str) -> None:
    assert HASH.sub("<hash>", written.strip()) == HASH.sub("<hash>", rendered.strip()), rendered


def test_readme_explain_example_is_what_explain_prints_with_the_shipped_table():
    import jax
    import jax.numpy as jnp
    import nxops as nx

    block = re.search(r"```python notest\n(>>> x = jax.ShapeDtypeStruct.*?)```",
                      README.read_text(), re.S).group(1)
    code = [line[4:] for line in block.splitlines() if line.startswith(">>> ")]
    written = "\n".join(line for line in block.splitlines() if not line.startswith(">>> "))
    namespace = {"jax": jax, "jnp": jnp, "nx": nx}
    exec(code[0], namespace)
    rendered = str(eval(code[1].removeprefix("print(").removesuffix(")"), namespace))
    _same_but_hashes(written, rendered)


def test_bench_readme_says_what_auto_takes_from_the_shipped_table():
    from nxops.measure import _table

    text = (README.parent / "bench" / "README.md").read_text()
    written = re.search(r"\*\*What `auto` takes today\*\*.*?```text\n(.*?)```", text, re.S).group(1)
    _same_but_hashes(written, _table.what_auto_takes("sm_90"))
