"""``nx.hlo``: the collectives of compiled programs and their per-device bytes,
on XLA's own collectives over the 8 simulated CPU devices and on hand-written
HLO in the forms other backends print (async pairs, iota replica groups)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, PartitionSpec as P

import nxops as nx
from nxops import hlo


def mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape))


def sharded(global_shape, m, spec, dtype=jnp.float32):
    x = jnp.arange(np.prod(global_shape), dtype=dtype).reshape(global_shape)
    return jax.device_put(x, jax.NamedSharding(m, spec))


def traffic(body, x, m, spec):
    fn = jax.shard_map(body, mesh=m, in_specs=spec, out_specs=spec, check_vma=False)
    return hlo.collective_traffic(fn, x)


# ---------------------------------------------------------------------------
# XLA's collectives, compiled for 8 devices


@pytest.mark.parametrize("body,kind,buffer_factor,bytes_factor", [
    # shard = 16 x 4 f32 = 256 bytes; N = full buffer
    (lambda s: lax.all_gather(s, "x", axis=0, tiled=True), "all-gather", 8, 7),
    (lambda s: lax.all_gather(s, "x", axis=1, tiled=False), "all-gather", 8, 7),
    (lambda s: lax.psum_scatter(s, "x", scatter_dimension=0, tiled=True), "reduce-scatter", 1, 7 / 8),
    (lambda s: lax.psum(s, "x"), "all-reduce", 1, 2 * 7 / 8),
    (lambda s: lax.all_to_all(s, "x", 0, 0, tiled=True), "all-to-all", 1, 7 / 8),
    (lambda s: lax.ppermute(s, "x", [(i, (i + 1) % 8) for i in range(8)]), "collective-permute", 1, 1),
])
def test_xla_collectives_over_8_devices(body, kind, buffer_factor, bytes_factor):
    m = mesh((8,), ("x",))
    (c,) = traffic(body, sharded((128, 4), m, P("x")), m, P("x"))
    shard_bytes = 16 * 4 * 4
    assert (c.kind, c.logical_kind, c.dtype, c.group_size) == (kind, kind, "f32", 8)
    assert sum(np.prod(shape) for shape in c.operand_shapes) == 16 * 4  # may be split or reshaped
    assert c.buffer_bytes == buffer_factor * shard_bytes
    assert c.bytes_per_device == pytest.approx(bytes_factor * shard_bytes)
    assert c.ratio == 1.0


def test_group_sizes_on_a_2d_mesh():
    m = mesh((4, 2), ("x", "y"))

    def body(s):
        return (lax.all_gather(s, "y", axis=0, tiled=True),
                lax.psum_scatter(s, "x", scatter_dimension=0, tiled=True),
                lax.psum(s, ("x", "y")))

    fn = jax.shard_map(body, mesh=m, in_specs=P("x", "y"), out_specs=P("x", "y"), check_vma=False)
    found = hlo.collective_traffic(fn, sharded((32, 8), m, P("x", "y"), jnp.int32))
    by_kind = {c.kind: c for c in found}
    assert sorted(by_kind) == ["all-gather", "all-reduce", "reduce-scatter"]
    assert by_kind["all-gather"].group_size == 2
    assert by_kind["reduce-scatter"].group_size == 4
    assert by_kind["all-reduce"].group_size == 8
    shard_bytes = 8 * 4 * 4
    assert by_kind["all-gather"].bytes_per_device == shard_bytes       # (2-1) shards
    assert by_kind["reduce-scatter"].bytes_per_device == 3 / 4 * shard_bytes
    assert {c.dtype for c in found} == {"s32"}
    assert all(c.ratio == 1.0 for c in found)


def test_all_gather_as_padded_all_reduce_costs_twice_the_bound():
    """What the old xmap did for untile: psum a zero-padded buffer."""
    m = mesh((8,), ("x",))

    def untile_by_psum(s):
        with jax.named_scope("untile"):
            full = jnp.zeros((8 * s.shape[0],) + s.shape[1:], s.dtype)
            full = lax.dynamic_update_slice_in_dim(full, s, lax.axis_index("x") * s.shape[0], 0)
            return lax.psum(full, "x")

    (c,) = traffic(untile_by_psum, sharded((64, 4), m, P("x")), m, P("x"))
    assert (c.kind, c.logical_kind) == ("all-reduce", "all-gather")
    assert c.buffer_bytes == 64 * 4 * 4
    assert c.ratio == pytest.approx(2.0)


def test_collective_in_a_loop_body_is_counted_once():
    m = mesh((8,), ("x",))

    def body(s):
        return lax.fori_loop(0, 3, lambda i, v: lax.psum(v, "x") * 0.5, s)

    (c,) = traffic(body, sharded((16, 4), m, P("x")), m, P("x"))
    assert c.kind == "all-reduce" and c.group_size == 8
    assert c.computation != ""


def test_lowered_program_and_text():
    m = mesh((8,), ("x",))
    fn = jax.jit(jax.shard_map(lambda s: lax.all_gather(s, "x", tiled=True), mesh=m,
                               in_specs=P("x"), out_specs=P(), check_vma=False))
    lowered = fn.lower(sharded((16, 4), m, P("x")))
    for program in (lowered, lowered.compile(), lowered.compile().as_text()):
        (c,) = hlo.collectives(program)
        assert (c.kind, c.group_size, c.bytes_per_device) == ("all-gather", 8, 7 * 2 * 4 * 4)
    with pytest.raises(nx.NxopsError, match="StableHLO"):
        hlo.collectives(lowered.as_text())
    with pytest.raises(nx.NxopsError, match=r"nx.hlo: expected HLO text .* got <class 'int'>"):
        hlo.collectives(3)
    with pytest.raises(nx.NxopsError, match="no ENTRY computation"):
        hlo.executions("%x = f32[2] parameter(0)")
    assert "all-gather" in hlo.format_table(hlo.collectives(lowered))


# ---------------------------------------------------------------------------
# HLO in other printed forms (as GPU/TPU backends print it)

ASYNC_HLO = """\
HloModule jit_f, is_scheduled=true, entry_computation_layout={(f32[16,4]{1,0})->f32[16,4]{1,0}}, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(f32[] %a, f32[] %b)
}

