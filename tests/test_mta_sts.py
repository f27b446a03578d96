"""MTA-STS, the pure part (policy/mta_sts.py): records, policy files, matching, the cache."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mtaqueue.policy.mta_sts import (
    AS_USUAL,
    ENFORCE,
    MODES,
    TESTING,
    VERIFY,
    VERIFY_OR_LOG,
    Applied,
    Fetch,
    Policy,
    after_fetch,
    eligible,
    mx_matches,
    parse_policy,
    parse_record,
    plan,
    render_policy,
    requirement,
)

POLICY = (
    "version: STSv1\r\nmode: enforce\r\nmx: mx.example.org\r\nmx: *.backup.example\r\n"
    "max_age: 86400\r\n"
)


def test_record_id():
    assert parse_record(["v=STSv1; id=20160831085700Z;"]) == "20160831085700Z"
    assert parse_record(["v=STSv1;id=1"]) == "1"
    assert parse_record(["v=spf1 -all", "v=STSv1; id=abc; ext=x"]) == "abc"


def test_record_refused():
    assert parse_record([]) is None
    assert parse_record(["v=STSv1; id=1;", "v=STSv1; id=2;"]) is None  # two: as none
    assert parse_record(["v=STSv1"]) is None  # no id
    assert parse_record(["v=STSv1; id=no-dashes"]) is None
    assert parse_record(["v=STSv1; id=" + "a" * 33]) is None
    assert parse_record(["id=1; v=STSv1"]) is None  # the version comes first
    assert parse_record(["v=STSv10; id=1"]) is None


def test_policy_parsed_with_crlf_or_lf():
    for text in (POLICY, POLICY.replace("\r\n", "\n")):
        policy = parse_policy(text, "1", 100.0)
        assert policy == Policy("1", ENFORCE, ("mx.example.org", "*.backup.example"), 86400, 100.0)


def test_policy_unknown_keys_ignored_and_max_age_capped():
    text = "version: STSv1\nmode: testing\nfoo: bar\nmx: MX.Example.ORG.\nmax_age: 9999999999\n"
    assert parse_policy(text, "x", 0.0) == Policy("x", TESTING, ("mx.example.org",), 31_557_600, 0)
    none = parse_policy("version: STSv1\nmode: none\nmax_age: 60\n", "x", 0.0)
    assert isinstance(none, Policy) and none.mx == ()


def test_policy_refused():
    bad = {
        "mode: enforce\nmx: a.b\nmax_age: 1\n": "version",
        "version: STSv1\nmode: strict\nmx: a.b\nmax_age: 1\n": "mode",
        "version: STSv1\nmode: enforce\nmx: a.b\nmax_age: -1\n": "max_age",
        "version: STSv1\nmode: enforce\nmax_age: 1\n": "no mx",
        "version: STSv1\nmode: enforce\nmx: a.*.b\nmax_age: 1\n": "pattern",
        "version: STSv1\nmode: enforce\nmx: a.b\nmax_age: 99999999999\n": "max_age",
    }
    for text, why in bad.items():
        result = parse_policy(text, "1", 0.0)
        assert isinstance(result, str) and why in result, (text, result)


@given(st.text())
def test_parsers_never_crash(text):
    assert isinstance(parse_policy(text, "1", 0.0), Policy | str)
    assert parse_record([text]) is None or parse_record([text]).isalnum()


labels = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?", fullmatch=True)
hostnames = st.lists(labels, min_size=2, max_size=4).map(".".join)


@given(
    st.sampled_from(MODES),
    st.lists(st.one_of(hostnames, hostnames.map("*.".__add__)), min_size=1, max_size=5),
    st.integers(0, 31_557_600),
)
def test_policy_round_trips(mode, mx, max_age):
    policy = Policy("id1", mode, tuple(mx), max_age, 5.0)
    assert parse_policy(render_policy(policy), "id1", 5.0) == policy


def test_mx_matching():
    patterns = ("mx.example.org", "*.example.net")
    assert mx_matches("mx.example.org", patterns)
    assert mx_matches("MX.Example.Org.", patterns)
    assert mx_matches("mx1.example.net", patterns)
    assert not mx_matches("example.net", patterns)  # the wildcard needs a label
    assert not mx_matches("a.mx1.example.net", patterns)  # ... exactly one
    assert not mx_matches("mx.example.org.evil.test", patterns)
    assert not mx_matches("xmx.example.org", patterns)


def test_cache_plan():
    cached = Policy("1", ENFORCE, ("mx.example.org",), 100, 1000.0)
    assert plan(None, None, 0) is None  # no record, nothing cached: no MTA-STS
    assert plan(None, "1", 0) == Fetch("1")
    assert plan(cached, "1", 1050) is cached  # within max_age, same id: no fetch
    assert plan(cached, "2", 1050) == Fetch("2")  # the id changed: refetch
    assert plan(cached, "1", 1100) == Fetch("1")  # expired: refetch
    assert plan(cached, None, 1050) is cached  # the TXT gone (or blocked): still enforced
    assert plan(cached, None, 1100) is None  # ... until max_age


def test_failed_fetch_keeps_a_valid_policy():
    cached = Policy("1", ENFORCE, ("mx.example.org",), 100, 1000.0)
    fresh = Policy("2", TESTING, ("mx.example.org",), 100, 1050.0)
    assert after_fetch(cached, fresh, 1050) is fresh
    assert after_fetch(cached, None, 1050) is cached
    assert after_fetch(cached, None, 1100) is None
    assert after_fetch(None, None, 0) is None


def test_eligible_hosts_and_requirements():
    enforce = Applied("example.org", ENFORCE, ("mx.example.org",), "1")
    testing = Applied("example.org", TESTING, ("mx.example.org",), "1")
    hosts = ["mx.example.org", "other.example.org"]
    assert eligible(enforce, hosts) == (["mx.example.org"], ["other.example.org"])
    assert eligible(testing, hosts) == (hosts, ["other.example.org"])
    assert requirement(None, "mx.example.org") == AS_USUAL
    assert requirement(enforce, "mx.example.org") == VERIFY
    assert requirement(testing, "mx.example.org") == VERIFY_OR_LOG
    assert requirement(testing, "other.example.org") == AS_USUAL  # logged at routing
