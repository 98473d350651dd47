"""`auto` for nx.attention on cuda follows the measured table like every other
op: a table (this machine's, NXOPS_MEASURED_DIR) with the Pallas kernel at
most 0.95x XLA's time makes it the pick; slower, or no entry (the shipped
table has none: no GPU has measured it), keeps XLA's reference."""
import json

import jax
import jax.numpy as jnp
import pytest

import nxops as nx
from nxops.kernels import _measured, _registry
from nxops.kernels._choice import choose
from nxops.kernels._selection import parse_selection

S = jax.ShapeDtypeStruct
Q = S((16, 1024, 64), jnp.bfloat16)   # 16 heads of 1024 tokens


def attend(q, k, v):
    return nx.attention(q, k, v, seq=1, q_seq=1, causal=True)


def _choice():
    (report,) = nx.kernels.explain(attend, Q, Q, Q, platform="cuda").reports
    return report.choice


def _write_table(directory, case_key, ratio):
    pallas = _registry.lookup("attention", "pallas")
    entry = {"key": case_key, "backends": {"pallas": {
        "ratio": ratio, "kernel_us": 100.0 * ratio, "xla_us": 100.0,
        "version": _measured.kernel_version(pallas), "device": "NVIDIA H200",
        "date": "2026-11-29", "cases": ["attention/causal_bf16"]}}}
    (directory / "sm_90.json").write_text(json.dumps(
        {"arch": "sm_90", "format": _measured.FORMAT, "entries": [entry]}))
    _measured.load.cache_clear()


def test_without_a_measured_entry_auto_keeps_the_reference():
    choice = _choice()
    assert choice.case.startswith("attention/causal/-/bfloat16/"), choice.case
    assert choice.case not in _measured.load("sm_90")
    assert choice.kernel.backend == "xla", choice.describe()


@pytest.mark.parametrize("ratio, picked", [(0.6, "pallas"), (1.3, "xla")])
def test_auto_follows_the_measured_table(tmp_path, nxops_config, ratio, picked):
    case_key = _choice().case
    _write_table(tmp_path, case_key, ratio)
    nxops_config("MEASURED_DIR", str(tmp_path))
    try:
        choice = _choice()
    finally:
        _measured.load.cache_clear()
    assert choice.kernel.backend == picked, choice.describe()
    assert f"pallas {ratio:.2f}x XLA" in choice.describe()


def test_one_entry_decides_the_forward_and_the_backward(tmp_path, nxops_config):
    step = jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    _write_table(tmp_path, _choice().case, 0.6)
    nxops_config("MEASURED_DIR", str(tmp_path))
    try:
        reports = nx.kernels.explain(step, Q, Q, Q, platform="cuda").reports
    finally:
        _measured.load.cache_clear()
    assert {(r.op, r.choice.kernel.backend) for r in reports} == {
        ("attention", "pallas"), ("attention_backward", "pallas")}
    assert len({r.choice.case for r in reports}) == 1


# --- cuDNN: which calls its documented constraints let it take ------------------

from nxops.kernels.cudnn import attention as cudnn_attention

I32 = jnp.int32


def _cudnn_reasons(dtype=jnp.bfloat16, d=64, e=None, bias=False, **params):
    q = S((4, 100, d), dtype)
    v = S((4, 90, e or d), dtype)
    extra = (S((1, 100, 90), jnp.float32),) if bias else ()
    params = dict(dict(platform="cuda", causal=False, need_lse=False), **params)
    return " ".join(cudnn_attention.not_supported_reasons(
        q, S((4, 90, d), dtype), v, S((4, 100), I32), S((4, 90), I32), *extra, **params))


@pytest.mark.parametrize("dtype, d", [(jnp.bfloat16, 64), (jnp.float16, 128),
                                      (jnp.bfloat16, 256), (jnp.bfloat16, 72)])
def test_cudnn_takes_half_precision_heads_up_to_256_in_multiples_of_8(dtype, d):
    assert _cudnn_reasons(dtype, d) == ""


