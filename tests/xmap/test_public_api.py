"""``nx.xmap`` is the function although ``nxops/xmap/`` is a package.

Needs ``from nxops.xmap import xmap, SerialLoop, serial_loop`` at the end of
``nxops/__init__.py`` (importing a submodule sets the parent's attribute to the
module only when the package is first imported, which __init__ does first).
"""
import importlib

import nxops as nx
from nxops.xmap import SerialLoop, serial_loop, xmap


def test_nx_xmap_is_the_function_after_submodule_imports():
    importlib.import_module("nxops.xmap._specs")
    importlib.import_module("nxops.xmap._program")
    assert nx.xmap is xmap
    assert nx.SerialLoop is SerialLoop
    assert nx.serial_loop is serial_loop
    assert callable(nx.xmap) and nx.xmap.__name__ == "xmap"
