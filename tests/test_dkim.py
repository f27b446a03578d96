"""DKIM signing (RFC 6376, RFC 8463): canonicalisation against the RFCs' examples and
dkimpy, signatures that dkimpy verifies, which keys sign which mail, and the key files."""

from __future__ import annotations

import base64
import hashlib
import re
import subprocess
from pathlib import Path

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519
from dkim.canonicalization import Relaxed
from dkim_keys import pem, private_key, signing_key, verify_all, write_key
from hypothesis import given
from hypothesis import strategies as st

from mtaqueue.config import ConfigError, load
from mtaqueue.conversion import Prepared, prepare
from mtaqueue.dkim.canonical import RelaxedBody, relaxed_field
from mtaqueue.dkim.keys import load_keys
from mtaqueue.dkim.signature import fill, sign_digest
from mtaqueue.dkim.signer import Signer, from_domain

MESSAGE = (
    b"Received: from client.test ([127.0.0.1])\r\n\tby mx.test (mtaqueue) with ESMTP id 1\r\n"
    b"From: App  <app@example.com>\r\nTo: a@example.org,\r\n  b@example.net\r\n"
    b"Subject:  hello   there \r\nDate: Mon, 1 Jan 2024 00:00:00 +0000\r\n"
    b"Message-ID: <1@example.com>\r\n\r\nhello  world \r\n\r\n\r\n"
)


def body_hash(body: bytes) -> bytes:
    hasher = RelaxedBody()
    hasher.feed(body)
    return hasher.digest()


def signed(signer: Signer, content: bytes = MESSAGE, now: float = 1_700_000_000) -> bytes:
    result = signer.sign(content, now)
    assert result is not None
    return b"".join(result)


def records(*keys) -> dict[str, str]:
    return {key.record_name: key.record() for key in keys}


# -- canonicalisation ------------------------------------------------------------------


def test_relaxed_canonicalisation_of_rfc_6376_example_3_4_5():
    assert relaxed_field(b"A: X") + relaxed_field(b"B : Y\t\r\n\tZ  ") == b"a:X\r\nb:Y Z\r\n"
    assert hashlib.sha256(b" C\r\nD E\r\n").digest() == body_hash(b" C \r\nD \t E\r\n\r\n\r\n")


def test_the_body_hash_of_the_rfc_8463_example():
    body = b"Hi.\r\n\r\nWe lost the game.  Are you hungry yet?\r\n\r\nJoe.\r\n"
    assert base64.b64encode(body_hash(body)) == b"2jUSOH9NhtVGCQWNr9BrIAPreKQjO6Sn7XIkfJVOzv8="


def test_an_empty_body_or_one_of_empty_lines_hashes_as_nothing():
    assert body_hash(b"") == body_hash(b"\r\n\r\n") == body_hash(b" \r\n\t\r\n")
    assert body_hash(b"") == hashlib.sha256(b"").digest()


_LINE = st.lists(st.sampled_from([b"a", b"b", b" ", b"\t", b"  "]), max_size=8).map(b"".join)
_BODY = st.lists(_LINE, max_size=12).map(lambda lines: b"\r\n".join(lines))


@given(_BODY, st.booleans(), st.lists(st.integers(0, 200), max_size=6))
def test_the_body_fed_in_any_pieces_hashes_as_dkimpy_canonicalises_it(body, crlf, cuts):
    body += b"\r\n" if crlf else b""
    hasher = RelaxedBody()
    last = 0
    for cut in sorted(min(c, len(body)) for c in cuts):
        hasher.feed(body[last:cut])
        last = cut
    hasher.feed(body[last:])
    assert hasher.digest() == hashlib.sha256(Relaxed.canonicalize_body(body)).digest()


def test_ed25519_signs_the_sha256_of_the_header_data_as_rfc_8463_a_3_does():
    # RFC 8463 A.2's key and A.3's signed message: the signature is reproduced octet for
    # octet (Ed25519 is deterministic), so the digest, not the data, is what is signed.
    seed = base64.b64decode("nWGxne/9WmC6hEr0kuwsxERJxWl7MmkZcDusAxyuf2A=")
    fields = [
        b"From: Joe SixPack <joe@football.example.com>",
        b"To: Suzie Q <suzie@shopping.example.net>",
        b"Subject: Is dinner ready?",
        b"Date: Fri, 11 Jul 2003 21:00:37 -0700 (PDT)",
        b"Message-ID: <20030712040037.46341.5F8J@football.example.com>",
    ]
    signature = (
        b"DKIM-Signature: v=1; a=ed25519-sha256; c=relaxed/relaxed;\r\n"
        b" d=football.example.com; i=@football.example.com;\r\n"
        b" q=dns/txt; s=brisbane; t=1528637909; h=from : to :\r\n"
        b" subject : date : message-id : from : subject : date;\r\n"
        b" bh=2jUSOH9NhtVGCQWNr9BrIAPreKQjO6Sn7XIkfJVOzv8=;\r\n"
        b" b="
    )
    data = b"".join(map(relaxed_field, fields)) + relaxed_field(signature)[:-2]
    key = ed25519.Ed25519PrivateKey.from_private_bytes(seed)
    expected = (
        "/gCrinpcQOoIfuHNQIbq4pgh9kyIK3AQUdt9OdqQehSwhEIug4D11BusFa3bT3FY5OsU7ZbnKELq+eXdp1Q1Dw=="
    )
    assert base64.b64encode(sign_digest(key, hashlib.sha256(data).digest())).decode() == expected


