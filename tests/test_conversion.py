"""Content made legal for a hop (mtaqueue.conversion): pure, bytes in, bytes out."""

from __future__ import annotations

import base64
import binascii
import email
import email.policy

from hypothesis import given, settings
from hypothesis import strategies as st

from mtaqueue.conversion import MAX_LINE, Prepared, Refused, prepare


def crlf(text: str) -> bytes:
    return text.replace("\n", "\r\n").encode()


def lines_of(data: bytes) -> list[bytes]:
    return data.split(b"\r\n")


def legal(data: bytes, *, seven_bit: bool) -> bool:
    """What a hop may receive: CRLF lines of at most 998 octets, no NUL; 7-bit if asked."""
    ok = b"\0" not in data and all(
        len(line) <= MAX_LINE and b"\r" not in line and b"\n" not in line for line in lines_of(data)
    )
    return ok and (data.isascii() or not seven_bit)


def leaves(data: bytes) -> list[tuple[str, bytes]]:
    """Every leaf part's media type and decoded content, as a mail reader sees them."""
    message = email.message_from_bytes(data, policy=email.policy.compat32)
    return [
        (part.get_content_type(), part.get_payload(decode=True))
        for part in message.walk()
        if not part.is_multipart()
    ]


def unfold(header: bytes) -> bytes:
    return header.replace(b"\r\n ", b" ").replace(b"\r\n\t", b"\t")


# -- nothing to do ----------------------------------------------------------------------------


def test_legal_content_goes_byte_for_byte():
    plain = crlf("Subject: hi\nFrom: a@example.org\n\nhello\n")
    assert prepare(plain, eightbitmime=False) == Prepared(plain, eight_bit=False)
    utf8 = crlf("Subject: h\u00e9\n\nh\u00e9llo\n")
    # 8-bit, headers included, goes as it is to a hop with 8BITMIME, which the sender says.
    assert prepare(utf8, eightbitmime=True) == Prepared(utf8, eight_bit=True)


# -- 8-bit for a 7-bit hop ----------------------------------------------------------------------


def test_8bit_mime_part_becomes_quoted_printable_in_place():
    original = crlf(
        "Subject: two\nMIME-Version: 1.0\nContent-Transfer-Encoding: 8bit\n"
        "Content-Type: text/plain; charset=utf-8\n\nh\u00e9llo =x\n"
    )
    out = prepare(original, eightbitmime=False)
    assert out.content == crlf(
        "Subject: two\nMIME-Version: 1.0\nContent-Transfer-Encoding: quoted-printable\n"
        "Content-Type: text/plain; charset=utf-8\n\nh=C3=A9llo =3Dx\n"
    )
    assert not out.eight_bit
    assert leaves(out.content) == leaves(original)


def test_a_non_mime_8bit_message_becomes_mime():
    # Postfix sends this one raw to a 7-bit hop; RFC 6152 asks for a conversion.
    original = crlf("Subject: one\n\nh\u00e9llo\n")
    out = prepare(original, eightbitmime=False)
    assert out.content == crlf(
        "Subject: one\nMIME-Version: 1.0\nContent-Type: text/plain; charset=utf-8\n"
        "Content-Transfer-Encoding: quoted-printable\n\nh=C3=A9llo\n"
    )
    latin1 = b"Subject: one\r\n\r\nh\xe9llo\r\n"  # not UTF-8: RFC 1428's label
    assert b"charset=unknown-8bit" in prepare(latin1, eightbitmime=False).content


def test_multipart_converts_only_the_parts_that_need_it():
    plain_part = "Content-Type: text/plain\n\nplain ascii\n"
    original = crlf(
        'MIME-Version: 1.0\nContent-Type: multipart/mixed; boundary="BB"\n'
        "Content-Transfer-Encoding: 8bit\n\npreamble\n"
        f"--BB\n{plain_part}--BB\nContent-Type: text/plain; charset=utf-8\n\n\u00fcber\n"
        "--BB--\nepilogue\n"
    )
    out = prepare(original, eightbitmime=False)
    assert out.content.isascii()
    assert crlf(f"--BB\n{plain_part}--BB\n") in out.content  # byte for byte
    assert b"Content-Transfer-Encoding: 7bit\r\n" in out.content  # the container says so
    assert b"\r\n=C3=BCber\r\n--BB--\r\nepilogue\r\n" in out.content
    assert leaves(out.content) == leaves(original)


