"""The ``nx.xmap`` frontend: named axes, mesh tiling and serial loops."""
from nxops.xmap._resources import SerialLoop, serial_loop
from nxops.xmap._rules import axis_rules
from nxops.xmap._xmap import XmapFunction, xmap

__all__ = ["SerialLoop", "XmapFunction", "axis_rules", "serial_loop", "xmap"]

# A user error's traceback ends at the user's line (nxops/_traceback.py).
from nxops._traceback import mark_boundaries

mark_boundaries(globals(), ["axis_rules", "serial_loop", "xmap"])
