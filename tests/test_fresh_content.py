"""The content of messages just accepted, kept for their delivery (spool/fresh.py)."""

from mtaqueue.spool.fresh import FreshContent


def test_kept_until_dropped():
    fresh = FreshContent(1000)
    fresh.keep("A", b"x" * 100)
    assert fresh.get("A") == b"x" * 100 and fresh.bytes == 100
    fresh.drop("A")
    assert fresh.get("A") is None and fresh.bytes == 0 and len(fresh) == 0
    fresh.drop("A")  # twice: nothing to drop
    assert fresh.bytes == 0


def test_the_oldest_go_first_past_the_bound():
    fresh = FreshContent(1000)
    for name in "ABCDEFGHIJK":
        fresh.keep(name, b"y" * 100)
    assert fresh.bytes <= 1000
    assert fresh.get("A") is None  # the first kept went first
    assert fresh.get("K") == b"y" * 100


def test_a_large_message_is_not_kept():
    fresh = FreshContent(1000)
    fresh.keep("A", b"s" * 100)
    fresh.keep("B", b"b" * 200)  # over an eighth of the bound: it would push out many
    assert fresh.get("B") is None and fresh.get("A") == b"s" * 100


def test_kept_again_counts_once():
    fresh = FreshContent(1000)
    fresh.keep("A", b"x" * 100)
    fresh.keep("A", b"z" * 50)
    assert fresh.get("A") == b"z" * 50 and fresh.bytes == 50 and len(fresh) == 1
