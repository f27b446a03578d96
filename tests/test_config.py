"""Config loading: defaults, -o overrides, units, and one-line errors that name the key."""

import re
import tomllib
from pathlib import Path

import msgspec
import pytest

from mtaqueue.config import (
    ClassConfig,
    Config,
    ConfigError,
    DkimKeyConfig,
    FreeSpace,
    PoolConfig,
    SpoolConfig,
    WebhookConfig,
    control_socket_path,
    load,
    parse_duration,
    parse_nameserver,
    parse_size,
    split_host_port,
)
from mtaqueue.intake_settings import listener_settings

SHIPPED = Path(__file__).resolve().parent.parent / "conf" / "mtaqueue.toml"


def load_text(tmp_path: Path, text: str, overrides: list[str] | None = None) -> Config:
    path = tmp_path / "mtaqueue.toml"
    path.write_text(text)
    return load(str(path), overrides or [])


def config_error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(None, list(overrides))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_defaults() -> None:
    cfg = load(None, [])
    assert cfg == Config()
    assert cfg.listen.address == "127.0.0.1:2525"
    assert cfg.listen.mynetworks == ["127.0.0.0/8", "::1/128"]
    assert cfg.listen.max_message_size == 25 * 2**20
    assert cfg.spool.path == "spool"
    assert cfg.spool.min_free.bytes_for(1000) == 20
    assert control_socket_path(cfg) == "spool/control.sock"
    assert cfg.metrics.address == ""
    assert cfg.dns.nameservers == []
    assert cfg.delivery.port == 25
    assert cfg.delivery.relayhost == ""
    assert cfg.routes == {}
    assert cfg.retry.schedule == [300, 900, 1800, 3600]
    assert cfg.retry.then == [4 * 3600, 6 * 3600]
    assert cfg.retry.greylist_min == 300
    assert cfg.submission.default_class == "p1"
    assert cfg.classes == {
        "p0": ClassConfig(lifetime=4 * 3600, priority=0, weight=1),
        "p1": ClassConfig(lifetime=5 * 86400, priority=1, weight=4),
        "p2": ClassConfig(lifetime=2 * 86400, priority=2, weight=1),
    }


def test_empty_file_is_defaults(tmp_path: Path) -> None:
    assert load_text(tmp_path, "") == Config()


@pytest.mark.parametrize(
    ("override", "get", "expected"),
    [
        ("delivery.port=2526", lambda c: c.delivery.port, 2526),
        ("listen.address=0.0.0.0:25", lambda c: c.listen.address, "0.0.0.0:25"),
        ('listen.hostname="mx.example"', lambda c: c.listen.hostname, "mx.example"),
        ("listen.hostname=mx.example", lambda c: c.listen.hostname, "mx.example"),
        (" listen.max_recipients = 5 ", lambda c: c.listen.max_recipients, 5),
        ('retry.schedule=["1m", 90]', lambda c: c.retry.schedule, [60, 90]),
        ("retry.greylist_min=10m", lambda c: c.retry.greylist_min, 600),
        ("metrics.address=", lambda c: c.metrics.address, ""),
        ("control.mode=0o640", lambda c: c.control.mode, 0o640),
        ("control.socket=/run/mtaqueue.sock", control_socket_path, "/run/mtaqueue.sock"),
        ("spool.min_free=1GiB", lambda c: c.spool.min_free, FreeSpace(nbytes=2**30)),
        ("log.format=console", lambda c: c.log.format, "console"),
        (
            "routes.example.com=[127.0.0.1]:2526",
            lambda c: c.routes,
            {"example.com": "[127.0.0.1]:2526"},
        ),
        (
            "routes.Example.COM=mx.example.net",
            lambda c: c.routes,
            {"example.com": "mx.example.net"},
        ),
        ("routes.example.com=", lambda c: c.routes, {"example.com": ""}),
        (
            "delivery.relayhost=[smtp.example.net]:587",
            lambda c: c.delivery.relayhost,
            "[smtp.example.net]:587",
        ),
    ],
)
def test_override(override: str, get, expected) -> None:
    assert get(load(None, [override])) == expected