# -- signatures dkimpy verifies ----------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["rsa-sha256", "ed25519-sha256"])
def test_a_signature_verifies_with_dkimpy(algorithm):
    key = signing_key(algorithm=algorithm)
    message = signed(Signer({"example.com": (key,)}))
    assert message.startswith(b"DKIM-Signature: v=1; a=" + algorithm.encode())
    assert verify_all(message, records(key)) == [True]
    tampered = message.replace(b"hello  world", b"hello world!")
    assert verify_all(tampered, records(key)) == [False]


def test_two_keys_give_two_signatures_each_valid_alone():
    rsa_key, ed_key = signing_key(selector="r"), signing_key("example.com", "e", "ed25519-sha256")
    message = signed(Signer({"example.com": (rsa_key, ed_key)}))
    assert message.count(b"DKIM-Signature:") == 2
    assert verify_all(message, records(rsa_key, ed_key)) == [True, True]
    assert verify_all(message, records(ed_key)) == [False, True]  # no RSA record published


def test_a_signature_made_in_two_steps_is_the_one_made_at_once():
    """prepare() leaves placeholders as long as the values (the size is final at once);
    fill() makes them where they are, as sign() does."""
    keys = (signing_key(selector="r"), signing_key("example.com", "e", "ed25519-sha256"))
    signer = Signer({"example.com": keys})
    presigned = signer.prepare(MESSAGE, 1_700_000_000)
    assert presigned is not None and [p.key_id for p in presigned.pending] == [
        key.key_id for key in keys
    ]
    private = {key.key_id: key.private for key in keys}
    filled = fill(presigned.fields, presigned.pending, private)
    assert len(filled) == len(presigned.fields)
    assert filled + presigned.content == signed(signer)
    assert verify_all(filled + presigned.content, records(*keys)) == [True, True]


def test_a_signature_is_never_made_where_its_placeholder_is_not():
    key = signing_key()
    presigned = Signer({"example.com": (key,)}).prepare(MESSAGE, 1_700_000_000)
    assert presigned is not None
    (pending,) = presigned.pending
    moved = msgspec.structs.replace(pending, offset=pending.offset - 1)
    with pytest.raises(ValueError, match="no signature placeholder"):
        fill(presigned.fields, [moved], {key.key_id: key.private})
    with pytest.raises(KeyError):
        fill(presigned.fields, [pending], {})


def test_from_is_oversigned_so_that_a_second_from_breaks_the_signature():
    key = signing_key()
    message = signed(Signer({"example.com": (key,)}))
    assert re.search(rb"h=from:from:", message)
    added = message.replace(b"Subject:", b"From: evil@attacker.test\r\nSubject:", 1)
    assert verify_all(added, records(key)) == [False]


def test_the_signature_survives_what_relaxed_canonicalisation_allows():
    key = signing_key()
    message = signed(Signer({"example.com": (key,)}))
    refolded = message.replace(b"Subject:  hello   there ", b"subject: hello\r\n there")
    assert verify_all(refolded.replace(b"world \r\n", b"world\r\n"), records(key)) == [True]


def test_every_line_of_the_signature_field_is_short():
    message = signed(Signer({"example.com": (signing_key(),)}))
    field = message[: message.index(b"\r\nReceived:")]
    assert all(len(line) <= 78 for line in field.split(b"\r\n"))


def test_only_the_configured_headers_are_signed(tmp_path):
    key_file = write_key(tmp_path, "rsa-sha256")
    text = f'[dkim."example.com"]\nselector = "s1"\nkey_file = "{key_file}"\n'
    text += 'headers = ["From", "Subject"]\n'
    (tmp_path / "c.toml").write_text(text)
    keys = load_keys(load(str(tmp_path / "c.toml")).dkim)
    message = signed(Signer(keys))
    assert b"h=from:from:subject;" in message
    key = keys["example.com"][0]
    assert verify_all(message.replace(b"To: a@", b"To: z@"), records(key)) == [True]


# -- which mail is signed, with which key --------------------------------------------------


def test_a_from_in_a_subdomain_is_signed_by_the_parent_domains_key():
    key = signing_key()
    content = MESSAGE.replace(b"app@example.com", b"app@mail.Example.COM")
    message = signed(Signer({"example.com": (key,)}), content)
    assert b"d=example.com; s=s1;" in message
    assert verify_all(message, records(key)) == [True]


def test_mail_from_a_domain_without_a_key_is_not_signed():
    signer = Signer({"example.com": (signing_key(),)})
    for sender in (b"app@example.org", b"app@notexample.com", b"undisclosed-recipients:;"):
        content = MESSAGE.replace(b"app@example.com", sender)
        assert not signer.keys_for_content(content) and signer.sign(content, 0) is None
    assert not signer.keys_for_content(MESSAGE.replace(b"From:", b"Sender:"))  # no From


