"""Errors a new user meets first name the fix in the user's terms:
no internal axis names, no JAX tracer classes, install commands that work."""
import re
import shlex

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nxops as nx
from nxops._install import install_command


def test_typo_in_an_axis_name_lists_only_names_the_user_can_use():
    f = nx.xmap(lambda x: nx.sum(x, 'hiden'), in_axes=[['batch', 'hidden', ...]],
                out_axes=['batch', ...], axis_resources={'batch': 'data'})
    with jax.set_mesh(jax.make_mesh((4, 2), ('data', 'model'))):
        with pytest.raises(nx.NxopsError) as info:
            np.asarray(f(jnp.ones((8, 4))))
    message = str(info.value)
    assert "bound names: batch, data, hidden)" in message, message
    assert "Did you mean 'hidden'?" in message
    assert "#" not in message   # no physical tile names made up by nx.xmap


def test_pytree_prefix_error_describes_values_without_tracer_classes():
    f = nx.xmap(lambda x: x * 2, in_axes=[['batch', ...]],
                out_axes=(['batch', ...], ['batch', ...]))
    with pytest.raises(nx.NxopsError) as info:
        f(jnp.ones((8, 3)))
    message = str(info.value)
    assert "Tracer" not in message and "tree_map tree" not in message, message
    assert ("at the out_axes value the spec is a tuple of 2 but the value is an array of "
            "shape (3,) (float32)") in message


def test_pytree_prefix_error_names_the_key_path():
    f = nx.xmap(lambda p: p['a'], in_axes=[{'a': ['batch', ...], 'b': ['batch', ...]}],
                out_axes=['batch', ...])
    with pytest.raises(nx.NxopsError, match=re.escape(
            "at in_axes[0] the spec is a dict with keys 'a', 'b' but the value is a dict "
            "with keys 'a'")):
        f({'a': jnp.ones((8,))})


def test_kernels_use_of_a_platform_name_says_it_is_a_platform():
    with pytest.raises(nx.NxopsError) as info:
        with nx.kernels.use('cuda'):
            pass
    message = str(info.value)
    assert "nx.kernels.use('cuda')" in message and "NXOPS_KERNELS='cuda'" not in message
    assert "'cuda' is a platform, not a kernel backend" in message
    assert "nx.kernels.explain(fn, *args, platform='cuda')" in message


def _reduce_program(x):
    return jax.vmap(lambda row: nx.sum(row, 'i'), axis_name='i')(x)


def test_explain_takes_gpu_as_cuda():
    x = jnp.ones((4, 3))
    gpu = nx.kernels.explain(_reduce_program, x, platform='gpu')
    cuda = nx.kernels.explain(_reduce_program, x, platform='cuda')
    assert gpu.platform == 'cuda' and str(gpu) == str(cuda)


def test_explain_refuses_an_unknown_platform_with_the_valid_ones():
    with pytest.raises(nx.NxopsError, match="unknown platform 'metal'.*'cpu', 'cuda'"):
        nx.kernels.explain(_reduce_program, jnp.ones((4, 3)), platform='metal')


def test_explain_columns_line_up_past_40_characters():
    def program(x, y):   # an einsum whose operand list is wider than 40 characters
        return jax.vmap(lambda a, b: nx.einsum('<i>abcd,<i>abcd->abcd', a, b),
                        axis_name='i')(x, y)
    x = jnp.ones((2, 3, 4, 5, 6))
    explanation = nx.kernels.explain(program, x, x, platform='cpu')
    lines = str(explanation).splitlines()
    header, rows = lines[1], lines[2:2 + len(explanation.reports)]
    assert any(len(r.operands) > 40 for r in explanation.reports), explanation
    kernel_starts = {header.index("kernel")} | {
        row.index(r.choice.kernel.name, row.index(r.operands) + len(r.operands))
        for row, r in zip(rows, explanation.reports)}
    assert len(kernel_starts) == 1, str(explanation)


def test_install_hint_is_a_runnable_pip_command():
    words = shlex.split(install_command('triton'))
    assert words[:2] == ['pip', 'install'] and len(words) > 2
    # Either the extra's own requirements, or the checkout with the extra.
    assert all('triton' in w for w in words[2:] if w != '-e'), words