def test_override_class_key_keeps_the_other_defaults() -> None:
    classes = load(None, ["classes.p0.lifetime=1h"]).classes
    assert classes["p0"] == ClassConfig(lifetime=3600, priority=0, weight=1)
    assert classes["p1"] == Config().classes["p1"]
    assert classes["p2"] == Config().classes["p2"]


def test_new_class_takes_class_defaults() -> None:
    cfg = load(None, ["classes.bulk.priority=3", "submission.default_class=bulk"])
    assert cfg.classes["bulk"] == ClassConfig(lifetime=5 * 86400, priority=3)
    assert set(cfg.classes) == {"p0", "p1", "p2", "bulk"}


def test_file_class_table_merges_over_defaults(tmp_path: Path) -> None:
    cfg = load_text(tmp_path, '[classes.p0]\nlifetime = "1h"\n')
    assert cfg.classes["p0"] == ClassConfig(lifetime=3600, priority=0, weight=1)
    assert cfg.classes["p1"] == Config().classes["p1"]
    assert cfg.classes["p2"] == Config().classes["p2"]


def test_overrides_apply_over_the_file(tmp_path: Path) -> None:
    text = '[delivery]\nport = 26\n[classes.p0]\nlifetime = "1h"\n'
    cfg = load_text(tmp_path, text, ["delivery.port=27", "classes.p0.expire_action=hold"])
    assert cfg.delivery.port == 27
    assert cfg.classes["p0"] == ClassConfig(lifetime=3600, expire_action="hold", priority=0)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ('"90s"', 90),
        ('"15m"', 900),
        ('"4h"', 14400),
        ('"5d"', 432000),
        ('"250ms"', 0.25),
        ('"1.5h"', 5400),
        ('"90"', 90),
        ("90", 90),
        ("1.5", 1.5),
        ("0", 0),
    ],
)
def test_duration(value: str, seconds: float) -> None:
    cfg = load(None, [f"retry.greylist_min={value}"])
    assert cfg.retry.greylist_min == seconds
    assert isinstance(cfg.retry.greylist_min, float)


@pytest.mark.parametrize(
    "value", ['"5x"', '""', '"-5m"', '"m"', '"5 minutes"', "-1", "true", "[1]"]
)
def test_bad_duration(value: str) -> None:
    assert config_error(f"retry.greylist_min={value}").startswith("retry.greylist_min: ")


def test_bad_duration_message_names_the_list_index() -> None:
    assert config_error('retry.schedule=["5m", "5x"]') == (
        "retry.schedule[1]: invalid duration '5x' (use e.g. 90s, 15m, 4h, 5d or seconds)"
    )


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("512KiB", 512 * 1024),
        ("25MiB", 25 * 2**20),
        ("1GiB", 2**30),
        ("10MB", 10**7),
        ("10kB", 10**4),
        ("1000", 1000),
        ("1000B", 1000),
        ("1.5KiB", 1536),
    ],
)
def test_size(text: str, size: int) -> None:
    assert parse_size(text) == size
    assert load(None, [f'listen.max_message_size="{text}"']).listen.max_message_size == size


@pytest.mark.parametrize("value", ['"10XB"', '"10 mb"', '"-1"', '"1.5.5MiB"', "-1", "1.5", "true"])
def test_bad_size(value: str) -> None:
    assert config_error(f"listen.max_message_size={value}").startswith("listen.max_message_size: ")


def test_parse_duration_and_size_raise_value_error() -> None:
    assert parse_duration("2h") == 7200
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration("2 hours")
    with pytest.raises(ValueError, match="invalid size"):
        parse_size("2 gigs")


@pytest.mark.parametrize(
    ("value", "total", "free"),
    [("5%", 1000, 50), ("0.5%", 1000, 5), ("2GiB", 10**12, 2 * 2**30), ("4096", 10**12, 4096)],
)
def test_min_free(value: str, total: int, free: int) -> None:
    assert load(None, [f'spool.min_free="{value}"']).spool.min_free.bytes_for(total) == free


