"""`usefulwork loadtest` command line: bad input stops with a clear message (exit 2), nothing sent."""

import argparse
import asyncio
import signal
from pathlib import Path

import pytest

from usefulwork.loadtest import cli


def _run(argv, capsys):
    p = argparse.ArgumentParser()
    cli.configure_parser(p)
    rc = cli.run(p.parse_args(argv))
    return rc, capsys.readouterr()


def test_malformed_trace_names_the_line(tmp_path, capsys):
    f = tmp_path / "trace.jsonl"
    f.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5}\n{"timestamp": 1, "input_length": 10}\n')
    # port 38999 has nothing listening: the error must come from the file, before any request
    rc, out = _run(["--url", "http://127.0.0.1:38999", "--workload", "mooncake", "--file", str(f)], capsys)
    assert rc == 2
    assert "trace.jsonl:2: missing field 'output_length'" in out.err.replace("\n", "")


def test_unknown_case_and_experiment(capsys):
    rc, out = _run(["--experiment", "cost", "--case", "nope", "--dry-run"], capsys)
    assert rc == 2 and "unknown case 'nope'" in out.err.replace("\n", "")
    rc, out = _run(["--experiment", "nosuch"], capsys)
    assert rc == 2 and "unknown experiment 'nosuch'" in out.err.replace("\n", "")


def test_load_spec_errors(capsys):
    rc, out = _run(["--url", "http://127.0.0.1:38999", "--rate", "1"], capsys)
    assert rc == 2 and "stop by duration or by request count" in out.err.replace("\n", "")
    rc, out = _run(["--url", "http://127.0.0.1:38999", "--num-requests", "3"], capsys)
    assert rc == 2 and "choose an arrival process" in out.err.replace("\n", "")
    with pytest.raises(SystemExit):
        _run(["--arrival", "zipf"], capsys)


def test_dry_run_lists_cells(capsys):
    rc, out = _run(["--experiment", "cost-a100", "--dry-run"], capsys)
    assert rc == 0
    assert out.err.count("512x128") == 4 and "optimized-batched" in out.err


@pytest.mark.parametrize("name", sorted(p.stem for p in (Path(cli.__file__).parent / "experiments").glob("*.yaml")))
def test_every_shipped_experiment_plans_its_cells(name, capsys):
    rc, out = _run(["--experiment", name, "--dry-run"], capsys)
    assert rc == 0, out.err
    assert "arrival=" in out.err  # one line per planned cell


def _signalled_as_the_loop_closes(then):
    """A run whose SIGTERM lands in a loop's last iteration: the exit scheduled on it is dropped with the loop
    (fault injection: the loop is stopped in the same callback), then ``then()`` ends the run."""
    def fake_run(args):
        loop = asyncio.new_event_loop()

        def last():
            signal.raise_signal(signal.SIGTERM)  # the run's handler: an exit scheduled on this loop
            loop.stop()  # ... which never runs it

        loop.call_soon(last)
        loop.run_forever()
        loop.close()
        return then()
    return fake_run


@pytest.mark.parametrize("then", [lambda: 0, lambda: (_ for _ in ()).throw(RuntimeError("Event loop stopped before Future "
                                                                                        "completed."))],
                         ids=["returned", "loop-shutdown-failed"])
def test_a_sigterm_whose_loop_closed_first_still_exits_143(monkeypatch, then):
    """The exit is kept beside the loop's callback: a run that returned, or failed in the loop's shutdown,
    after the signal exits as SIGTERM says (before, the first went on as if never signalled)."""
    monkeypatch.setattr(cli, "_run", _signalled_as_the_loop_closes(then))
    with pytest.raises(SystemExit) as stopped:
        cli.run(argparse.Namespace())
    assert stopped.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is not cli._stop_on_sigterm  # the handler is put back
