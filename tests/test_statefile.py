"""Small state files beside the spool, replaced atomically (mtaqueue.spool.statefile)."""

from __future__ import annotations

import os

from mtaqueue.policy import rate_learner
from mtaqueue.policy.rate_learner import Learned
from mtaqueue.spool import statefile
from mtaqueue.spool.layout import SpoolLayout


def test_write_replaces_whole_and_leaves_no_temporary(tmp_path):
    path = SpoolLayout(tmp_path).learned
    assert statefile.read(path) is None
    statefile.write_atomic(path, b"one")
    statefile.write_atomic(path, b"two, longer")
    assert statefile.read(path) == b"two, longer"
    assert os.listdir(tmp_path) == [path.name]
    assert path.stat().st_mode & 0o777 == 0o600


def test_learned_state_round_trips():
    learned = {
        "mx.b.test": Learned(5.0, 6.0, "421 4.7.28 slow down", 3, "421 too many connections", 9.0),
        "mx.a.test": Learned(2.0, at=1.0),
    }
    data = rate_learner.encode(learned)
    assert rate_learner.decode(data) == (learned, {})
    assert data.index(b"mx.a.test") < data.index(b"mx.b.test")  # stable, for diffs