%wrapped_reduce_scatter (p0: f32[16,4]) -> f32[2,4] {
  %p0 = f32[16,4]{1,0} parameter(0)
  ROOT %rs = f32[2,4]{1,0} reduce-scatter(f32[16,4]{1,0} %p0), channel_id=3, replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add, metadata={op_name="jit(f)/shard_map/reduce_scatter"}
}

ENTRY %main (param: f32[16,4]) -> f32[16,4] {
  %param = f32[16,4]{1,0} parameter(0)
  %ag-start = (f32[16,4]{1,0}, f32[64,4]{1,0}) all-gather-start(f32[16,4]{1,0} %param), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
  %ag-done = f32[64,4]{1,0} all-gather-done((f32[16,4]{1,0}, f32[64,4]{1,0}) %ag-start)
  %ar-start = (f32[16,4]{1,0}, bf16[8]{0}) all-reduce-start(f32[16,4]{1,0} %param, bf16[8]{0} %param2), channel_id=2, replica_groups={}, to_apply=%add
  %ar-done = (f32[16,4]{1,0}, bf16[8]{0}) all-reduce-done((f32[16,4]{1,0}, bf16[8]{0}) %ar-start)
  %rs-start = ((f32[16,4]{1,0}), f32[2,4]{1,0}) async-start(f32[16,4]{1,0} %param), calls=%wrapped_reduce_scatter
  %rs-done = f32[2,4]{1,0} async-done(((f32[16,4]{1,0}), f32[2,4]{1,0}) %rs-start)
  %cp-start = (f32[16,4]{1,0}, f32[16,4]{1,0}, u32[], u32[]) collective-permute-start(f32[16,4]{1,0} %param), channel_id=4, source_target_pairs={{0,1},{1,0}}
  ROOT %cp-done = f32[16,4]{1,0} collective-permute-done((f32[16,4]{1,0}, f32[16,4]{1,0}, u32[], u32[]) %cp-start)
}
"""


def test_async_pairs_iota_groups_and_called_computations():
    found = hlo.collectives(ASYNC_HLO)
    assert [c.kind for c in found] == ["reduce-scatter", "all-gather", "all-reduce",
                                       "collective-permute"]
    rs, ag, ar, cp = found
    shard = 16 * 4 * 4
    assert (rs.group_size, rs.computation, rs.buffer_bytes) == (8, "wrapped_reduce_scatter", shard)
    assert rs.bytes_per_device == 7 / 8 * shard and rs.result_shapes == ((2, 4),)
    assert (ag.group_size, ag.buffer_bytes, ag.bytes_per_device) == (4, 4 * shard, 3 * shard)
    assert ag.result_shapes == ((64, 4),)
    # replica_groups={}: all num_partitions=8 devices; two operands combined
    assert (ar.group_size, ar.buffer_bytes) == (8, shard + 8 * 2)
    assert ar.bytes_per_device == pytest.approx(2 * 7 / 8 * (shard + 16))
    assert (cp.group_size, cp.bytes_per_device) == (2, shard)
    assert all(c.ratio == 1.0 for c in found)


def test_empty_replica_groups_need_a_device_count():
    text = ASYNC_HLO.replace(", num_partitions=8", "")
    with pytest.raises(ValueError, match="num_devices"):
        hlo.collectives(text)
    ar = [c for c in hlo.collectives(text, num_devices=4) if c.kind == "all-reduce"]
    assert ar[0].group_size == 4


# JAX >= 0.11 prints replica groups by mesh axes (jax_use_rgv3), e.g. from a
# shard_map on a (4, 2) mesh compiled by JAX 0.12.0.1:
RGV3_HLO = """\
HloModule jit_f, entry_computation_layout={(f32[8,4]{1,0})->f32[8,4]{1,0}}, num_partitions=8

