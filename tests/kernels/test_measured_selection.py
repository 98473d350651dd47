"""`auto` on cuda chooses by what a GPU measured (nxops/kernels/measured/,
seeded from bench/gpu_runs/h200_2026-11-26.jsonl): for every case of that
run, what it picks with the kernels that run measured, and what ``explain``
says; stale entries, unknown GPUs; the kernel-version hash; opt-in
autotuning (with a fake timer: no GPU here). tests/test_measure.py checks
both outcomes against a fresh table."""
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nxops as nx
from nxops.measure import _cases as gpu_cases
from nxops.measure import _table as measured_table
from nxops.kernels import _autotune, _gpu_target, _measured, _reports
from tests._extras import missing_extra

RUN = pathlib.Path(__file__).resolve().parents[2] / "bench" / "gpu_runs" / "h200_2026-11-26.jsonl"
LINES = [json.loads(line) for line in RUN.read_text().splitlines()]
CASES = sorted({(line["section"], line["case"]) for line in LINES})

# Every kernel `auto` takes on cuda with the kernels the run measured, per
# case of the run (the ratio it quotes is read from the table); everything
# else keeps XLA.
PICKS = {
    ("kernels", "rows_lse_16384x8192_f32"): "triton",
    ("kernels", "rows_lse_4096x4096_f32"): "triton",
    ("programs", "rows_lse_f32"): "triton",
    ("kernels", "cols_lse_4096x4096_f32"): "pallas",
    ("kernels", "cols_lse_4096x4096_bf16"): "pallas",
    ("kernels", "cols_sum_4096x4096_bf16"): "pallas",
    ("programs", "cols_sum_bf16"): "pallas",
    ("kernels", "odd_1000x3000x500_bf16"): "triton",
}


def _own_ratio(section, name, backend):
    """backend / xla kernel time in the run's own line for this case (None: not run)."""
    by = {(l["run"], l["backend"]): l["kern_us"] for l in LINES
          if (l["section"], l["case"]) == (section, name)}
    runs = [run for run, b in by if b == backend]
    return by[(runs[0], backend)] / by[(runs[0], "xla")] if runs else None


def _explain(section, name):
    case = gpu_cases.case(section, name)
    return nx.kernels.explain(case.fn, *case.args(), platform="cuda")


@pytest.mark.parametrize("section, name", CASES, ids=[f"{s}/{n}" for s, n in CASES])
def test_auto_on_cuda_picks_only_kernels_measured_at_most_095_of_xla(section, name,
                                                                     measured_kernels):
    pick = PICKS.get((section, name))
    if pick == "triton" and (reason := missing_extra("triton", "triton", "jax_triton")):
        pytest.skip(reason)   # auto cannot take a kernel that is not installed
    explanation = _explain(section, name)
    assert explanation.reports, name
    table = _measured.load("sm_90")
    for report in explanation.reports:
        why = report.choice.describe()
        backend = report.choice.kernel.backend
        if pick and report.op in ("reduce", "dot_general"):
            assert backend == pick, why
            measured = table[report.choice.case][pick]
            assert f"measured {measured.quote()}" in why and "table shipped" in why
            assert measured.ratio <= _measured.THRESHOLD and measured.device == "NVIDIA H200"
            own = _own_ratio(section, name, pick)   # the run itself says it won
            assert own is None or own <= measured.ratio + 0.005, (own, why)
        else:
            assert backend == "xla", why
            # why: every fresh kernel measured slower than 0.95x, or nothing measured
            quoted = [float(w.split("x XLA")[0].rsplit(" ", 1)[1]) for w in why.split("measured ")[1:]
                      if "x XLA" in w.split(";")[0]]
            assert all(r > _measured.THRESHOLD for r in quoted), why
            assert quoted or "unmeasured on sm_90" in why, why


def test_every_run_case_is_in_the_catalogue_and_each_kernel_has_one_version():
    catalogue = {(c.section, c.name) for c in gpu_cases.all_cases()}
    # the run's cases, the fused cross-entropy cases and attention's, measured
    # from the next run on
    assert catalogue - set(CASES) == \
        {("cross_entropy", n) for n in (*gpu_cases.XENT_NAMES, gpu_cases.XENT_STORED)} | \
        {("attention", n) for n in gpu_cases.ATTENTION_NAMES}
    assert set(CASES) <= catalogue
    table = _measured.load("sm_90")
    assert len(table) >= 25
    versions = {}
    for key, measured in table.items():
        for m in measured.values():
            assert versions.setdefault((key.split("/")[0], m.backend), m.version) == m.version