@pytest.mark.parametrize(
    ("value", "domain"),
    [
        (b"<a@B.example>", "b.example"),
        (b" a@b.example ", "b.example"),
        (b"=?utf-8?q?J=C3=B6rg?= <a@sub.b.example.>", "sub.b.example"),
        (b'"Eve <e@evil.example>" <a@b.example>', "b.example"),  # not the quoted one
        (b"a@b.example (Alice <x@y.example>)", "b.example"),
        (b"Bob <a@b.example>, c@d.example", "b.example"),  # the first mailbox
        (b"undisclosed", ""),
    ],
)
def test_the_from_domain(value, domain):
    assert from_domain([(b"from", b"From:" + value)]) == domain


def test_content_a_hop_would_convert_is_converted_before_it_is_signed():
    key = signing_key()
    eight_bit = MESSAGE.replace(b"hello  world", "grüße".encode() + b" " + b"x" * 1200)
    fields, content = Signer({"example.com": (key,)}).sign(eight_bit, 0)
    assert content.isascii() and b"Content-Transfer-Encoding: quoted-printable" in content
    # No hop changes it now, with or without 8BITMIME: the signature stays valid.
    for eightbitmime in (False, True):
        assert prepare(content, eightbitmime=eightbitmime) == Prepared(content, False)
    assert verify_all(fields + content, records(key)) == [True]


def test_8bit_headers_keep_their_8_bits_when_signed():
    key = signing_key()
    utf8 = MESSAGE.replace(b"Subject:  hello", "Subject: grüße".encode())
    fields, content = Signer({"example.com": (key,)}).sign(utf8, 0)
    assert content == utf8  # SMTPUTF8 mail: it only ever goes to 8-bit hops, as it is
    assert verify_all(fields + content, records(key)) == [True]


def test_a_streamed_message_signed_as_it_is_fed_equals_one_signed_whole():
    signer = Signer({"example.com": (signing_key(algorithm="ed25519-sha256"),)})
    end = MESSAGE.index(b"\r\n\r\n") + 2
    streaming = signer.stream(MESSAGE[:end], 1_700_000_000)
    assert streaming is not None
    for i in range(0, len(MESSAGE), 7):
        streaming.feed(MESSAGE[i : i + 7])
    assert streaming.fields() + MESSAGE == signed(signer)
    assert signer.stream(MESSAGE[:end].replace(b"example.com", b"other.test"), 0) is None


# -- the key files and the records ---------------------------------------------------------


def config_with_key(tmp_path: Path, key_file: Path | str, algorithm: str = "rsa-sha256"):
    text = f'[dkim."Example.com"]\nselector = "s1"\nkey_file = "{key_file}"\n'
    text += f'algorithm = "{algorithm}"\n'
    (tmp_path / "c.toml").write_text(text)
    return load(str(tmp_path / "c.toml")).dkim


def test_the_records_publish_the_public_keys(tmp_path):
    key_file = write_key(tmp_path, "ed25519-sha256")
    (key,) = load_keys(config_with_key(tmp_path, key_file, "ed25519-sha256"))["example.com"]
    public = private_key("ed25519-sha256").public_key().public_bytes_raw()
    assert key.record() == f"v=DKIM1; k=ed25519; p={base64.b64encode(public).decode()}"
    assert key.record_name == "s1._domainkey.example.com"
    rsa_record = signing_key().record()
    assert rsa_record.startswith("v=DKIM1; k=rsa; p=MIIBIjANBgkqhkiG9w0BAQEFAAOCAQ8AMIIBCgKCAQEA")


@pytest.mark.parametrize(
    ("problem", "message"),
    [
        ("missing", 'dkim."Example.com".key_file: cannot read .*missing.pem: No such file'),
        ("not pem", 'dkim."Example.com".key_file: .* is not an unencrypted PEM key'),
        ("encrypted", 'dkim."Example.com".key_file: .* is not an unencrypted PEM key'),
        ("ed25519 for rsa", r"dkim.\"Example.com\".key_file: an Ed25519 key, but algorithm is"),
        ("small rsa", r"dkim.\"Example.com\".key_file: a 768-bit RSA key; verifiers refuse"),
    ],
)
def test_a_key_file_that_cannot_sign_is_refused_naming_the_key(tmp_path, problem, message):
    from cryptography.hazmat.primitives import serialization

    path = tmp_path / "key.pem"
    if problem == "missing":
        path = tmp_path / "missing.pem"
    elif problem == "not pem":
        path.write_text("hello\n")
    elif problem == "encrypted":
        encryption = serialization.BestAvailableEncryption(b"secret")
        path.write_bytes(
            private_key("rsa-sha256").private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption
            )
        )
    elif problem == "ed25519 for rsa":
        path.write_bytes(pem(private_key("ed25519-sha256")))
    else:  # cryptography makes no keys this small; OpenSSL's command still does
        small = ["openssl", "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:768"]
        path.write_bytes(subprocess.run(small, capture_output=True, check=True).stdout)
    with pytest.raises(ConfigError, match="^" + message):
        load_keys(config_with_key(tmp_path, path))
