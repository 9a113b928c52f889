"""Progress reporting when stderr is not a terminal: plain lines at an interval, and a final one."""

import io

from kvflow.progress import PlainProgress, progress


def test_plain_lines_at_the_interval_and_at_close():
    now = [0.0]
    out = io.StringIO()
    bar = PlainProgress(100, "simulating", "req", interval_s=10, file=out, clock=lambda: now[0])
    for _ in range(40):
        now[0] += 0.5  # 40 requests over 20 s: a line at 10 s and at 20 s
        bar.update(1)
    bar.close()
    bar.close()  # once
    lines = out.getvalue().splitlines()
    assert lines == ["simulating: 20/100 req (20%) 2.0 req/s eta 40 s",
                     "simulating: 40/100 req (40%) 2.0 req/s eta 30 s",
                     "simulating: 40/100 req (40%) 2.0 req/s done in 20.0 s"]


def test_not_a_terminal_gives_plain_lines_and_disabled_gives_none(capsys):
    with progress(3, "reading", unit="records") as bar:  # pytest's stderr is not a terminal
        bar.update(3)
    assert capsys.readouterr().err.startswith("reading: 3/3 records (100%)")
    with progress(3, "reading", enabled=False) as bar:
        bar.update(3)
    assert capsys.readouterr().err == ""