def test_export_with_a_symbolic_size_over_a_mesh_axis_suggests_a_multiple():
    f = nx.xmap(lambda x: x * 2, [['batch', ...]], ['batch', ...], axis_resources={'batch': 'x'})
    b, = jax.export.symbolic_shape("b")
    with jax.set_mesh(jax.make_mesh((8,), ('x',))):
        with pytest.raises(nx.NxopsError) as info:
            nx.export(f, jax.ShapeDtypeStruct((b, 3), jnp.float32), platforms=("cpu",))
        assert "declared as a multiple of 8" in str(info.value)
        assert "jax.export.symbolic_shape('8*b, ...')" in str(info.value)
        # The suggested declaration exports.
        shape = jax.export.symbolic_shape("8*b, 3")
        exported = nx.export(f, jax.ShapeDtypeStruct(shape, jnp.float32), platforms=("cpu",))
    assert str(exported.in_avals[0].shape) == "(8*b, 3)"


def test_a_list_of_out_axes_specs_fits_a_body_returning_a_list():
    f = nx.xmap(lambda x: [x * 2, nx.sum(x, 'batch')], in_axes=[['batch', ...]],
                out_axes=[['batch', ...], [...]])
    doubled, total = f(jnp.arange(8.))
    np.testing.assert_array_equal(np.asarray(doubled), 2 * np.arange(8.))
    np.testing.assert_array_equal(np.asarray(total), np.arange(8.).sum())


def test_misspelled_name_in_out_axes_asks_did_you_mean():
    x = jnp.ones((8, 3))
    with pytest.raises(nx.NxopsError) as info:
        nx.xmap(lambda a: a, ['batch', ...], ['btach', ...])(x)
    message = str(info.value)
    assert "did you mean 'batch' for 'btach'?" in message, message
    assert "out_axes=['btach', ...]" in message and "in_axes=['batch', ...]" in message
    assert not message.startswith("All axis names"), message   # not the axis_sizes advice first


def test_name_in_out_axes_like_no_input_still_points_at_axis_sizes():
    with pytest.raises(nx.NxopsError, match=r"missing: 'vocab' .*axis_sizes=\{name: size\}"):
        nx.xmap(lambda a: a, ['batch', ...], ['batch', 'vocab', ...])


def test_unknown_mesh_axis_in_axis_resources_under_a_mesh_lists_the_mesh_axes():
    f = nx.xmap(lambda a: a, ['batch', ...], ['batch', ...], axis_resources={'batch': 'dta'})
    with jax.set_mesh(jax.make_mesh((4, 2), ('data', 'model'))):
        with pytest.raises(nx.NxopsError) as info:
            f(jnp.ones((8, 3)))
    message = str(info.value)
    assert ("axis_resources['batch'] names 'dta', which the mesh in scope does not have "
            "(did you mean 'data'?)") in message, message
    assert "The mesh in scope has axes ['data', 'model'] (data=4, model=2)" in message
    assert "Call it under jax.set_mesh" not in message   # a mesh is set already


def test_unknown_mesh_axis_without_a_mesh_says_to_set_one():
    f = nx.xmap(lambda a: a, ['batch', ...], ['batch', ...], axis_resources={'batch': 'data'})
    with pytest.raises(nx.NxopsError, match=r"'data'.*Mesh axes in scope: none.*jax\.set_mesh"):
        f(jnp.ones((8, 3)))


def test_named_einsum_outside_xmap_says_the_name_is_not_bound():
    x, y = jnp.ones(3), jnp.ones(3)
    with pytest.raises(nx.NxopsError) as info:
        nx.einsum('<i>,<i>-><>', x, y)
    message = str(info.value)
    assert "nx.einsum '<i>,<i>-><>': axis name 'i' is not bound here" in message, message
    assert "positional letters" not in message        # not the rank mismatch it causes
    suggested = re.search(r"\(e\.g\. '([^']*)'\)", message).group(1)
    assert suggested == 'i,i->'
    np.testing.assert_allclose(nx.einsum(suggested, x, y), np.dot(x, y))   # the fix works


def test_named_einsum_still_reports_a_rank_mismatch_inside_xmap():
    f = nx.xmap(lambda x: nx.einsum('a<i>->a', x), [['i', ...]], [...])
    with pytest.raises(nx.NxopsError, match="has 1 positional letters but its operand has shape"):
        f(jnp.ones((4, 2, 3)))