def test_an_edited_kernel_makes_only_its_own_entries_stale(monkeypatch, measured_kernels):
    if reason := missing_extra("triton", "triton", "jax_triton"):
        pytest.skip(reason)   # the case falls back to the measured triton kernel
    x = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    fn = lambda x: nx.logsumexp(x, 0)
    assert "pallas" in str(nx.kernels.explain(fn, x, platform="cuda").reports[0].choice.kernel.name)
    measured = _measured.kernel_version
    monkeypatch.setattr(_measured, "kernel_version",
                        lambda k: "edited" if k.backend == "pallas" else measured(k))
    choice = nx.kernels.explain(fn, x, platform="cuda").reports[0].choice
    assert choice.kernel.backend == "triton" and "triton 0.74x XLA" in choice.describe()
    # and where only pallas had won, the case goes back to XLA, saying why
    bf16 = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    choice = nx.kernels.explain(fn, bf16, platform="cuda").reports[0].choice
    assert choice.kernel.backend == "xla"
    assert "pallas stale since 2026-11-26 (kernel 01667e6e07ab measured, now edited; table shipped)" \
        in choice.describe()


def test_a_gpu_without_a_table_keeps_xla(monkeypatch, measured_kernels):
    x = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    monkeypatch.setattr(_gpu_target, "compute_capability", lambda: 80)   # an A100
    choice = nx.kernels.explain(lambda x: nx.logsumexp(x, 0), x, platform="cuda").reports[0].choice
    assert choice.kernel.backend == "xla" and "no measured table for sm_80" in choice.describe()


def test_an_operand_xla_fuses_keeps_xla_even_where_the_kernel_won(measured_kernels):
    x = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    choice = nx.kernels.explain(lambda x: nx.logsumexp(jnp.exp(x), 0), x,
                                platform="cuda").reports[0].choice
    assert choice.kernel.backend == "xla" and "stablehlo.exponential" in choice.describe()


def test_a_kernel_version_covers_the_files_it_imports_and_nothing_else():
    sources = {
        "nxops.kernels.pallas.reduce": "from nxops.kernels.pallas import _lse\n",
        "nxops.kernels.pallas._lse": "ONE_PASS = False\n",
        "nxops.kernels.triton.reduce": "from nxops.kernels._registry import Kernel\n",
        "nxops.kernels._registry": "SELECTION = 1\n",
    }
    version = lambda m, s: _measured.version_of_module(m, s.get)
    before = {m: version(m, sources) for m in ("nxops.kernels.pallas.reduce",
                                               "nxops.kernels.triton.reduce")}
    edited = dict(sources, **{"nxops.kernels.pallas._lse": "ONE_PASS = True\n"})
    assert version("nxops.kernels.pallas.reduce", edited) != before["nxops.kernels.pallas.reduce"]
    assert version("nxops.kernels.triton.reduce", edited) == before["nxops.kernels.triton.reduce"]
    # the selection machinery is not kernel code
    edited = dict(sources, **{"nxops.kernels._registry": "SELECTION = 2\n"})
    assert version("nxops.kernels.triton.reduce", edited) == before["nxops.kernels.triton.reduce"]


def _without_versions(table):
    for entry in table["entries"]:
        for m in entry["backends"].values():
            m.pop("version")
    return table


def test_the_converter_rebuilds_the_shipped_table(tmp_path, measured_kernels):
    tables = measured_table.build_tables(LINES, "2026-11-26")
    measured_table.write_tables(tables, tmp_path)
    shipped = json.loads((_measured.TABLE_DIR / "sm_90.json").read_text())
    # (the versions: of the working tree here, of ed145d9 in the shipped table)
    assert _without_versions(json.loads((tmp_path / "sm_90.json").read_text())) == \
        _without_versions(shipped)


# --- NXOPS_AUTOTUNE ------------------------------------------------------------------