def test_message_rfc822_is_converted_inside():
    original = crlf(
        'MIME-Version: 1.0\nContent-Type: multipart/mixed; boundary="CC"\n\n'
        "--CC\nContent-Type: message/rfc822\n\nSubject: inner\nMIME-Version: 1.0\n"
        "Content-Transfer-Encoding: 8bit\n\nin\u00f1er\n--CC--\n"
    )
    out = prepare(original, eightbitmime=False)
    assert b"Content-Transfer-Encoding: quoted-printable\r\n\r\nin=C3=B1er\r\n--CC--" in (
        out.content
    )
    assert leaves(out.content) == leaves(original)


def test_what_cannot_be_converted_is_refused_with_5_6_3():
    header8 = crlf("Subject: s\u00e9ven\n\nplain\n")
    refused = prepare(header8, eightbitmime=False)
    assert isinstance(refused, Refused) and refused.status == "5.6.3"
    assert "header (Subject)" in refused.reason
    partial = crlf("MIME-Version: 1.0\nContent-Type: message/partial; id=x; number=1\n\n\u00e9\n")
    assert isinstance(prepare(partial, eightbitmime=False), Refused)
    uuencoded = crlf(f"MIME-Version: 1.0\nContent-Transfer-Encoding: x-uuencode\n\n{'M' * 1200}\n")
    assert isinstance(prepare(uuencoded, eightbitmime=True), Refused)


# -- long lines ---------------------------------------------------------------------------------


def test_a_long_body_line_becomes_quoted_printable_even_for_an_8bit_hop():
    original = crlf(f"Subject: html\n\n<p>{'x' * 3000}</p>\nshort\n")
    out = prepare(original, eightbitmime=True)
    assert max(map(len, lines_of(out.content))) == 76
    assert b"MIME-Version: 1.0\r\nContent-Transfer-Encoding: quoted-printable\r\n" in out.content
    assert leaves(out.content) == leaves(original)


def test_a_long_header_is_folded_at_whitespace_and_unfolds_to_the_original():
    to = "To: " + ", ".join(f"user{i}@example.org" for i in range(1001))  # swaks' case
    original = crlf(f"Subject: many\n{to}\n\nbody\n")
    out = prepare(original, eightbitmime=False).content
    header = out.split(b"\r\n\r\n")[0]
    assert max(map(len, lines_of(header))) <= 78
    assert unfold(header) == crlf(f"Subject: many\n{to}")
    assert out.endswith(b"\r\n\r\nbody\r\n")  # the body is legal: untouched


def test_a_long_header_without_whitespace_is_broken_as_postfix_does():
    original = crlf(f"X-Long: {'y' * 1500}\n\nbody\n")
    out = prepare(original, eightbitmime=True).content
    # Postfix 3.7 (smtp_line_length_limit = 998) sends the same two lines.
    assert out == crlf(f"X-Long: {'y' * 990}\n {'y' * 510}\n\nbody\n")


def test_a_hard_break_never_splits_a_utf8_character():
    value = "\u00e9" * 800
    original = f"X-Long: {value}\r\n\r\nbody\r\n".encode()
    out = prepare(original, eightbitmime=True).content
    first, second = lines_of(out)[:2]
    assert len(first) <= MAX_LINE
    assert (first + second[1:]).decode() == f"X-Long: {value}"


def test_encoded_parts_are_rewrapped_not_reencoded():
    data = bytes(range(256)) * 8
    b64 = base64.b64encode(data).decode()  # one 2732-character line
    qp = binascii.b2a_qp(data, istext=False).replace(b"=\n", b"").decode()
    # (The CRLF ending the quoted-printable is a line break of the content.)
    for cte, body, decoded in (("base64", b64, data), ("quoted-printable", qp, data + b"\r\n")):
        original = crlf(f"MIME-Version: 1.0\nContent-Transfer-Encoding: {cte}\n\n{body}\n")
        out = prepare(original, eightbitmime=False).content
        assert legal(out, seven_bit=True)
        assert leaves(out) == leaves(original) == [("text/plain", decoded)]