@pytest.mark.parametrize("case, words", [
    (dict(dtype=jnp.float32), "dtype float32"),
    (dict(d=264), "head dim 264"),
    (dict(d=60), "head dim 60"),
    (dict(d=64, e=128), "differs"),
    (dict(need_lse=True), "logsumexp is read"),
    (dict(causal=True), "positions given as arrays"),
    (dict(causal=True, positions="iota"), "as many queries as keys"),
    (dict(bias=True), "a bias or mask"),
    (dict(platform="cpu"), "not cpu"),
])
def test_cudnn_declines_what_its_constraints_exclude(case, words):
    assert words in _cudnn_reasons(**case)


def test_cudnn_takes_causal_where_the_positions_are_known_to_be_0_to_t():
    q = S((4, 96, 64), jnp.bfloat16)
    positions = (S((4, 96), I32), S((4, 96), I32))
    reasons = cudnn_attention.not_supported_reasons(
        q, q, q, *positions, platform="cuda", causal=True, need_lse=False, positions="iota")
    assert reasons == []


def _chosen(fn, selection="attention=cudnn", args=(Q, Q, Q)):
    """The kernel the registry picks on cuda for the attention primitive that
    ``fn`` binds, with the parameters it binds (lowering for cuda needs cuDNN,
    which this machine lacks: the pick is asked for directly)."""
    eqns = [e for e in _equations(jax.make_jaxpr(fn)(*args).jaxpr)
            if e.primitive.name == "nx_attention"]
    (eqn,) = eqns
    params = {k: v for k, v in eqn.params.items() if k != "kernels"}
    return choose("attention", "cuda", parse_selection(selection),
                          [x.aval for x in eqn.invars], False, None, **params)


def test_nx_attention_lets_cudnn_take_only_calls_that_never_read_the_logsumexp():
    assert _chosen(lambda q, k, v: nx.attention(q, k, v, seq=1)).kernel.backend == "cudnn"
    with pytest.raises(nx.NxopsError, match="logsumexp is read"):
        _chosen(lambda q, k, v: nx.attention(q, k, v, seq=1, return_lse=True))
    # under auto (no GPU measured it) the reference, with cuDNN's reasons
    choice = _chosen(lambda q, k, v: nx.attention(q, k, v, seq=1), "auto")
    assert choice.kernel.backend == "xla", choice.describe()


