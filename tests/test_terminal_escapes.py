"""Text from files another user can write (records, specs, the history, collect_job.json) reaches
the terminal with its control characters escaped (issue 51, item 11): an ESC sequence in a
record's `advice` could set the window's title, clear the screen or write the clipboard. Every
command prints through one stream (progress.escaped_output, names.printable_text)."""

from __future__ import annotations

import io
import json
import re

from hpcfsdp.cli import main
from hpcfsdp.contracts.record import RECORD_NAME, SPEC_NAME, write_record
from hpcfsdp.sweep.launch.collect_job import COLLECT_JOB_NAME
from test_history import write_sweep

# An OSC that sets the window title, a CSI that clears the screen, a carriage return that prints
# over a line, DEL, a C1 CSI, and a right-to-left override.
PLANTED = "\x1b]0;owned\x07\x1b[2J\rX\x7f\x9b31m\u202e"
# What a terminal would take as a command (a tab and a newline are text).
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def test_printable_text_escapes_what_a_terminal_would_run_and_keeps_tabs_and_newlines():
    from hpcfsdp.contracts.names import printable_text

    assert printable_text("a\tb\nc") == "a\tb\nc"
    assert printable_text(PLANTED) == "\\x1b]0;owned\\x07\\x1b[2J\\rX\\x7f\\x9b31m\\u202e"
    assert printable_text("bad\udcffname") == "bad\\udcffname"


def test_status_history_logs_and_collect_print_the_text_of_shared_files_with_controls_escaped(tmp_path, capsys):
    results = tmp_path / "results"
    sweep = write_sweep(results, "esc", 0, {"a": 1000.0, "b": "oom"})
    paths = sorted((sweep / "cells").glob(f"*/{RECORD_NAME}"))
    for path in paths:
        record = json.loads(path.read_text())
        record["device_name"] = f"H100{PLANTED}"
        record["resource_problems"] = [f"fewer CPUs{PLANTED}"]
        if record["status"] != "ok":
            record["advice"] = f"lower the batch{PLANTED}"
            record["error"] = f"CUDA out of memory{PLANTED}"
        write_record(path, record)
        spec = dict(record["spec"], strategy=f"ddp{PLANTED}")
        (path.parent / SPEC_NAME).write_text(json.dumps(spec))
    (sweep / COLLECT_JOB_NAME).write_text(json.dumps({"job_id": f"77{PLANTED}", "exit_status": 1, "error": PLANTED}))
    failed = next(path.parent.name for path in paths if json.loads(path.read_text())["status"] != "ok")
    (paths[0].parent / "log.txt").write_text(f"a rank's line{PLANTED}\n")
    printed = ""
    for argv in (
        ["status", str(sweep)],
        ["status", str(sweep), "--json"],
        ["collect", str(sweep), "--no-plots"],
        ["history", "--history", str(results / "history.duckdb")],
        ["logs", str(sweep), failed],
        ["logs", str(sweep), paths[0].parent.name],
    ):
        main(argv)
        out, err = capsys.readouterr()
        assert not CONTROL.search(out + err), (argv, CONTROL.findall(out + err))
        printed += out + err
    assert "\\x1b]0;owned\\x07" in printed  # shown, escaped


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_only_hpcfsdps_own_colours_and_bar_pass_and_a_files_codes_are_escaped():
    from hpcfsdp.progress import EscapedStream, coloured

    terminal = _Terminal()
    EscapedStream(terminal).write(f"{coloured('ok', 'ok', terminal)} \r\x1b[K[###] {PLANTED} \x1b[8mhidden\x1b[0m")
    shown = terminal.getvalue()
    assert shown.startswith("\x1b[32mok\x1b[0m \r\x1b[K[###] \\x1b]0;owned\\x07\\x1b[2J\\rX")
    assert shown.endswith(" \\x1b[8mhidden\x1b[0m")  # concealed text is shown; a colour's end is harmless
    piped = io.StringIO()
    EscapedStream(piped).write("\x1b[32mok\x1b[0m")
    assert piped.getvalue() == "\\x1b[32mok\\x1b[0m"  # no colour where no terminal reads it
