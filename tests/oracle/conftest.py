"""Prints the oracles' case counts per category at the end of the session."""


def pytest_terminal_summary(terminalreporter):
    from tests.oracle import _runner
    if _runner.COUNTS:
        terminalreporter.write_sep("-", "composed oracle case counts")
        terminalreporter.write_line(_runner.format_counts())
