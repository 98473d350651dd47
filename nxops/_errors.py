"""The one exception type nxops raises for user errors."""


class NxopsError(ValueError):
    """A user error: a bad spec, axis name, shape or kernel selection.

    Messages say what is wrong, quote the offending spec or shape, and say how
    to fix it. It subclasses ValueError so code written for the old
    ``jax.experimental.maps.xmap`` errors keeps catching it.

    Examples:
        >>> try:
        ...     nx.sum(jnp.ones(3), 'i')                 # a name outside any xmap
        ... except nx.NxopsError as e:
        ...     print(str(e)[:43])
        nx.sum: axis name 'i' is not bound here (bo
    """