@pytest.mark.parametrize("value", ['"100%"', '"x%"', '"%"', '"-5%"', "-1"])
def test_bad_min_free(value: str) -> None:
    assert config_error(f"spool.min_free={value}").startswith("spool.min_free: ")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("bogus = 1\n", "bogus: unknown key"),
        ("[bogus]\nx = 1\n", "bogus: unknown key"),
        ("[listen]\nbogus = 1\n", "listen.bogus: unknown key"),
        ("[classes.p0]\nbogus = 1\n", "classes.p0.bogus: unknown key"),
        ('[classes.bulk]\nlifetime = "1d"\nbogus = 1\n', "classes.bulk.bogus: unknown key"),
        ('[delivery]\nport = "x"\n', "delivery.port: expected int, got str"),
        ('[listen]\nmynetworks = "10.0.0.0/8"\n', "listen.mynetworks: expected array, got str"),
        ("listen = 5\n", "listen: expected table, got int"),
        ("[routes]\n'example.com' = 25\n", "routes.example.com: expected str, got int"),
    ],
)
def test_file_errors_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_text(tmp_path, text)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("listen.bogus=1", "listen.bogus: unknown key"),
        ("classes.p0.bogus=1", "classes.p0.bogus: unknown key"),
        ("delivery.port=x", "delivery.port: expected int, got str"),
        ("delivery.port=0", "delivery.port: expected int >= 1"),
        ("delivery.port=70000", "delivery.port: expected int <= 65535"),
        ("listen.auth_required=yes", "listen.auth_required: expected bool, got str"),
        ("classes.p0=1", "classes.p0: expected table, got int"),
        ("classes.p1.weight=0", "classes.p1.weight: expected int >= 1"),
        ("classes.p2.lifetime=0", "classes.p2.lifetime: must be more than 0s"),
        (
            "classes.p0.lifetime=1x",
            "classes.p0.lifetime: invalid duration '1x' (use e.g. 90s, 15m, 4h, 5d or seconds)",
        ),
        ("classes.a.b=1", "classes.a.b: unknown key"),
        ("retry.jitter=0.9", "retry.jitter: expected float <= 0.5"),
        ('retry.then=["6h", "4h"]', "retry.then: min is greater than max"),
        ('retry.then=["4h"]', "retry.then: expected two durations [min, max], got 1"),
        (
            "log.level=verbose",
            "log.level: invalid value 'verbose' (expected one of debug, info, warning, error)",
        ),
        (
            "classes.p0.expire_action=keep",
            "classes.p0.expire_action: invalid value 'keep'"
            " (expected one of bounce, discard, hold, notify)",
        ),
        (
            "submission.default_class=p9",
            "submission.default_class: unknown class 'p9' (defined: p0, p1, p2)",
        ),
        ("listen.tls_cert=cert.pem", "listen.tls_key: required when listen.tls_cert is set"),
        ("listen.auth_required=true", "listen.auth_required: needs listen.auth_file"),
        ("listen.command_timeout=0", "listen.command_timeout: must be more than 0s"),
        (
            "listen.max_line_length=500",
            "listen.max_line_length: must be at least 998 (RFC 5322 2.1.1)",
        ),
        ("spool.path=", "spool.path: must not be empty"),
        ("override", "override 'override': expected SECTION.KEY=VALUE or SECTION=VALUE"),
        ("listen=1", "listen: expected table, got int"),  # as `listen = 1` in the file
        ("nosuch=1", "nosuch: unknown key"),
        ("routes.=x", "override 'routes.=x': expected SECTION.KEY=VALUE or SECTION=VALUE"),
        (
            "listen..address=x",
            "override 'listen..address=x': expected SECTION.KEY=VALUE or SECTION=VALUE",
        ),
        ('webhooks=[{url="http://127.0.0.1:9/e", bogus=1}]', "webhooks[0].bogus: unknown key"),
        (
            'webhooks=[{url="http://127.0.0.1:9/e"',
            "override 'webhooks=[{url=\"http://127.0.0.1:9/e\"': TOML syntax error: "
            "Unclosed inline table (at end of document)",
        ),
    ],
)
def test_override_errors_name_the_key(override: str, message: str) -> None:
    assert config_error(override) == message