def _equations(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in it (an xmap's body)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for v in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(v, "jaxpr", v)   # a ClosedJaxpr's, or a Jaxpr
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def test_causal_unmapped_attention_takes_cudnn():
    causal = lambda q, k, v: nx.attention(q, k, v, seq=1, q_seq=1, causal=True)
    assert _chosen(causal).kernel.backend == "cudnn"
    # under auto (no GPU measured it) the reference
    assert _chosen(causal, "auto").kernel.backend == "xla"


@pytest.mark.parametrize("call, args", [
    # stored in a zig-zag: stored position i is not global position i
    (lambda q, k, v: nx.attention(q, k, v, seq=1, q_seq=1, causal=True,
                                  sequence_layout=nx.SequenceLayout("zigzag", shards=2)),
     (Q, Q, Q)),
    # a named sequence (positions from nx.axis_index), as a ring's or a SerialLoop's
    (nx.xmap(lambda q, k, v: nx.attention(q, k, v, seq="s", q_seq="qs", causal=True),
             [["h", "qs", None], ["h", "s", None], ["h", "s", None]], ["h", "qs", None]),
     (Q, Q, Q)),
    # grouped-query attention: a group's query heads fold into rows that repeat positions
    (lambda q, k, v: nx.attention(q, k, v, seq=1, q_seq=2, causal=True),
     (S((4, 4, 1024, 64), jnp.bfloat16), S((4, 1024, 64), jnp.bfloat16),
      S((4, 1024, 64), jnp.bfloat16))),
], ids=["sequence_layout", "named_sequence", "gqa"])
def test_causal_with_positions_it_cannot_know_refuses_cudnn_with_the_reason(call, args):
    with pytest.raises(nx.NxopsError, match="positions given as arrays"):
        _chosen(call, args=args)


def test_a_differentiated_call_reads_the_logsumexp():
    def grad(q, k, v):
        return jax.grad(lambda q: nx.attention(q, k, v, seq=1).astype(jnp.float32).sum())(q)
    eqns = [e for e in jax.make_jaxpr(grad)(Q, Q, Q).jaxpr.eqns
            if e.primitive.name == "nx_attention"]
    assert eqns and all(e.params["need_lse"] for e in eqns)


def test_a_gpu_run_of_attention_cases_feeds_the_table_for_pallas_and_cudnn():
    # What `python -m nxops.measure` writes from a GPU run's lines (times
    # invented here; the ratios are what the table keeps).
    from nxops.measure import _cases, _table
    line = dict(run="r", section="attention", device="NVIDIA H200", compute_capability=90,
                correct=True)
    lines = [dict(line, case="attn_full_fwd_16x4096x128_bf16", backend=b, kern_us=us)
             for b, us in (("xla", 100.0), ("pallas", 80.0), ("cudnn", 50.0))]
    lines += [dict(line, case="attn_causal_grad_16x8192x128_bf16", backend=b, kern_us=us)
              for b, us in (("xla", 400.0), ("pallas", 500.0))]
    (entries,) = (t["entries"] for t in _table.build_tables(lines, "2026-11-29").values())
    by_key = {e["key"]: {b: m["ratio"] for b, m in e["backends"].items()} for e in entries}
    (full,) = _table.case_keys(_cases.case("attention", "attn_full_fwd_16x4096x128_bf16"))
    (causal,) = _table.case_keys(_cases.case("attention", "attn_causal_grad_16x8192x128_bf16"))
    assert by_key == {full: {"pallas": 0.8, "cudnn": 0.5}, causal: {"pallas": 1.25}}


# --- TPU: JAX's Pallas TPU flash attention, chosen by `auto` only from a TPU's table

import types

from nxops.kernels import _tpu_target

TPU_Q = S((16, 1024, 128), jnp.bfloat16)


@pytest.fixture
def building_for_v5e():
    """Lowerings see a v5e as their target, as a deviceless compile's devices say."""
    token = _tpu_target.set_kind([types.SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")])
    yield
    _tpu_target.reset(token)


def _tpu_reports(fn=attend):
    return nx.kernels.explain(fn, TPU_Q, TPU_Q, TPU_Q, platform="tpu").reports


def _write_tpu_table(directory, case_key, ratio):
    pallas = _registry.lookup("attention", "pallas")
    entry = {"key": case_key, "backends": {"pallas": {
        "ratio": ratio, "kernel_us": 100.0 * ratio, "xla_us": 100.0,
        "version": _measured.kernel_version(pallas), "device": "TPU v5 lite",
        "date": "2026-11-29", "cases": ["attention/causal_bf16"]}}}
    (directory / f"{_measured.tpu_table_name('v5e')}.json").write_text(json.dumps(
        {"arch": "tpu_v5e", "format": _measured.FORMAT, "entries": [entry]}))
    _measured.load.cache_clear()


def test_auto_keeps_xla_on_tpu_without_a_measured_table(building_for_v5e):
    (report,) = _tpu_reports()
    assert report.choice.kernel.backend == "xla", report.choice.describe()
    assert "nothing measured on tpu" in report.choice.describe()


@pytest.mark.parametrize("ratio, picked", [(0.6, "pallas"), (1.3, "xla")])
def test_auto_on_tpu_follows_the_generations_measured_table(tmp_path, nxops_config,
                                                            building_for_v5e, ratio, picked):
    (report,) = _tpu_reports()
    _write_tpu_table(tmp_path, report.choice.case, ratio)
    nxops_config("MEASURED_DIR", str(tmp_path))
    step = jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    try:
        reports = _tpu_reports(step)
    finally:
        _measured.load.cache_clear()
    # one entry decides the forward and its backward
    assert {(r.op, r.choice.kernel.backend) for r in reports} == {
        ("attention", picked), ("attention_backward", picked)}
    assert f"pallas {ratio:.2f}x XLA" in reports[0].choice.describe()