%region_0.0 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(f32[] %a, f32[] %b)
}

ENTRY %main (param.1: f32[2,2]) -> f32[2,2] {
  %param.1 = f32[2,2]{1,0} parameter(0)
  %psum.14 = f32[2,2]{1,0} all-reduce(%param.1), channel_id=1, replica_groups=mesh['x'=4,'y'=2] {'y'}, use_global_device_ids=true, to_apply=%region_0.0, metadata={op_name="jit(<lambda>)/shard_map/psum"}
  %psum.15 = f32[2,2]{1,0} all-reduce(%param.1), channel_id=1, replica_groups=mesh['x'=4,'y'=2] {'x'}, use_global_device_ids=true, to_apply=%region_0.0, metadata={op_name="jit(<lambda>)/shard_map/psum"}
  ROOT %all_gather.7 = f32[8,2,2]{2,1,0} all-gather(%param.1), channel_id=1, replica_groups=mesh['x'=4,'y'=2] {'x','y'}, dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(<lambda>)/shard_map/all_gather"}
}
"""


def test_replica_groups_by_mesh_axes():
    by_y, by_x, gather = hlo.collectives(RGV3_HLO)
    assert (by_y.group_size, by_x.group_size, gather.group_size) == (2, 4, 8)
    assert by_y.bytes_per_device == pytest.approx(2 * 1 / 2 * 16)


@pytest.mark.parametrize("groups", ["mesh['x'=4,'y'=2] {'z'}", "mesh['x'=4,'y'=2] {}",
                                    "mesh['x'=4] {'x':(1)2}", "<<unknown>>"])
def test_unreadable_replica_groups_raise_instead_of_guessing(groups):
    text = RGV3_HLO.replace("mesh['x'=4,'y'=2] {'y'}", groups)
    with pytest.raises(ValueError, match="cannot read the replica groups"):
        hlo.collectives(text)


def test_replica_groups_by_mesh_axes_with_device_ids():
    """A device order after the mesh (XLA prints it for a transposed mesh)."""
    text = RGV3_HLO.replace("mesh['x'=4,'y'=2] {'y'}",
                            "mesh['x'=4,'y'=2], device_ids=([2,4]T(1,0)) {'y'}")
    assert hlo.collectives(text)[0].group_size == 2


LOOP_HLO = """HloModule loops, num_partitions=2

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4]{0} get-tuple-element(%p), index=1
  %moved = f32[4]{0} collective-permute(%x), channel_id=1, source_target_pairs={{0,1},{1,0}}
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %moved)
}

%cond (p.1: (s32[], f32[4])) -> pred[] {
  %p.1 = (s32[], f32[4]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %three), direction=LT
}

ENTRY %main (a: f32[4]) -> (s32[], f32[4]) {
  %a = f32[4]{0} parameter(0)
  %zero = s32[] constant(0)
  %once = f32[4]{0} collective-permute(%a), channel_id=2, source_target_pairs={{0,1},{1,0}}
  %init = (s32[], f32[4]{0}) tuple(%zero, %once)
  ROOT %loop = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
}
"""


def test_bytes_per_device_counts_each_loop_iteration():
    assert hlo.executions(LOOP_HLO) == {"main": 1, "body": 3, "cond": 4}
    assert hlo.bytes_per_device(LOOP_HLO) == 16 + 3 * 16
    unknown = LOOP_HLO.replace(', backend_config={"known_trip_count":{"n":"3"}}', "")
    with pytest.raises(ValueError, match="trip count XLA does not know"):
        hlo.bytes_per_device(unknown)