AVAL = jax.ShapeDtypeStruct((64, 32), jnp.float32)
PARAMS = dict(axes=(1,), op="logsumexp")


def test_autotune_keeps_a_kernel_only_at_095_of_xla_and_caches_the_winner(tmp_path, nxops_config):
    nxops_config("AUTOTUNE_CACHE", str(tmp_path))
    assert _autotune.decide({"xla": 1.0, "pallas": 0.95, "triton": 0.97}) == "pallas"
    assert _autotune.decide({"xla": 1.0, "pallas": 0.96}) == "xla"
    timed = []

    def timer(op, backend, avals, params):
        timed.append(backend)
        return {"xla": 2e-5, "pallas": 1e-5, "triton": 1.5e-5}[backend]

    backend, why = _autotune.winner("reduce", [AVAL], PARAMS, ["xla", "pallas", "triton"],
                                    timer, kind="NVIDIA H200")
    assert backend == "pallas" and sorted(timed) == ["pallas", "triton", "xla"]
    assert "autotuned on NVIDIA H200" in why and "pallas 10.0 us" in why
    path = _autotune.cache_path("NVIDIA H200")
    assert path.parent == tmp_path and nx.__version__ in path.name
    # later lowerings read the cache; another GPU kind times anew
    assert _autotune.winner("reduce", [AVAL], PARAMS, ["xla", "pallas", "triton"],
                            lambda *a: pytest.fail("timed again"), kind="NVIDIA H200")[0] == "pallas"
    assert _autotune.winner("reduce", [AVAL], PARAMS, ["xla", "pallas"], timer,
                            kind="NVIDIA H100")[0] == "pallas"
    assert timed[3:] == ["xla", "pallas"]


def _fn(x):
    return nx.logsumexp(x, 1)


@pytest.fixture
def autotune_with_a_fake_gpu(tmp_path, monkeypatch, nxops_config):
    """NXOPS_AUTOTUNE on, the lowering's devices taken for a local GPU, a fake timer."""
    nxops_config("AUTOTUNE", "1")
    nxops_config("AUTOTUNE_CACHE", str(tmp_path))
    timed = []

    def timer(op, backend, avals, params):
        timed.append(backend)
        return {"xla": 3e-5, "pallas": 1e-5, "triton": 2e-5}[backend]

    monkeypatch.setattr(_autotune, "time_on_device", timer)
    return timed


def test_autotune_runs_only_for_a_real_local_gpu(autotune_with_a_fake_gpu, monkeypatch):
    x = np.ones((64, 32), np.float32)
    lower = lambda: jax.jit(_fn).trace(x).lower(lowering_platforms=("cuda",))
    assert not _autotune._is_local_gpu(jax.devices("cpu")[0])
    monkeypatch.setattr(_autotune, "_is_local_gpu", lambda device: False)
    with _reports.collect_reports() as deviceless:
        lower()   # a deviceless lowering (this machine's devices are no GPU)
    assert autotune_with_a_fake_gpu == [] and deviceless[0].choice.kernel.backend == "xla"
    monkeypatch.setattr(_autotune, "_is_local_gpu", lambda device: True)
    with _reports.collect_reports() as on_gpu:
        lower()
    assert on_gpu[0].choice.kernel.backend == "pallas" and "autotuned" in on_gpu[0].choice.why
    timed = list(autotune_with_a_fake_gpu)   # each backend that can run, once (triton if installed)
    assert {"xla", "pallas"} <= set(timed) <= {"xla", "pallas", "triton"}
    assert len(timed) == len(set(timed))
    with _reports.collect_reports() as again:
        jax.jit(lambda v: _fn(v)).trace(x).lower(lowering_platforms=("cuda",))
    assert again[0].choice.kernel.backend == "pallas" and autotune_with_a_fake_gpu == timed


def test_autotune_never_runs_in_explain_or_export(autotune_with_a_fake_gpu, monkeypatch):
    monkeypatch.setattr(_autotune, "_is_local_gpu", lambda device: True)
    x = np.ones((64, 32), np.float32)
    assert nx.kernels.explain(_fn, x, platform="cuda").backends() == {"reduce": {"xla"}}
    nx.export(_fn, x, platforms=["cuda"])
    assert autotune_with_a_fake_gpu == []