def test_an_override_sets_a_whole_section_arrays_of_tables_included() -> None:
    webhook = 'webhooks=[{url="http://127.0.0.1:9/e", secret="s", events=["delivered"]}]'
    cfg = load(None, [webhook, 'pools={bulk={sources=["192.0.2.1"]}}'])
    assert [(w.url, w.secret, w.events) for w in cfg.webhooks] == [
        ("http://127.0.0.1:9/e", "s", ["delivered"])
    ]
    assert cfg.pools["bulk"].sources == ["192.0.2.1"]
    # A relayhost in brackets is text, not a broken array.
    assert load(None, ["delivery.relayhost=[127.0.0.1]:2790"]).delivery.relayhost == (
        "[127.0.0.1]:2790"
    )


def test_an_override_and_the_file_give_the_same_error(tmp_path) -> None:
    path = tmp_path / "mtaqueue.toml"
    path.write_text('[[webhooks]]\nurl = "http://127.0.0.1:9/e"\nbogus = 1\n')
    with pytest.raises(ConfigError) as info:
        load(str(path))
    from_file = str(info.value)
    from_override = config_error('webhooks=[{url="http://127.0.0.1:9/e", bogus=1}]')
    assert from_file == from_override == "webhooks[0].bogus: unknown key"


@pytest.mark.parametrize(
    ("override", "prefix"),
    [
        ("listen.address=127.0.0.1", "listen.address: missing port"),
        ("listen.address=::1:25", "listen.address: invalid address"),
        ("listen.address=host name:25", "listen.address: invalid host"),
        ('listen.mynetworks=["10.0.0.0/33"]', "listen.mynetworks[0]: invalid network"),
        (
            'listen.client_limit_exceptions=["mynetworks", "localhost"]',
            "listen.client_limit_exceptions[1]: invalid network",
        ),
        ('dns.nameservers=["127.0.0.1", "ns.example"]', "dns.nameservers[1]: invalid nameserver"),
        ("metrics.address=localhost", "metrics.address: missing port"),
        ("delivery.relayhost=[smtp.example.net", "delivery.relayhost: invalid address"),
        ("delivery.relayhost=smtp.example.net:0", "delivery.relayhost: invalid port"),
        ("routes.example.com=[127.0.0.1]:x", "routes.example.com: invalid port"),
        ("routes.exa mple.com=mx.example.com", "routes.exa mple.com: invalid domain"),
    ],
)
def test_address_errors_name_the_key(override: str, prefix: str) -> None:
    assert config_error(override).startswith(prefix)


def test_client_limit_exceptions_default_to_mynetworks() -> None:
    # The per-client cap spares the local apps of mynetworks, as Postfix's
    # smtpd_client_event_limit_exceptions = $mynetworks does.
    cfg = load(None, ['listen.mynetworks=["10.1.0.0/16", "::1"]'])
    assert cfg.listen.client_limit_exceptions == ["mynetworks"]
    settings = listener_settings(cfg, "mx.test")
    assert [str(n) for n in settings.client_limit_exceptions] == ["10.1.0.0/16", "::1/128"]
    cfg = load(None, ['listen.client_limit_exceptions=["192.0.2.0/24", "mynetworks"]'])
    settings = listener_settings(cfg, "mx.test")
    assert [str(n) for n in settings.client_limit_exceptions] == [
        "192.0.2.0/24",
        "127.0.0.0/8",
        "::1/128",
    ]
    assert (
        listener_settings(
            load(None, ["listen.client_limit_exceptions=[]"]), "x"
        ).client_limit_exceptions
        == ()
    )


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match=r"^config file conf/x\.toml: not found$"):
        load("conf/x.toml", [])


def test_toml_syntax_error_names_the_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_text(tmp_path, "[listen]\n\naddress = \n")
    message = str(info.value)
    assert message.startswith(
        f"config file {tmp_path / 'mtaqueue.toml'}: TOML syntax error at line 3"
    )
    assert "\n" not in message


@pytest.mark.parametrize(
    ("text", "default_port", "expected"),
    [
        ("127.0.0.1:2525", None, ("127.0.0.1", 2525)),
        ("[::1]:25", None, ("::1", 25)),
        ("mx.example.com:587", None, ("mx.example.com", 587)),
        ("[mx.example.com]:2526", None, ("mx.example.com", 2526)),
        ("[mx.example.com]", 25, ("mx.example.com", 25)),
        ("mx.example.com", 25, ("mx.example.com", 25)),
        ("[2001:db8::1]", 25, ("2001:db8::1", 25)),
    ],
)
def test_split_host_port(text: str, default_port: int | None, expected: tuple[str, int]) -> None:
    assert split_host_port(text, default_port) == expected


