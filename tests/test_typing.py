"""A user's mypy run checks their calls to nxops: the package ships
``py.typed`` and its public API is annotated. mypy reads nxops as it reads an
installed typed package: its own modules are analysed, their errors not shown."""
import pathlib
import re
import textwrap
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

USER_PROGRAM = textwrap.dedent("""
    import jax
    import jax.numpy as jnp
    import nxops as nx

    def named_loss(x: jax.Array, w: jax.Array) -> jax.Array:
        logits = nx.einsum('<inputs>,<inputs>c->c', x, w)
        return nx.pmean(nx.logsumexp(logits, 0) - logits[0], 'batch')

    loss = nx.xmap(named_loss, in_axes=[['batch', 'inputs'], ['inputs', ...]], out_axes=[...],
                   axis_resources={'batch': 'x', 'hidden': ('y', nx.SerialLoop(2))})
    rules = nx.xmap(named_loss, [...], [...], axis_resources=[('batch', 'x'), ('heads', None)])
    lowered: jax.stages.Lowered = loss.lower(jnp.ones((8, 5)), jnp.ones((5, 3)))
    total: jax.Array = nx.sum(jnp.ones(3), ('batch', 0))
    with nx.kernels.use('pallas'), nx.axis_rules([('batch', 'x')]):
        pass
    reveal_type(loss)
    reveal_type(nx.sum)
    """)

# Each line is a wrong call that mypy must report, with what it must say.
WRONG_CALLS = {
    "nx.sum(jnp.ones(3), axis=0.5)": 'Argument "axis" to "sum" has incompatible type "float"',
    "nx.xmap(lambda x: x, [...], [...], axis_sizes={'a': '3'})": 'expected "str": "int"',
    "nx.tile(jnp.ones(4), {'a': 'x'})": 'expected "str": "int"',
    "nx.einsum(3, jnp.ones(3))": 'Argument 1 to "einsum" has incompatible type "int"',
    "nx.kernels.use(2)": 'Argument 1 to "use" has incompatible type "int"',
}


def run_mypy(tmp_path, program: str) -> tuple[str, int]:
    api = pytest.importorskip("mypy.api", reason="needs the test extra: pip install -e '.[test]'")
    source = tmp_path / "user_program.py"
    source.write_text(program)
    # MYPYPATH: nxops from this checkout, whether or not (or how) it is installed.
    # follow_imports=silent: as for an installed typed package, nxops' own
    # modules are analysed but their errors are not the user's.
    # JAX and NumPy are skipped (their types become Any): analysing them takes
    # most of a minute, and the checks here are of nxops' own parameter types.
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\nfollow_imports = silent\n"
                      "[mypy-jax.*,jaxlib.*,numpy.*,ml_dtypes.*,opt_einsum.*]\n"
                      "follow_imports = skip\n")
    out, err, status = api.run([str(source), "--no-error-summary", f"--config-file={config}",
                                f"--cache-dir={tmp_path / 'cache'}"])
    return out + err, status


def test_package_ships_py_typed():
    assert (ROOT / "nxops" / "py.typed").is_file()
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["nxops"]
    assert "py.typed" in package_data


def test_mypy_checks_a_user_program_against_nxops_types(tmp_path, monkeypatch):
    monkeypatch.setenv("MYPYPATH", str(ROOT))
    wrong = "\n".join(WRONG_CALLS)
    report, status = run_mypy(tmp_path, USER_PROGRAM + wrong + "\n")
    lines = report.splitlines()
    first_wrong = len(USER_PROGRAM.splitlines()) + 1
    errors_in_good_part = [l for l in lines if re.search(r":(\d+): error", l)
                           and int(re.search(r":(\d+):", l).group(1)) < first_wrong]
    assert not errors_in_good_part, report
    assert 'Revealed type is "nxops.xmap._xmap.XmapFunction"' in report, report
    assert re.search(r'Revealed type is "def \(x: .*axis: str \| int \| typing.Sequence\[str \| int\]'
                     r'\) -> ', report), report
    for offset, (call, message) in enumerate(WRONG_CALLS.items()):
        at_line = [l for l in lines if f":{first_wrong + offset}: error" in l]
        assert any(message in l for l in at_line), f"{call}: {at_line or report}"
    assert status == 1