def test_no_encoded_line_looks_like_a_boundary():
    # A soft line break could put "--BB" at the start of a line, where it would end the part.
    long_line = "x" * 74 + "--BB" + "-" * 300
    original = crlf(
        'MIME-Version: 1.0\nContent-Type: multipart/mixed; boundary="BB"\n\n'
        f"--BB\n\n{long_line}\n--BB--\n"
    )
    out = prepare(original, eightbitmime=True).content
    assert [line for line in lines_of(out) if line.startswith(b"--")] == [b"--BB", b"--BB--"]
    assert leaves(out) == leaves(original)


def test_nul_and_bare_line_ends_are_encoded():
    original = b"Subject: x\r\n\r\na\0b\rc\nd\r\n"
    out = prepare(original, eightbitmime=True).content
    assert out.endswith(b"\r\n\r\na=00b=0Dc=0Ad\r\n")
    assert binascii.a2b_qp(out.split(b"\r\n\r\n", 1)[1]) == b"a\0b\rc\nd\r\n"


# -- properties ---------------------------------------------------------------------------------

# Words of ASCII, 8-bit and dashes (a "--" inside a long line must not become a delimiter).
_WORDS = st.sampled_from(["word", "\u00e9t\u00e9", "--", "-", "=", " ", "\t", ".", "x" * 40])
_LINE = st.lists(_WORDS, max_size=80).map("".join).filter(lambda s: not s.startswith("--"))
_BODY = st.lists(_LINE, max_size=6).map(lambda lines: "".join(f"{line}\n" for line in lines))


@st.composite
def leaf(draw) -> str:
    ctype = draw(st.sampled_from(["", "text/plain; charset=utf-8", "text/html", "image/png"]))
    cte = draw(st.sampled_from(["", "7bit", "8bit", "binary", "quoted-printable", "base64"]))
    body = draw(_BODY)
    if cte == "quoted-printable":  # valid, but with its lines as long as they come
        raw = binascii.b2a_qp(body.encode(), istext=False).replace(b"=\n", b"")
        body = raw.decode()
    elif cte == "base64":
        body = base64.b64encode(body.encode()).decode()
        if draw(st.booleans()):
            body = "\n".join(body[i : i + 76] for i in range(0, len(body), 76))
        body += "\n"
    header = f"Content-Type: {ctype}\n" if ctype else ""
    header += f"Content-Transfer-Encoding: {cte}\n" if cte else ""
    return header + "\n" + body


@st.composite
def entity(draw, depth: int = 0) -> str:
    kind = draw(st.sampled_from(["leaf", "multipart", "rfc822"] if depth < 3 else ["leaf"]))
    if kind == "leaf":
        return draw(leaf())
    if kind == "rfc822":
        inner = draw(entity(depth + 1))
        return f"Content-Type: message/rfc822\n\nSubject: inner\nMIME-Version: 1.0\n{inner}"
    boundary = f"b{depth}=_{draw(st.integers(0, 999))}"
    parts = draw(st.lists(entity(depth + 1), min_size=1, max_size=3))
    body = "".join(f"--{boundary}\n{part}" for part in parts)
    return (
        f'Content-Type: multipart/mixed; boundary="{boundary}"\n\n'
        f"{draw(_LINE)}\n{body}--{boundary}--\n{draw(_LINE)}\n"
    )


@st.composite
def messages(draw) -> bytes:
    subject = draw(st.lists(_WORDS.filter(lambda w: w.isascii()), max_size=300).map("".join))
    top = f"Subject: x{subject}\nFrom: a@example.org\nMIME-Version: 1.0\n{draw(entity())}"
    return crlf(top)


@settings(max_examples=300)
@given(messages(), st.booleans())
def test_converted_content_is_legal_and_reads_the_same(original, eightbitmime):
    out = prepare(original, eightbitmime=eightbitmime)
    assert isinstance(out, Prepared)  # ASCII headers: always possible
    assert legal(out.content, seven_bit=not eightbitmime)
    assert out.eight_bit == (not out.content.isascii())
    assert leaves(out.content) == leaves(original)
    if legal(original, seven_bit=not eightbitmime):
        assert out.content is original


@given(st.binary(max_size=3000), st.booleans())
def test_any_input_is_made_legal_or_refused(data, eightbitmime):
    out = prepare(data, eightbitmime=eightbitmime)
    if isinstance(out, Prepared):
        assert legal(out.content, seven_bit=not eightbitmime)
    else:
        assert out.status == "5.6.3" and out.reason