@pytest.mark.parametrize(
    ("text", "default_port"),
    [
        ("mx.example.com", None),
        ("::1", 25),
        ("::1:25", None),
        ("[::1", None),
        ("[::1]25", None),
        ("[::1]:", None),
        ("host:0", None),
        ("host:99999", None),
        ("host:x", None),
        (":25", None),
        ("[]:25", None),
        ("[not:v6]:25", None),
        ("a..b:25", None),
    ],
)
def test_split_host_port_rejects(text: str, default_port: int | None) -> None:
    with pytest.raises(ValueError):
        split_host_port(text, default_port)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1", ("127.0.0.1", 53)),
        ("::1", ("::1", 53)),
        ("127.0.0.1:5353", ("127.0.0.1", 5353)),
        ("[::1]:5353", ("::1", 5353)),
    ],
)
def test_parse_nameserver(text: str, expected: tuple[str, int]) -> None:
    assert parse_nameserver(text) == expected


def test_shipped_config_loads_and_documents_the_defaults() -> None:
    cfg = load(str(SHIPPED), [])
    assert cfg == msgspec.structs.replace(Config(), spool=SpoolConfig(path="var/spool"))
    assert control_socket_path(cfg) == "var/spool/control.sock"


def test_shipped_config_names_every_key_and_only_real_keys() -> None:
    text = SHIPPED.read_text()
    raw = tomllib.loads(text)
    sections = {f.name: f.type for f in msgspec.structs.fields(Config)}
    # [[webhooks]] has no empty form in TOML: the file shows a commented-out entry instead,
    # as it does for a [dkim."DOMAIN"] table under its empty [dkim].
    assert raw.keys() == sections.keys() - {"webhooks"}
    examples = {
        WebhookConfig: text.split("# [[webhooks]]\n")[1],
        DkimKeyConfig: text.split('# [dkim."example.com"]\n')[1].split("\n[dkim]\n")[0],
    }
    for table_type, example in examples.items():
        names = re.findall(r"^# (\w+) = ", example, re.MULTILINE)
        assert set(names) == {f.encode_name for f in msgspec.structs.fields(table_type)}
    for name, table in raw.items():
        if name in ("routes", "tenants", "dkim"):
            assert table == {}, name
            continue
        if name == "pools":  # none by default: the file shows a commented-out one
            example = re.findall(r"^#   (\w+) = ", text.split("#   [pools.bulk]\n")[1], re.M)
            keys = {f.name for f in msgspec.structs.fields(PoolConfig)}
            assert table == {} and set(example) == keys
            continue
        if name == "classes":
            keys = {f.name for f in msgspec.structs.fields(ClassConfig)}
            assert table.keys() == {"p0", "p1", "p2"}
            assert all(entry.keys() == keys for entry in table.values())
        else:
            fields = msgspec.structs.fields(sections[name])
            assert table.keys() == {f.encode_name for f in fields}, name


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("classes.p0.relay_user=u", "classes.p0.relay_user: needs classes.p0.relayhost"),
        ("tenants.a.relay_tls_ca=/ca.pem", "tenants.a.relay_tls_ca: needs tenants.a.relayhost"),
        ("classes.p0.revalidate_after=1h", "classes.p0.revalidate_after: needs revalidate.url"),
        ("classes.p0.relayhost=[bad host]:25", "classes.p0.relayhost: invalid host"),
        ("revalidate.url=ftp://x", "revalidate.url: invalid URL"),
        ("tenants.shop.relay_tls=tls", "tenants.shop.relay_tls: invalid value 'tls'"),
        ("api.address=nohost:99999", "api.address: invalid port"),
        ("classes.p2.pool=bulk", "classes.p2.pool: unknown pool 'bulk'"),
        ("tenants.shop.pool=x", "tenants.shop.pool: unknown pool 'x'"),
        ("pools.bulk.sources=[]", "pools.bulk.sources: name at least one address"),
        ('pools.bulk.sources=["10.0.0.300"]', "pools.bulk.sources[0]: not an IP address"),
        ('pools.b.sources=["::1", {address="::1"}]', "pools.b.sources[1]: ::1 is named twice"),
        ('pools.bulk.sources=[{helo="x"}]', "pools.bulk.sources[0].address: required"),
    ],
)
def test_issue_11_keys_are_checked(item: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(None, [item])
    assert str(err.value).startswith(message)


def test_a_webhook_needs_a_secret_and_known_event_types(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[[webhooks]]\nurl = "http://127.0.0.1:9/x"\n')
    with pytest.raises(ConfigError, match=r"^webhooks\[0\]\.secret: required"):
        load(str(path))
    path.write_text('[[webhooks]]\nurl = "http://127.0.0.1:9/x"\nsecret = "s"\nevents = ["sent"]\n')
    with pytest.raises(ConfigError, match=r"^webhooks\[0\]\.events: unknown event type 'sent'"):
        load(str(path))
    path.write_text(
        '[[webhooks]]\nurl = "http://127.0.0.1:9/x"\nsecret = "s"\nevents = ["bounced"]\n'
        '[tenants.shop]\nrelayhost = "[127.0.0.1]:587"\n'
    )
    cfg = load(str(path))
    assert cfg.webhooks[0].events == ["bounced"] and cfg.webhooks[0].batch_max == 100
    assert cfg.tenants["shop"].relayhost == "[127.0.0.1]:587"


def test_a_dkim_domain_takes_one_key_table_or_an_array_of_them(tmp_path: Path) -> None:
    one = load_text(tmp_path, '[dkim."Example.com"]\nselector = "s1"\nkey_file = "/k.pem"\n')
    assert one.dkim == {"Example.com": [DkimKeyConfig(selector="s1", key_file="/k.pem")]}
    two = load_text(
        tmp_path,
        '[[dkim."example.com"]]\nselector = "r"\nkey_file = "/r.pem"\n'
        '[[dkim."example.com"]]\nselector = "e"\nkey_file = "/e.pem"\n'
        'algorithm = "ed25519-sha256"\nheaders = ["From", "Subject"]\n',
    )
    assert [(k.selector, k.algorithm) for k in two.dkim["example.com"]] == [
        ("r", "rsa-sha256"),
        ("e", "ed25519-sha256"),
    ]
    # -o takes a domain's dotted name as routes.DOMAIN does.
    cfg = load(None, ["dkim.example.com.selector=s1", "dkim.example.com.key_file=/k.pem"])
    assert cfg.dkim == {"example.com": [DkimKeyConfig(selector="s1", key_file="/k.pem")]}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[dkim."example.com"]\nselector = "s1"\n', 'dkim."example.com".key_file: required'),
        ('[dkim."example.com"]\nkey_file = "/k"\n', 'dkim."example.com".selector: required'),
        ('[dkim."example.com"]\nselector = "a b"\nkey_file = "/k"\n', "invalid selector"),
        ('[dkim."ex ample.com"]\nselector = "s"\nkey_file = "/k"\n', "invalid domain"),
        ('[dkim."com"]\nselector = "s"\nkey_file = "/k"\n', 'dkim."com": invalid domain'),
        (
            '[dkim."example.com"]\nselector = "s"\nkey_file = "/k"\nalgorithm = "rsa"\n',
            "dkim.\"example.com\".algorithm: invalid value 'rsa' (expected one of rsa-sha256,",
        ),
        (
            '[dkim."example.com"]\nselector = "s"\nkey_file = "/k"\nheaders = ["Subject"]\n',
            'dkim."example.com".headers: must include From',
        ),
        (
            '[[dkim."example.com"]]\nselector = "s"\nkey_file = "/k"\n'
            '[[dkim."example.com"]]\nselector = "S"\nkey_file = "/j"\n',
            "dkim.\"example.com\"[1].selector: 'S' names another key too",
        ),
        (
            '[dkim."example.com"]\nselector = "s"\nkey_file = "/k"\n'
            '[dkim."Example.COM"]\nselector = "t"\nkey_file = "/k"\n',
            'dkim."Example.COM": the domain has another [dkim] table too',
        ),
        ('[dkim]\n"example.com" = "s1"\n', 'dkim."example.com": expected table, got str'),
    ],
)
def test_dkim_tables_are_checked_naming_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_text(tmp_path, text)
    assert message in str(info.value) and str(info.value).startswith("dkim.")
