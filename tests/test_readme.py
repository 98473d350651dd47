"""The README's example runs and gives the value it implies (uniform logits
over 3 classes: a loss of log 3)."""
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
