"""The structured log: one JSON object a line, level-filtered, following reconfiguration."""

import io
import json
import threading
from datetime import datetime

import pytest

from mtaqueue.logs import configure_logging, get_logger


@pytest.fixture(autouse=True)
def _restore():
    yield
    configure_logging()


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_json_line_holds_component_fields_event_level_and_utc_timestamp(tmp_path):
    path = tmp_path / "log"
    with open(path, "w") as stream:
        configure_logging("info", "json", stream)
        get_logger("delivery").info("delivery", id="Q1", code=250, next_attempt=None)
    [record] = lines(path)
    assert record["component"] == "delivery" and record["event"] == "delivery"
    assert record["level"] == "info" and record["id"] == "Q1"
    assert record["code"] == 250 and record["next_attempt"] is None
    stamp = record["timestamp"]
    assert stamp.endswith("Z") and len(stamp.split(".")[1]) == 7  # microseconds, then Z
    age = datetime.now().astimezone() - datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    assert abs(age.total_seconds()) < 5


def test_levels_below_the_configured_one_are_dropped_and_a_reload_changes_it(tmp_path):
    path = tmp_path / "log"
    log = get_logger("daemon")  # made before the configuration, as module loggers are
    with open(path, "w") as stream:
        configure_logging("warning", "json", stream)
        log.debug("d")
        log.info("i")
        log.warning("w")
        configure_logging("debug", "json", stream)
        log.debug("d2")
    assert [r["event"] for r in lines(path)] == ["w", "d2"]


def test_an_exception_is_logged_at_error_with_its_traceback(tmp_path):
    path = tmp_path / "log"
    with open(path, "w") as stream:
        configure_logging("info", "json", stream)
        try:
            raise ValueError("bad value")
        except ValueError:
            get_logger("delivery").exception("settle_failed", id="Q2")
    [record] = lines(path)
    assert record["level"] == "error" and record["id"] == "Q2"
    assert "ValueError: bad value" in record["exception"]


def test_an_object_json_cannot_hold_is_logged_as_its_text(tmp_path):
    path = tmp_path / "log"
    with open(path, "w") as stream:
        configure_logging("info", "json", stream)
        get_logger("spool").error("write_failed", error=OSError(28, "No space left"))
    assert lines(path)[0]["error"] == "[Errno 28] No space left"


def test_console_format_is_one_readable_line_per_event():
    stream = io.StringIO()
    configure_logging("info", "console", stream)
    get_logger("listener").info("accepted", id="Q3", recipients=2)
    text = stream.getvalue()
    assert text.count("\n") == 1
    assert "[info    ] accepted" in text and "id='Q3'" in text and "recipients=2" in text


def test_lines_written_from_threads_at_once_never_interleave(tmp_path):
    path = tmp_path / "log"
    log = get_logger("delivery")
    with open(path, "w") as stream:
        configure_logging("info", "json", stream)

        def burst(n: int) -> None:
            for i in range(500):
                log.info("delivery", thread=n, i=i, text="x" * 200)

        threads = [threading.Thread(target=burst, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    records = lines(path)  # a torn line would not parse
    assert len(records) == 2000
    assert sorted((r["thread"], r["i"]) for r in records) == [
        (n, i) for n in range(4) for i in range(500)
    ]


def test_an_unknown_level_is_refused_by_name():
    with pytest.raises(ValueError, match="verbose"):
        configure_logging("verbose")
