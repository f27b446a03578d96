"""The sans-IO SMTP server session, driven with the bytes a client would send."""

from __future__ import annotations

import base64
import re
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtaqueue.smtp import data_reader
from mtaqueue.smtp.actions import CheckCredentials, Finish, StartTLS, Write
from mtaqueue.smtp.content import has_line_over
from mtaqueue.smtp.data_reader import STREAM_PIECE
from mtaqueue.smtp.server_session import MAX_COMMAND_LINE, MAX_ERRORS, ServerSession
from mtaqueue.smtp.session_settings import SessionSettings
from mtaqueue.transaction import Stream, Submit

HOST = "mx.test"
QUEUED = "250 2.0.0 Ok: queued as 0123456789ABC"
ENVELOPE = b"MAIL FROM:<app@sender.example>\r\nRCPT TO:<user@rcpt.example>\r\nDATA\r\n"
BARE = re.compile(rb"\r(?!\n)|(?<!\r)\n")


def make(
    *,
    max_message_size: int = 100_000,
    max_recipients: int = 100,
    may_relay: bool = True,
    storage_refusal=None,
    **options,
) -> ServerSession:
    settings_ = SessionSettings(HOST, max_message_size, max_recipients, **options)
    return ServerSession(settings_, may_relay=may_relay, storage_refusal=storage_refusal)


def send(session: ServerSession, data: bytes):
    """Feed bytes; return (action, reply lines written)."""
    action = session.receive(data)
    return action, lines(session)


def lines(session: ServerSession) -> list[str]:
    out = session.take_output()
    if not out:
        return []
    assert out.endswith(b"\r\n")
    return out.decode("utf-8", "surrogateescape").split("\r\n")[:-1]


def codes(replies: list[str]) -> list[str]:
    return [r[:3] for r in replies]


def ready(**kwargs) -> ServerSession:
    """A session that has been greeted with EHLO."""
    session = make(**kwargs)
    _, replies = send(session, b"EHLO client.example\r\n")
    assert replies[-1].startswith("250 ")
    return session


def transaction(session: ServerSession, body: bytes, envelope: bytes = ENVELOPE) -> Submit:
    """Run MAIL/RCPT/DATA with the already dot-stuffed body (without the final dot)."""
    action, replies = send(session, envelope + body + b".\r\n")
    assert isinstance(action, Submit), replies
    assert replies[-1].startswith("354 ")
    return action


def drive(session: ServerSession, chunks, reply: str = QUEUED):
    """Feed chunks, resuming every Submit at once; return (actions, all output)."""
    actions = []
    out = bytearray()
    for chunk in chunks:
        action = session.receive(chunk)
        out += session.take_output()
        while action is not None:
            actions.append(action)
            action = session.resume(reply)
            out += session.take_output()
    return actions, bytes(out)


def dot_stuff(content: bytes) -> bytes:
    """What a client does with CRLF-terminated content before sending it."""
    stuffed = b"\r\n" + content
    return stuffed.replace(b"\r\n.", b"\r\n..")[2:]


# -- greeting, EHLO, simple commands -------------------------------------------


def test_greeting_names_the_host():
    assert make().greeting() == b"220 mx.test ESMTP mtaqueue\r\n"


def test_ehlo_keywords():
    session = make(max_message_size=12345)
    action, replies = send(session, b"EHLO client.example\r\n")
    assert action is None
    assert replies[0] == "250-mx.test"
    assert all(r.startswith("250-") for r in replies[:-1])
    assert replies[-1].startswith("250 ")
    keywords = [r[4:] for r in replies[1:]]
    assert keywords == [
        "PIPELINING",
        "SIZE 12345",
        "8BITMIME",
        "SMTPUTF8",
        "DSN",
        "ENHANCEDSTATUSCODES",
    ]
    assert session.helo == "client.example"
    assert session.esmtp


def test_ehlo_offers_starttls_only_when_available_and_not_yet_tls():
    session = make(tls_available=True, auth_available=True)
    _, replies = send(session, b"EHLO c\r\n")
    keywords = [r[4:] for r in replies]
    assert "STARTTLS" in keywords
    assert not any(k.startswith("AUTH") for k in keywords)  # AUTH only after TLS
    assert replies[-1] == "250 STARTTLS"

    action, replies = send(session, b"STARTTLS\r\n")
    assert isinstance(action, StartTLS)
    assert session.resume(True) is None
    _, replies = send(session, b"EHLO c\r\n")
    keywords = [r[4:] for r in replies]
    assert "STARTTLS" not in keywords
    assert "AUTH PLAIN LOGIN" in keywords


def test_ehlo_without_tls_or_auth_configured():
    _, replies = send(make(auth_available=True), b"EHLO c\r\n")
    keywords = [r[4:] for r in replies]
    assert "STARTTLS" not in keywords
    assert not any(k.startswith("AUTH") for k in keywords)


def test_helo():
    session = make()
    action, replies = send(session, b"HELO client.example\r\n")
    assert action is None
    assert replies == ["250 mx.test"]
    assert session.helo == "client.example"
    assert not session.esmtp


@pytest.mark.parametrize("verb", [b"EHLO", b"HELO"])
def test_helo_needs_an_argument(verb):
    session = make()
    _, replies = send(session, verb + b"\r\n")
    assert replies[0].startswith("501 5.5.4")
    assert session.helo == ""


def test_commands_are_case_insensitive():
    session = make()
    _, replies = send(session, b"ehlo c\r\nmail from:<a@b.example>\r\nrcpt to:<c@d.example>\r\n")
    assert codes(replies)[-2:] == ["250", "250"]


@pytest.mark.parametrize(
    "command",
    [b"MAIL FROM:<a@b.example>\r\n", b"RCPT TO:<c@d.example>\r\n", b"DATA\r\n"],
)
def test_commands_before_helo(command):
    session = make()
    _, replies = send(session, command)
    assert replies[0].startswith("503 5.5.1")


def test_unknown_command():
    session = make()
    _, replies = send(session, b"EXPN staff\r\nFOO\r\n\r\n")
    assert replies == ["502 5.5.1 Error: command not recognized"] * 3


def test_noop_vrfy_help_before_helo():
    session = make()
    _, replies = send(session, b"NOOP\r\nVRFY user\r\nHELP\r\nRSET\r\n")
    assert codes(replies) == ["250", "252", "214", "250"]
    assert replies[0] == "250 2.0.0 Ok"


def test_rset_clears_the_transaction():
    session = ready()
    _, replies = send(session, b"MAIL FROM:<a@b.example>\r\nRCPT TO:<c@d.example>\r\nRSET\r\n")
    assert codes(replies) == ["250", "250", "250"]
    assert session.envelope is None
    _, replies = send(session, b"RCPT TO:<c@d.example>\r\nDATA\r\n")
    assert [r[:9] for r in replies] == ["503 5.5.1", "503 5.5.1"]
    # ...and a new MAIL is not "nested".
    _, replies = send(session, b"MAIL FROM:<a@b.example>\r\n")
    assert replies == ["250 2.1.0 Ok"]


def test_nested_mail():
    session = ready()
    _, replies = send(session, b"MAIL FROM:<a@b.example>\r\nMAIL FROM:<x@b.example>\r\n")
    assert codes(replies) == ["250", "503"]
    assert session.envelope.sender == "a@b.example"


def test_data_needs_recipients_and_no_argument():
    session = ready()
    _, replies = send(session, b"MAIL FROM:<a@b.example>\r\nDATA\r\n")
    assert replies[-1].startswith("554 5.5.1")
    _, replies = send(session, b"RCPT TO:<c@d.example>\r\nDATA now\r\n")
    assert replies[-1].startswith("501 5.5.4")
    assert not session.in_data


def test_quit_closes_and_ignores_the_rest():
    session = ready()
    action, replies = send(session, b"QUIT\r\nNOOP\r\n")
    assert action is None
    assert replies == ["221 2.0.0 Bye"]
    assert session.closed
    assert session.receive(b"NOOP\r\n") is None
    assert session.take_output() == b""


def test_timeout_and_shutdown_replies():
    session = ready()
    session.timeout()
    assert lines(session) == ["421 4.4.2 mx.test Error: timeout exceeded"]
    assert session.closed
    session = ready()
    session.shutting_down()
    assert lines(session)[0].startswith("421 4.3.2 mx.test")
    assert session.closed


def test_bare_lf_command_lines_are_accepted():
    session = make()
    _, replies = send(session, b"EHLO c\nNOOP\n")
    assert codes(replies)[-1] == "250"
    assert replies[-1] == "250 2.0.0 Ok"


# -- a full transaction ---------------------------------------------------------


def test_full_transaction():
    session = ready()
    action, replies = send(session, b"MAIL FROM:<app@sender.example>\r\n")
    assert (action, replies) == (None, ["250 2.1.0 Ok"])
    action, replies = send(session, b"RCPT TO:<user@rcpt.example>\r\n")
    assert (action, replies) == (None, ["250 2.1.5 Ok"])
    action, replies = send(session, b"RCPT TO:<other@rcpt.example>\r\n")
    assert (action, replies) == (None, ["250 2.1.5 Ok"])
    action, replies = send(session, b"DATA\r\n")
    assert action is None
    assert replies == ["354 End data with <CR><LF>.<CR><LF>"]
    assert session.in_data and session.busy
    action, replies = send(session, b"Subject: hi\r\n\r\nHello\r\n..dot\r\n")
    assert (action, replies) == (None, [])
    action, replies = send(session, b".\r\n")
    assert isinstance(action, Submit)
    assert replies == []  # the 250 comes with resume()
    assert session.busy and not session.in_data
    assert action.content == b"Subject: hi\r\n\r\nHello\r\n.dot\r\n"
    assert action.envelope.sender == "app@sender.example"
    assert [r.address for r in action.envelope.recipients] == [
        "user@rcpt.example",
        "other@rcpt.example",
    ]
    assert action.envelope.body == "7BIT"
    assert not action.envelope.smtputf8
    assert action.envelope.envid is None and action.envelope.ret is None
    assert action.helo == "client.example"
    assert action.user is None

    assert session.resume(QUEUED) is None
    assert lines(session) == [QUEUED]
    assert not session.busy
    assert session.envelope is None


def test_resume_writes_whatever_reply_it_is_given():
    session = ready()
    transaction(session, b"x\r\n")
    session.resume("451 4.3.0 Temporary storage failure, try again later")
    assert lines(session) == ["451 4.3.0 Temporary storage failure, try again later"]
    # The transaction is over either way.
    _, replies = send(session, b"RCPT TO:<c@d.example>\r\n")
    assert replies[0].startswith("503")


def test_second_transaction_on_the_same_session():
    session = ready()
    first = transaction(session, b"first\r\n")
    session.resume(QUEUED)
    lines(session)
    second = transaction(
        session,
        b"second\r\n",
        b"MAIL FROM:<b@sender.example>\r\nRCPT TO:<z@rcpt.example>\r\nDATA\r\n",
    )
    assert second.content == b"second\r\n"
    assert second.envelope.sender == "b@sender.example"
    assert [r.address for r in second.envelope.recipients] == ["z@rcpt.example"]
    # The first envelope is not shared with or changed by the second.
    assert first.content == b"first\r\n"
    assert first.envelope.sender == "app@sender.example"
    assert [r.address for r in first.envelope.recipients] == ["user@rcpt.example"]
    session.resume(QUEUED)
    assert lines(session) == [QUEUED]


def test_empty_message():
    session = ready()
    assert transaction(session, b"").content == b""


def test_message_whose_first_line_starts_with_a_dot():
    session = ready()
    assert transaction(session, b"..hidden\r\nnext\r\n").content == b".hidden\r\nnext\r\n"


def test_lone_dot_lines_inside_the_body():
    session = ready()
    body = dot_stuff(b".\r\n..\r\nx\r\n.\r\n")
    assert body == b"..\r\n...\r\nx\r\n..\r\n"
    assert transaction(session, body).content == b".\r\n..\r\nx\r\n.\r\n"


def test_leading_dot_is_removed_from_any_line():
    # "\r\n." followed by anything but "\r\n" is not the end of the data.
    session = ready()
    submit = transaction(session, b"a\r\n.x\r\n. \r\n.\t\r\n")
    assert submit.content == b"a\r\nx\r\n \r\n\t\r\n"


def test_eight_bit_content_passes_unchanged():
    session = ready()
    body = "Subject: café\r\n\r\nnaïve ünïcödé\r\n".encode() + b"\xff\xfe raw\r\n"
    action, _ = send(
        session,
        b"MAIL FROM:<a@b.example> BODY=8BITMIME\r\nRCPT TO:<c@d.example>\r\nDATA\r\n"
        + body
        + b".\r\n",
    )
    assert isinstance(action, Submit)
    assert action.content == body
    assert action.envelope.body == "8BITMIME"


def test_whole_conversation_at_every_split_point():
    content = b"Subject: split\r\n\r\n.leading dot\r\nline\r\n\r\n.\r\nend\r\n"
    wire = b"EHLO c\r\n" + ENVELOPE + dot_stuff(content) + b".\r\nNOOP\r\nQUIT\r\n"
    for cut in range(len(wire) + 1):
        actions, out = drive(make(), [wire[:cut], wire[cut:]])
        assert [a.content for a in actions] == [content], cut
        assert out.endswith(b"250 2.0.0 Ok\r\n221 2.0.0 Bye\r\n"), cut
    actions, out = drive(make(), [wire[i : i + 1] for i in range(len(wire))])
    assert [a.content for a in actions] == [content]
    assert out.count(QUEUED.encode()) == 1


_LINE = st.text(alphabet=st.sampled_from("ab. \t.x"), max_size=12).map(str.encode)


@settings(max_examples=200, deadline=None)
@given(
    body_lines=st.lists(_LINE, max_size=15),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=30),
)
def test_split_points_anywhere_give_the_same_submit(body_lines, cuts):
    content = b"".join(line + b"\r\n" for line in body_lines)
    wire = b"EHLO c\r\n" + ENVELOPE + dot_stuff(content) + b".\r\nQUIT\r\n"
    points = sorted({min(c, len(wire)) for c in cuts})
    chunks = [wire[a:b] for a, b in zip([0, *points], [*points, len(wire)], strict=True)]
    session = make()
    actions, out = drive(session, chunks)
    assert len(actions) == 1
    assert actions[0].content == content
    assert out.endswith(QUEUED.encode() + b"\r\n221 2.0.0 Bye\r\n")
    assert session.closed


_TOKENS = st.sampled_from(
    [
        b"EHLO c\r\n",
        b"MAIL FROM:<a@b.example>\r\n",
        b"RCPT TO:<c@d.example>\r\n",
        b"DATA\r\n",
        b"NOOP\r\n",
        b"RSET\r\n",
        b"BOGUS\r\n",
        b"\r\n.\r\n",
        b".\r\n",
        b"\r\n",
        b"\r",
        b"\n",
        b".",
        b"..",
        b"text",
        b"\xff",
    ]
)


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(_TOKENS, max_size=40), cuts=st.lists(st.integers(0, 600), max_size=20))
def test_any_byte_stream_is_handled_the_same_however_it_is_split(tokens, cuts):
    wire = b"".join(tokens)
    points = sorted({min(c, len(wire)) for c in cuts})
    chunks = [wire[a:b] for a, b in zip([0, *points], [*points, len(wire)], strict=True)]
    whole_actions, whole_out = drive(make(), [wire])
    split_actions, split_out = drive(make(), chunks)
    assert split_out == whole_out
    assert [(a.envelope, a.content) for a in split_actions] == [
        (a.envelope, a.content) for a in whole_actions
    ]


# -- pipelining --------------------------------------------------------------------


def test_pipelined_commands_get_replies_in_order():
    session = make()
    action, replies = send(
        session,
        b"EHLO c\r\nMAIL FROM:<a@b.example>\r\nRCPT TO:<c@d.example>\r\n"
        b"RCPT TO:<bad>\r\nRCPT TO:<e@f.example>\r\nDATA\r\n",
    )
    assert action is None
    assert codes(replies) == ["250"] * 7 + ["250", "250", "501", "250", "354"]
    assert replies[-5:-1] == ["250 2.1.0 Ok", "250 2.1.5 Ok", replies[-3], "250 2.1.5 Ok"]


def test_pipelined_transaction_and_data_in_one_receive():
    session = ready()
    action, replies = send(session, ENVELOPE + b"body\r\n.\r\nNOOP\r\n")
    assert isinstance(action, Submit)
    assert action.content == b"body\r\n"
    assert replies == ["250 2.1.0 Ok", "250 2.1.5 Ok", "354 End data with <CR><LF>.<CR><LF>"]
    # NOOP waits for the commit.
    assert session.resume(QUEUED) is None
    assert lines(session) == [QUEUED, "250 2.0.0 Ok"]


def test_input_while_submit_pending_waits_for_resume():
    session = ready()
    first = transaction(session, b"one\r\n")
    # A whole second transaction arrives while the first is being committed.
    action = session.receive(ENVELOPE.replace(b"app@", b"two@") + b"two\r\n.\r\n")
    assert action is None  # no duplicate Submit, nothing processed
    assert session.take_output() == b""
    assert session.receive(b"NOOP\r\n") is None
    assert session.take_output() == b""
    assert session.buffered > 0

    second = session.resume(QUEUED)
    assert isinstance(second, Submit)
    assert second is not first
    assert second.content == b"two\r\n"
    assert second.envelope.sender == "two@sender.example"
    assert lines(session) == [QUEUED, "250 2.1.0 Ok", "250 2.1.5 Ok", replies_354()]
    assert session.resume("250 2.0.0 Ok: queued as SECOND") is None
    assert lines(session) == ["250 2.0.0 Ok: queued as SECOND", "250 2.0.0 Ok"]
    assert session.buffered == 0


def replies_354() -> str:
    return "354 End data with <CR><LF>.<CR><LF>"


# -- MAIL parameters -----------------------------------------------------------------


def mail(session: ServerSession, arg: bytes) -> list[str]:
    return send(session, b"MAIL FROM:" + arg + b"\r\n")[1]


def submit_with(mail_arg: bytes, rcpt_arg: bytes = b"<c@d.example>") -> Submit:
    session = ready()
    action, replies = send(
        session,
        b"MAIL FROM:" + mail_arg + b"\r\nRCPT TO:" + rcpt_arg + b"\r\nDATA\r\nx\r\n.\r\n",
    )
    assert isinstance(action, Submit), replies
    return action


def test_size_over_limit_is_refused_at_mail():
    session = ready(max_message_size=1000)
    assert mail(session, b"<a@b.example> SIZE=1001") == [
        "552 5.3.4 Error: message size exceeds fixed limit"
    ]
    assert session.envelope is None
    assert mail(session, b"<a@b.example> SIZE=1000") == ["250 2.1.0 Ok"]


def test_size_must_be_a_number():
    assert mail(ready(), b"<a@b.example> SIZE=big")[0].startswith("501 5.5.4")


def test_body_8bitmime_and_7bit():
    assert submit_with(b"<a@b.example> BODY=8BITMIME").envelope.body == "8BITMIME"
    assert submit_with(b"<a@b.example> body=8bitmime").envelope.body == "8BITMIME"
    assert submit_with(b"<a@b.example> BODY=7BIT").envelope.body == "7BIT"
    assert mail(ready(), b"<a@b.example> BODY=BINARYMIME")[0].startswith("501 5.5.4")


def test_smtputf8_param():
    assert submit_with(b"<a@b.example> SMTPUTF8").envelope.smtputf8


@pytest.mark.parametrize(("value", "expected"), [(b"FULL", "FULL"), (b"hdrs", "HDRS")])
def test_ret(value, expected):
    assert submit_with(b"<a@b.example> RET=" + value).envelope.ret == expected


def test_envid_is_xtext_decoded_and_case_kept():
    envelope = submit_with(b"<a@b.example> ENVID=QQ314159+2BAbC+3Dz RET=HDRS").envelope
    assert envelope.envid == "QQ314159+AbC=z"
    assert envelope.ret == "HDRS"


def test_envid_length_limit():
    assert submit_with(b"<a@b.example> ENVID=" + b"e" * 100).envelope.envid == "e" * 100
    replies = mail(ready(), b"<a@b.example> ENVID=" + b"e" * 101)
    assert replies == ["501 5.5.4 Error: ENVID longer than 100 characters"]


def test_envid_invalid_xtext():
    assert mail(ready(), b"<a@b.example> ENVID=a+2b")[0].startswith("501 5.5.4")


@pytest.mark.parametrize("value", [b"+FF", b"a+C3", b"+ED+A0+80", b"+C0+AF"])
def test_envid_that_is_not_utf8_is_refused(value):
    # Kept as lone surrogates, it once made a record the spool could not encode.
    session = ready()
    replies = mail(session, b"<a@sender.test> ENVID=" + value)
    assert replies == ["501 5.5.4 Error: ENVID is not valid xtext: xtext does not decode to UTF-8"]
    assert session.envelope is None
    assert mail(session, b"<a@sender.test> ENVID=+C3+A9") == ["250 2.1.0 Ok"]  # UTF-8 "é"
    assert session.envelope.envid == "é"


@pytest.mark.parametrize("value", ["²", "1²", "\u0661\u0660"])  # the last: Arabic-Indic 10
def test_size_must_be_ascii_digits(value):
    # str.isdigit() says yes to "²", which int() refuses: that was an internal error.
    assert mail(ready(), b"<a@b.example> SIZE=" + value.encode())[0].startswith("501 5.5.4")


def test_auth_param_is_ignored():
    assert mail(ready(), b"<a@b.example> AUTH=<>") == ["250 2.1.0 Ok"]


def test_unknown_mail_param():
    assert mail(ready(), b"<a@b.example> FOO=bar") == [
        "555 5.5.4 Error: unsupported MAIL parameter FOO"
    ]


def test_mail_params_need_ehlo():
    session = make()
    send(session, b"HELO c\r\n")
    assert mail(session, b"<a@b.example> SIZE=10")[0].startswith("555 5.5.4")
    assert mail(session, b"<a@b.example>") == ["250 2.1.0 Ok"]
    _, replies = send(session, b"RCPT TO:<c@d.example> NOTIFY=NEVER\r\n")
    assert replies[0].startswith("555 5.5.4")


# -- RCPT parameters -------------------------------------------------------------------


def rcpt(arg: bytes) -> list[str]:
    session = ready()
    send(session, b"MAIL FROM:<a@b.example>\r\n")
    return send(session, b"RCPT TO:" + arg + b"\r\n")[1]


def test_notify_never():
    rcpt_ = submit_with(b"<a@b.example>", b"<c@d.example> NOTIFY=NEVER").envelope.recipients[0]
    assert rcpt_.notify == "NEVER"
    assert rcpt_.orcpt is None


def test_notify_list():
    recipient = submit_with(
        b"<a@b.example>", b"<c@d.example> NOTIFY=success,DELAY"
    ).envelope.recipients[0]
    assert recipient.notify == "SUCCESS,DELAY"


@pytest.mark.parametrize("value", [b"NEVER,SUCCESS", b"", b"SOMETIMES", b"SUCCESS,,DELAY"])
def test_notify_invalid(value):
    assert rcpt(b"<c@d.example> NOTIFY=" + value)[0].startswith("501 5.5.4")


def test_orcpt_is_xtext_decoded():
    recipient = submit_with(
        b"<a@b.example>", b"<c@d.example> ORCPT=rfc822;a+2Bb@x.example NOTIFY=FAILURE"
    ).envelope.recipients[0]
    assert recipient.orcpt == "rfc822;a+b@x.example"
    assert recipient.notify == "FAILURE"
    assert recipient.address == "c@d.example"


@pytest.mark.parametrize("value", [b"rfc822;a+2bb@x", b"rfc822;a=b@x", b"rfc822", b";a@x"])
def test_orcpt_invalid(value):
    assert rcpt(b"<c@d.example> ORCPT=" + value)[0].startswith("501 5.5.4")


@pytest.mark.parametrize(
    "value",
    [
        b"rfc822;x+F9+EF",  # not UTF-8 once decoded
        b"x;;.+F9+EF",  # what the fuzzer found
        b"\xff;a@x.example",  # the addr-type must be an atom, not any bytes
        "rfc822\u00e9;a@x.example".encode(),
    ],
)
def test_orcpt_that_is_not_an_atom_and_utf8_is_refused(value):
    session = ready()
    send(session, b"MAIL FROM:<a@sender.test>\r\n")
    _, replies = send(session, b"RCPT TO:<b@x.test> ORCPT=" + value + b"\r\n")
    assert len(replies) == 1 and replies[0].startswith("501 5.5.4"), replies
    assert session.envelope is not None and session.envelope.recipients == []
    _, replies = send(session, b"RCPT TO:<b@x.test> ORCPT=utf-8;b+40x.test\r\n")
    assert replies == ["250 2.1.5 Ok"]
    assert session.envelope.recipients[0].orcpt == "utf-8;b@x.test"


def test_unknown_rcpt_param():
    assert rcpt(b"<c@d.example> FOO") == ["555 5.5.4 Error: unsupported RCPT parameter FOO"]


# -- addresses -------------------------------------------------------------------------


def test_null_sender_accepted_for_mail_only():
    session = ready()
    assert mail(session, b"<>") == ["250 2.1.0 Ok"]
    assert session.envelope.sender == ""
    _, replies = send(session, b"RCPT TO:<>\r\n")
    assert replies[0].startswith("501 5.1.3")
    submit = submit_with(b"<>")
    assert submit.envelope.sender == ""


@pytest.mark.parametrize(
    "arg",
    [
        b"a@b.example",
        b"<a@b.example",
        b"<a@-b.example>",
        b"<a@b..example>",
        b"<a@>",
        b"<a>",
        b"<" + b"x" * 65 + b"@b.example>",
        b"<a@[300.0.0.1]>",
        b"<a@b.example>SIZE=1",
        b"<@relay.example a@b.example>",
    ],
)
def test_bad_sender_addresses(arg):
    session = ready()
    replies = mail(session, arg)
    assert len(replies) == 1
    assert replies[0].startswith("501 5.1.7 Bad sender address syntax"), replies
    assert session.envelope is None


@pytest.mark.parametrize(
    "arg",
    [
        b"c@d.example",
        b"<c@d.example",
        b"<c@-d.example>",
        b"<c@>",
        b"<c>",
        b"<" + b"x" * 65 + b"@d.example>",
        b"<c@[IPv6:zz]>",
    ],
)
def test_bad_recipient_addresses(arg):
    replies = rcpt(arg)
    assert len(replies) == 1
    assert replies[0].startswith("501 5.1.3 Bad recipient address syntax"), replies


def test_mail_and_rcpt_keywords_are_checked():
    session = ready()
    assert mail(session, b"")[0].startswith("501 5.1.7")  # "MAIL FROM:" with nothing
    _, replies = send(session, b"MAIL <a@b.example>\r\n")
    assert replies[0].startswith("501 5.5.4")
    send(session, b"MAIL FROM:<a@b.example>\r\n")
    _, replies = send(session, b"RCPT <c@d.example>\r\n")
    assert replies[0].startswith("501 5.5.4")


@pytest.mark.parametrize(
    "address",
    [
        '"john doe"@b.example',
        '"odd>char"@b.example',
        "a@[127.0.0.1]",
        "a@[IPv6:::1]",
        "x" * 64 + "@b.example",
    ],
)
def test_valid_unusual_addresses(address):
    submit = submit_with(f"<{address}>".encode(), f"<{address}>".encode())
    assert submit.envelope.sender == address
    assert submit.envelope.recipients[0].address == address


def test_mail_from_with_space_before_path():
    assert submit_with(b" <a@b.example>").envelope.sender == "a@b.example"


def test_source_routes_are_stripped():
    submit = submit_with(b"<@relay.example:a@b.example>", b"<@r1.example,@r2.example:c@d.example>")
    assert submit.envelope.sender == "a@b.example"
    assert submit.envelope.recipients[0].address == "c@d.example"


def test_non_ascii_sender_needs_smtputf8():
    assert mail(ready(), "<jörg@b.example>".encode())[0].startswith("501 5.1.7")


def test_non_ascii_recipient_needs_smtputf8():
    assert rcpt("<jörg@d.example>".encode())[0].startswith("501 5.1.3")
    assert rcpt("<a@exämple.example>".encode())[0].startswith("501 5.1.3")


def test_non_ascii_addresses_with_smtputf8():
    submit = submit_with("<jörg@exämple.example> SMTPUTF8".encode(), "<用户@例子.广告>".encode())
    assert submit.envelope.smtputf8
    assert submit.envelope.sender == "jörg@exämple.example"
    assert submit.envelope.recipients[0].address == "用户@例子.广告"


def test_non_ascii_domain_with_smtputf8():
    submit = submit_with("<a@exämple.example> SMTPUTF8".encode(), "<c@例子.广告>".encode())
    assert submit.envelope.sender == "a@exämple.example"
    assert submit.envelope.recipients[0].address == "c@例子.广告"


@pytest.mark.parametrize("params", [b"", b" SMTPUTF8"])
def test_invalid_utf8_in_sender_is_a_syntax_error(params):
    session = ready()
    replies = mail(session, b"<\xff@b.example>" + params)
    assert len(replies) == 1
    assert replies[0].startswith("501 5.1.7")
    assert session.envelope is None


def test_invalid_utf8_in_recipient_is_a_syntax_error():
    assert rcpt(b"<c\xc3@d.example>")[0].startswith("501 5.1.3")


# -- limits ------------------------------------------------------------------------------


def test_max_recipients():
    session = ready(max_recipients=3)
    _, replies = send(
        session,
        b"MAIL FROM:<a@b.example>\r\n"
        + b"".join(b"RCPT TO:<r%d@d.example>\r\n" % i for i in range(5)),
    )
    assert codes(replies) == ["250", "250", "250", "250", "452", "452"]
    assert replies[-1] == "452 4.5.3 Error: too many recipients"
    action, _ = send(session, b"DATA\r\nx\r\n.\r\n")
    assert [r.address for r in action.envelope.recipients] == [
        "r0@d.example",
        "r1@d.example",
        "r2@d.example",
    ]


def test_relay_denied():
    session = ready(may_relay=False)
    _, replies = send(session, b"MAIL FROM:<a@b.example>\r\nRCPT TO:<v@y.example>\r\nDATA\r\n")
    assert replies == [
        "250 2.1.0 Ok",
        "554 5.7.1 <v@y.example>: Relay access denied",
        "554 5.5.1 Error: no valid recipients",
    ]
    assert not session.in_data


def test_message_too_big_after_the_final_dot_and_the_session_goes_on():
    session = ready(max_message_size=100)
    action, replies = send(session, ENVELOPE + b"x" * 99 + b"\r\n.\r\nNOOP\r\n")
    assert action is None
    assert replies[-2:] == ["552 5.3.4 Error: message too big for system", "250 2.0.0 Ok"]
    assert session.envelope is None
    assert not session.busy
    submit = transaction(session, b"small\r\n")
    assert submit.content == b"small\r\n"


def test_message_of_exactly_the_limit_is_accepted():
    session = ready(max_message_size=100)
    content = b"x" * 98 + b"\r\n"
    assert transaction(session, content).content == content


def test_message_of_exactly_the_limit_is_accepted_however_it_is_split():
    # The same bytes must get the same answer whatever the TCP segmentation.
    content = b"x" * 98 + b"\r\n"
    for tail in (b".", b".\r"):
        session = ready(max_message_size=100)
        send(session, ENVELOPE)
        action, replies = send(session, content + tail)
        assert (action, replies) == (None, [])
        action, replies = send(session, b".\r\n"[len(tail) :])
        assert isinstance(action, Submit), (tail, replies)
        assert action.content == content


def test_dot_stuffing_does_not_count_towards_the_size_limit():
    content = b".\r\n" * 40  # 120 octets of content, 160 on the wire
    session = ready(max_message_size=130)
    send(session, ENVELOPE)
    wire = dot_stuff(content)
    assert send(session, wire[:150]) == (None, [])
    action, replies = send(session, wire[150:] + b".\r\n")
    assert isinstance(action, Submit), replies
    assert action.content == content


def test_huge_message_is_streamed_without_being_kept():
    limit = 1 << 20
    chunk_size = 64 << 10
    session = ready(max_message_size=limit)
    send(session, ENVELOPE)
    line = b"y" * 78 + b"\r\n"
    chunk = (line * (chunk_size // len(line) + 1))[:chunk_size]
    largest = 0
    for _ in range((50 << 20) // chunk_size):
        action, replies = send(session, chunk)
        assert (action, replies) == (None, [])
        largest = max(largest, len(session._reader._data))
    # Dot-stuffing may add a third before the exact check; beyond that nothing is kept.
    assert largest <= limit * 4 // 3 + 8 + chunk_size
    # The end of data may straddle two reads even after the overflow.
    assert send(session, b"\r") == (None, [])
    action, replies = send(session, b"\n.\r\nNOOP\r\n")
    assert action is None
    assert replies == ["552 5.3.4 Error: message too big for system", "250 2.0.0 Ok"]
    assert not session.busy
    assert transaction(session, b"next\r\n").content == b"next\r\n"


def test_overlong_command_line():
    session = ready()
    _, replies = send(session, b"NOOP " + b"a" * MAX_COMMAND_LINE + b"\r\nNOOP\r\n")
    assert replies == ["500 5.5.2 Error: command line too long", "250 2.0.0 Ok"]
    assert not session.closed


def test_overlong_command_line_in_pieces_is_discarded_as_it_comes():
    session = ready()
    for _ in range(10):
        assert send(session, b"MAIL FROM:<" + b"a" * 1000) == (None, [])
        assert session.buffered <= MAX_COMMAND_LINE + 1011
    _, replies = send(session, b"@b.example>\r\nNOOP\r\n")
    assert replies == ["500 5.5.2 Error: command line too long", "250 2.0.0 Ok"]
    assert session.envelope is None  # the tail of the long line was not a command
    assert transaction(session, b"x\r\n").content == b"x\r\n"


def test_command_line_just_under_the_limit_works():
    session = ready()
    arg = b"<a@b.example> ENVID=" + b"e" * 50
    line = b"MAIL FROM:" + arg + b" " * (MAX_COMMAND_LINE - 12 - len(arg)) + b"\r\n"
    assert len(line) == MAX_COMMAND_LINE
    assert mail(session, line[len(b"MAIL FROM:") : -2]) == ["250 2.1.0 Ok"]
    _, replies = send(session, b"RSET\r\n" + line[:-2] + b" \r\n")
    assert replies == ["250 2.0.0 Ok", "500 5.5.2 Error: command line too long"]


def test_lines_over_998_characters_are_accepted_up_to_max_line_length():
    # swaks with 1001 recipients on one To: line, or minified HTML, once got 550 5.6.0
    # (Postfix takes them; delivery folds headers and QP-encodes the body on the way out).
    to = b"To: " + b", ".join(b"user%d@rcpt.example" % i for i in range(1001)) + b"\r\n"
    html = b"<html>" + b"<p>minified</p>" * 10_000 + b"</html>\r\n"
    content = to + b"Subject: long\r\n\r\n" + html
    session = ready(max_message_size=1 << 20)
    assert transaction(session, content).content == content
    session = ready(max_line_length=2000)
    exact = b"Subject: s\r\n\r\n" + b"a" * 2000 + b"\r\n"
    assert transaction(session, exact).content == exact
    session.resume(QUEUED)
    assert lines(session) == [QUEUED]
    action, replies = send(session, ENVELOPE + b"Subject: s\r\n\r\n" + b"a" * 2001 + b"\r\n.\r\n")
    assert action is None
    assert replies[-1] == "550 5.6.0 Error: message has a line over 2000 characters"
    assert session.envelope is None


@settings(max_examples=300, deadline=None)
@given(
    lines=st.lists(st.integers(0, 40), max_size=30),
    limit=st.integers(1, 30),
)
def test_has_line_over_is_the_longest_line_test(lines, limit):
    content = b"".join(b"x" * n + b"\r\n" for n in lines)
    assert has_line_over(content, limit) == (max(lines, default=0) > limit)


def test_storage_not_ok_refuses_mail():
    state = {"refusal": "452 4.3.1 Insufficient system storage"}
    session = ready(storage_refusal=lambda: state["refusal"])
    assert mail(session, b"<a@b.example>") == ["452 4.3.1 Insufficient system storage"]
    assert session.envelope is None
    state["refusal"] = "451 4.3.0 Spool writer restarting, try again later"
    assert mail(session, b"<a@b.example>") == [state["refusal"]]
    state["refusal"] = None
    assert mail(session, b"<a@b.example>") == ["250 2.1.0 Ok"]


def test_too_many_errors_closes_the_session():
    session = ready()
    _, replies = send(session, b"BAD\r\n" * (MAX_ERRORS - 1))
    assert codes(replies) == ["502"] * (MAX_ERRORS - 1)
    assert not session.closed
    action, replies = send(session, b"BAD\r\nNOOP\r\n")
    assert action is None
    assert replies == [
        "502 5.5.1 Error: command not recognized",
        "421 4.7.0 mx.test Error: too many errors",
    ]
    assert session.closed
    assert session.receive(b"NOOP\r\n") is None
    assert session.take_output() == b""


def test_errors_of_any_kind_count():
    session = ready(may_relay=False)
    send(session, b"MAIL FROM:<a@b.example>\r\n")
    _, replies = send(session, b"RCPT TO:<v@y.example>\r\n" * MAX_ERRORS)
    assert replies[-1].startswith("421 ")
    assert session.closed


# -- SMTP smuggling ------------------------------------------------------------------------

SMUGGLED = b"MAIL FROM:<evil@x.example>\r\nRCPT TO:<v@y.example>\r\nDATA\r\nsmuggled\r\n"
FAKE_ENDS = [b"\n.\n", b"\r.\r", b"\n.\r\n", b"\r\n.\n", b"\r\n.\r"]


@pytest.mark.parametrize("fake_end", FAKE_ENDS, ids=repr)
def test_smuggling_is_data_in_normalize_mode(fake_end):
    session = ready()
    wire = ENVELOPE + b"Subject: t\r\n\r\nhello" + fake_end + SMUGGLED + b".\r\n"
    actions, out = drive(session, [wire])
    assert len(actions) == 1
    submit = actions[0]
    assert submit.envelope.sender == "app@sender.example"
    assert [r.address for r in submit.envelope.recipients] == ["user@rcpt.example"]
    assert b"MAIL FROM:<evil@x.example>\r\nRCPT TO:<v@y.example>\r\nDATA\r\n" in submit.content
    assert submit.content.startswith(b"Subject: t\r\n\r\nhello\r\n")
    assert submit.content.endswith(b"smuggled\r\n")
    assert not BARE.search(submit.content)  # bare CR / LF became CRLF
    replies = out.decode().split("\r\n")[:-1]
    assert replies == ["250 2.1.0 Ok", "250 2.1.5 Ok", replies_354(), QUEUED]
    assert session.envelope is None and not session.busy


@pytest.mark.parametrize("fake_end", FAKE_ENDS, ids=repr)
def test_smuggling_byte_by_byte(fake_end):
    session = ready()
    wire = ENVELOPE + b"hello" + fake_end + SMUGGLED + b".\r\n"
    actions, out = drive(session, [wire[i : i + 1] for i in range(len(wire))])
    assert len(actions) == 1
    assert b"evil@x.example" in actions[0].content
    assert out.count(b"250 2.1.0") == 1


def test_normalize_mode_turns_bare_newlines_into_crlf():
    session = ready()
    submit = transaction(session, b"Subject: s\r\n\r\na\nb\rc\r\r\nd\n\r\n")
    assert submit.content == b"Subject: s\r\n\r\na\r\nb\r\nc\r\n\r\nd\r\n\r\n"


@pytest.mark.parametrize(
    ("header", "stored"),
    [
        # Once read as a header of its own: a steering header injected through Subject.
        (
            b"Subject: hi\rX-Mtaqueue-Class: nosuch\r\n\r\n",
            b"Subject: hi X-Mtaqueue-Class: nosuch\r\n\r\n",
        ),
        (
            b"Subject: hi\nX-Mtaqueue-Class: p0\r\nFrom: a\r\n\r\n",
            b"Subject: hi X-Mtaqueue-Class: p0\r\nFrom: a\r\n\r\n",
        ),
        (
            b"From: a\r\nSubject: hi\r\rX-Evil: 1\n\r\n\r\n",
            b"From: a\r\nSubject: hi  X-Evil: 1 \r\n\r\n",
        ),
        # CRLF elsewhere: the "\n\n" cannot end the header and make an LF-only client.
        (
            b"Subject: hi\nX-Mtaqueue-Class: p0\n\nFrom: a\r\n\r\n",
            b"Subject: hi X-Mtaqueue-Class: p0  From: a\r\n\r\n",
        ),
        # A client that ends every line with a bare LF: those LFs end lines.
        (
            b"From: a\nSubject: hi\rX-Mtaqueue-Class: p0\n\n",
            b"From: a\r\nSubject: hi X-Mtaqueue-Class: p0\r\n\r\n",
        ),
    ],
)
def test_bare_cr_or_lf_inside_a_header_line_is_a_space(header, stored):
    session = ready()
    submit = transaction(session, header + b"body\nend\r\n")
    assert submit.content == stored + b"body\r\nend\r\n"


_HEADER_BYTES = (
    st.lists(
        st.one_of(
            st.binary(max_size=6),
            st.sampled_from([b"\r", b"\n", b"\n\n", b"\r\r", b"X-Mtaqueue-Class: p0", b" ", b"."]),
        ),
        max_size=8,
    )
    .map(lambda parts: b"".join(parts))
    .filter(lambda value: b"\r\n" not in value)
)
# Filtered, not stripped: removing CRLF from b"\r\r\n\n" leaves a CRLF.


@settings(max_examples=300, deadline=None)
@given(value=_HEADER_BYTES, first=st.booleans())
def test_no_bytes_in_a_header_value_make_a_header_of_their_own(value, first):
    # Whatever an application lets through into a header value (but CRLF itself),
    # the stored header has no field the application did not start with CRLF.
    fields = [b"Subject: " + value, b"From: a@sender.example", b"To: b@rcpt.example"]
    if not first:
        fields.reverse()
    submit = transaction(ready(), dot_stuff(b"\r\n".join(fields) + b"\r\n\r\nbody\r\n"))
    header = submit.content.split(b"\r\n\r\n", 1)[0]
    starts = [line[:5] for line in header.split(b"\r\n") if line[:1] not in (b" ", b"\t")]
    assert set(starts) <= {b"Subje", b"From:", b"To: b"}, submit.content


def test_lf_only_client_is_dot_unstuffed_like_a_crlf_one():
    # "\n..x" kept both dots: unstuffing looked for CRLF only.
    submit = transaction(ready(), b"Subject: s\n\nline\n..x\n..\n...\r\n")
    assert submit.content == b"Subject: s\r\n\r\nline\r\n.x\r\n.\r\n..\r\n"
    submit = transaction(ready(), b"..first\nnext\n\n..body\r\n")  # dots in an LF header too
    assert submit.content == b".first\r\nnext\r\n\r\n.body\r\n"
    submit = transaction(ready(), b"Subject: s\r\n\r\nbare\r..cr\n..lf\r\n..crlf\r\n")
    assert submit.content == b"Subject: s\r\n\r\nbare\r\n.cr\r\n.lf\r\n.crlf\r\n"


def test_a_stuffing_dot_between_a_bare_cr_and_a_bare_lf_keeps_both_line_ends():
    # "a<CR>.<LF>b" is three lines, the middle one empty once unstuffed. Unstuffing before
    # the bare newlines were made CRLF turned "<CR>.<LF>" into one CRLF: a line was lost.
    submit = transaction(ready(), b"Subject: s\r\n\r\na\r.\nb\r\n")
    assert submit.content == b"Subject: s\r\n\r\na\r\n\r\nb\r\n"


def test_nul_is_refused_in_reject_mode_and_kept_in_normalize_mode():
    content = b"Subject: s\r\n\r\nnul\0here\r\n"
    session = ready(bare_newline="reject")
    action, replies = send(session, ENVELOPE + content + b".\r\n")
    assert action is None
    assert replies[-1] == "550 5.6.0 Error: NUL character in message content (RFC 5322 2.3)"
    assert session.envelope is None
    assert transaction(session, b"clean\r\n").content == b"clean\r\n"
    assert transaction(ready(), content).content == content


@pytest.mark.parametrize("fake_end", FAKE_ENDS, ids=repr)
def test_smuggling_is_refused_in_reject_mode(fake_end):
    session = ready(bare_newline="reject")
    wire = ENVELOPE + b"hello" + fake_end + SMUGGLED + b".\r\nNOOP\r\n"
    actions, out = drive(session, [wire])
    assert actions == []
    replies = out.decode().split("\r\n")[:-1]
    assert replies == [
        "250 2.1.0 Ok",
        "250 2.1.5 Ok",
        replies_354(),
        "550 5.6.0 Error: bare <CR> or <LF> in message content (RFC 5321 2.3.8)",
        "250 2.0.0 Ok",
    ]
    assert session.envelope is None
    # The session still works, and a clean message goes through.
    assert transaction(session, b"clean\r\n").content == b"clean\r\n"


# -- streaming: large messages handed on in pieces ----------------------------------------


def drive_streamed(session: ServerSession, chunks, reply: str = QUEUED, io_reply=None):
    """Feed chunks, storing streamed messages as the listener does (`io_reply`: what it
    answers a Stream, e.g. a refusal); return ([(envelope, content) stored], all output,
    the largest piece handed on)."""
    stored, out, largest = [], bytearray(), 0
    current = None
    for chunk in chunks:
        action = session.receive(chunk)
        out += session.take_output()
        while action is not None:
            outcome = None
            if isinstance(action, Submit):
                stored.append((action.envelope, action.content))
                outcome = reply
            elif isinstance(action, Stream):
                assert current is None
                current = (action.envelope, bytearray(action.header + action.data))
                largest = max(largest, len(action.data))
                outcome = io_reply
                if io_reply is not None:
                    current = None  # the listener drops what it began to store
            elif isinstance(action, Write):
                assert current is not None
                current[1].extend(action.data)
                largest = max(largest, len(action.data))
            else:
                assert isinstance(action, Finish) and current is not None
                if action.refusal is None:
                    stored.append((current[0], bytes(current[1] + action.data)))
                outcome = action.refusal or reply
                current = None
            action = session.resume(outcome)
            out += session.take_output()
    assert current is None or session.busy  # nothing half stored once the message is over
    return stored, bytes(out), largest


def big_content(size: int) -> bytes:
    """CRLF content of about `size` octets with dots to unstuff and 8-bit octets."""
    line = b".dotted line \xe2\x82\xac " + b"x" * 50 + b"\r\n"
    return b"Subject: big\r\nFrom: a@sender.example\r\n\r\n" + line * (size // len(line))


def test_a_large_message_is_handed_on_in_pieces_and_not_kept():
    content = big_content(8 << 20)
    session = ready(max_message_size=16 << 20, stream_threshold=64 << 10)
    send(session, ENVELOPE)
    wire = dot_stuff(content) + b".\r\n"
    read = 64 << 10  # what one read brings
    stored, out = bytearray(), bytearray()
    held = 0
    actions = []
    for at in range(0, len(wire), read):
        action = session.receive(wire[at : at + read])
        while action is not None:
            actions.append(type(action))
            if isinstance(action, Stream):
                assert action.header == b"Subject: big\r\nFrom: a@sender.example\r\n"
                stored += action.header + action.data
            elif isinstance(action, Write | Finish):
                stored += action.data
            held = max(held, len(session._reader._data) + session.buffered)
            action = session.resume(QUEUED if isinstance(action, Finish) else None)
        held = max(held, len(session._reader._data) + session.buffered)
        out += session.take_output()
    assert bytes(stored) == content
    assert actions[0] is Stream and actions[-1] is Finish and Submit not in actions
    assert set(actions[1:-1]) == {Write} and len(actions) > 8 << 20 // (2 * STREAM_PIECE)
    assert held <= STREAM_PIECE + read  # a piece and a read, never the message
    assert out == QUEUED.encode() + b"\r\n"
    assert not session.busy and session.envelope is None


def test_the_header_is_held_until_it_ends():
    header = b"Subject: s\r\nTo: " + b"a@rcpt.example, " * 2000 + b"\r\n"
    content = header + b"\r\n" + b"body\r\n" * 10_000
    session = ready(stream_threshold=1000)
    send(session, ENVELOPE)
    actions = [session.receive(content[:20_000])]  # past the threshold, inside the header
    assert actions == [None]
    action = session.receive(content[20_000:40_000])
    assert isinstance(action, Stream)
    assert action.header == header and action.data.startswith(b"\r\nbody\r\n")


def test_a_header_that_does_not_end_within_its_limit_is_refused_and_nothing_stored():
    session = ready(stream_threshold=100, max_header_size=1000)
    never_ends = b"X-Long: " + b"y" * 5000 + b"\r\n"
    stored, out, _ = drive_streamed(session, [ENVELOPE, never_ends, b".\r\nNOOP\r\n"])
    assert stored == []
    assert out.decode().split("\r\n")[-3:-1] == [
        "552 5.6.0 Error: message header over 1000 octets (no empty line ends it)",
        "250 2.0.0 Ok",
    ]
    # The same message, held whole, gets the same answer.
    session = ready(max_header_size=1000)
    assert drive_streamed(session, [ENVELOPE + never_ends + b".\r\nNOOP\r\n"])[1] == out


def test_what_cannot_be_stored_is_read_to_the_end_and_answered_with_the_io_reply():
    refusal = "554 5.6.0 Unknown class 'x' in X-Mtaqueue-Class (known: p0, p1, p2)"
    session = ready(stream_threshold=100)
    wire = ENVELOPE + dot_stuff(big_content(50_000)) + b".\r\nNOOP\r\n"
    chunks = [wire[i : i + 1000] for i in range(0, len(wire), 1000)]
    stored, out, _ = drive_streamed(session, chunks, io_reply=refusal)
    assert stored == []
    assert out.decode().split("\r\n")[-3:-1] == [refusal, "250 2.0.0 Ok"]
    assert transaction(session, b"next\r\n").content == b"next\r\n"


def test_a_streamed_message_over_the_size_limit_is_refused_at_the_dot():
    session = ready(max_message_size=50_000, stream_threshold=1000)
    wire = ENVELOPE + dot_stuff(big_content(60_000)) + b".\r\nNOOP\r\n"
    actions = []
    for at in range(0, len(wire), 4096):
        action = session.receive(wire[at : at + 4096])
        while action is not None:
            actions.append(action)
            action = session.resume(
                "552 5.3.4 Error: message too big for system"
                if isinstance(action, Finish)
                else None
            )
    assert isinstance(actions[0], Stream) and isinstance(actions[-1], Finish)
    assert actions[-1].refusal == "552 5.3.4 Error: message too big for system"  # drop it
    assert sum(len(a.data) for a in actions if isinstance(a, Write)) <= 50_000
    assert lines(session)[-2:] == ["552 5.3.4 Error: message too big for system", "250 2.0.0 Ok"]


@pytest.mark.parametrize("threshold", [0, 10, 40])
def test_streamed_at_every_split_point_the_content_is_the_same(threshold):
    # The final dot, a "\r\n." to unstuff, a CRLF or a header end: split anywhere.
    content = b"Subject: split\r\n\r\n.leading dot\r\nline\r\n\r\n.\r\n..\r\nend\r\n"
    wire = b"EHLO c\r\n" + ENVELOPE + dot_stuff(content) + b".\r\nNOOP\r\nQUIT\r\n"
    with mock.patch.object(data_reader, "STREAM_PIECE", 3):
        for cut in range(len(wire) + 1):
            stored, out, _ = drive_streamed(
                make(stream_threshold=threshold), [wire[:cut], wire[cut:]]
            )
            assert [c for _, c in stored] == [content], cut
            assert out.endswith(QUEUED.encode() + b"\r\n250 2.0.0 Ok\r\n221 2.0.0 Bye\r\n"), cut
        stored, _, _ = drive_streamed(make(stream_threshold=threshold), list(map(bytes, zip(wire))))
        assert [c for _, c in stored] == [content]


_STREAM_TOKENS = st.sampled_from(
    [
        b"\r\n",
        b"\r",
        b"\n",
        b".",
        b"..",
        b"\r\n.",
        b"\n.",
        b"\r.",
        b"\r\n\r\n",
        b"\n\n",
        b"Subject: s",
        b"X-Mtaqueue-Class: p0",
        b"text of a line",
        b"x" * 30,
        b"\xff",
        b"\0",
        b"\r\n.\r\n" + ENVELOPE,  # the end of one message, the next one
        b"\r\n.\r\nNOOP\r\n" + ENVELOPE,
    ]
)


@settings(max_examples=500, deadline=None)
@given(
    head=st.lists(_STREAM_TOKENS, max_size=12),
    end_of_header=st.sampled_from([b"\r\n\r\n", b"\n\n", b"\n\r\n", b"\r\n", b""]),
    tokens=st.lists(_STREAM_TOKENS, max_size=50),
    cuts=st.lists(st.integers(0, 1500), max_size=25),
    read=st.integers(1, 64),
    threshold=st.integers(0, 80),
    piece=st.integers(1, 40),
    window=st.integers(1, 200),
    max_size=st.integers(1, 2000),
    max_line=st.integers(1, 200),
    reject=st.booleans(),
)
def test_streamed_or_held_any_split_gives_the_same_content_and_replies(
    head, end_of_header, tokens, cuts, read, threshold, piece, window, max_size, max_line, reject
):
    data = b"".join(head) + end_of_header + b"".join(tokens)
    wire = b"EHLO c\r\n" + ENVELOPE + data + b"\r\n.\r\nQUIT\r\n"
    points = sorted({min(c, len(wire)) for c in cuts})
    chunks = [  # cut anywhere, then into reads of at most `read` octets
        part[at : at + read]
        for part in (wire[a:b] for a, b in zip([0, *points], [*points, len(wire)], strict=True))
        for at in range(0, len(part), read)
    ]
    options = {
        "max_message_size": max_size,
        "max_line_length": max_line,
        "max_header_size": window,
        "bare_newline": "reject" if reject else "normalize",
    }
    held, held_out, _ = drive_streamed(make(**options), [wire])
    with mock.patch.object(data_reader, "STREAM_PIECE", piece):
        streamed, out, _ = drive_streamed(make(stream_threshold=threshold, **options), chunks)
    assert out == held_out
    assert streamed == held


# -- STARTTLS and AUTH -----------------------------------------------------------------------


def tls_session(**kwargs) -> ServerSession:
    """EHLO, STARTTLS (done), EHLO again."""
    session = make(tls_available=True, auth_available=True, **kwargs)
    send(session, b"EHLO c\r\n")
    action, replies = send(session, b"STARTTLS\r\n")
    assert isinstance(action, StartTLS)
    assert replies == ["220 2.0.0 Ready to start TLS"]
    assert session.resume(True) is None
    assert session.tls
    _, replies = send(session, b"EHLO c\r\n")
    assert replies[-1] == "250 AUTH PLAIN LOGIN"
    return session


def b64(text: str) -> bytes:
    return base64.b64encode(text.encode())


def test_auth_before_tls():
    session = make(tls_available=True, auth_available=True)
    send(session, b"EHLO c\r\n")
    _, replies = send(session, b"AUTH PLAIN " + b64("\0u\0p") + b"\r\n")
    assert replies == ["538 5.7.11 Encryption required for requested authentication mechanism"]


def test_auth_not_available():
    session = make(tls_available=True)
    send(session, b"EHLO c\r\nSTARTTLS\r\n")
    session.resume(True)
    _, replies = send(session, b"EHLO c\r\nAUTH PLAIN " + b64("\0u\0p") + b"\r\n")
    assert replies[-1].startswith("502 5.5.1")


def test_starttls_not_available_or_twice():
    session = ready()
    _, replies = send(session, b"STARTTLS\r\n")
    assert replies[0].startswith("502 5.5.1")
    session = tls_session()
    action, replies = send(session, b"STARTTLS\r\n")
    assert action is None
    assert replies[0].startswith("503 5.5.1")
    session = make(tls_available=True)
    _, replies = send(session, b"STARTTLS now\r\n")
    assert replies[0].startswith("501")


def test_starttls_discards_pipelined_cleartext():
    session = make(tls_available=True, auth_available=True, may_relay=True)
    send(session, b"EHLO c\r\n")
    action, replies = send(
        session, b"STARTTLS\r\nMAIL FROM:<evil@x.example>\r\nRCPT TO:<v@y.example>\r\n"
    )
    assert isinstance(action, StartTLS)
    assert replies == ["220 2.0.0 Ready to start TLS"]
    assert session.buffered == 0
    assert session.resume(True) is None
    assert lines(session) == []  # the injected commands were never answered
    assert session.envelope is None


def test_starttls_resets_the_helo_state():
    session = make(tls_available=True)
    send(session, b"EHLO c\r\nMAIL FROM:<a@b.example>\r\n")
    assert session.envelope is not None
    action, _ = send(session, b"STARTTLS\r\n")
    assert isinstance(action, StartTLS)
    session.resume(True)
    assert session.helo == "" and session.envelope is None
    _, replies = send(session, b"MAIL FROM:<a@b.example>\r\n")
    assert replies[0].startswith("503 5.5.1")
    _, replies = send(session, b"EHLO c\r\nMAIL FROM:<a@b.example>\r\n")
    assert replies[-1] == "250 2.1.0 Ok"


def test_failed_tls_handshake_closes():
    session = make(tls_available=True)
    send(session, b"EHLO c\r\n")
    action, _ = send(session, b"STARTTLS\r\n")
    assert isinstance(action, StartTLS)
    assert session.resume(None) is None
    assert session.closed
    assert not session.tls


def test_auth_plain_with_initial_response():
    session = tls_session(may_relay=False)
    action, replies = send(session, b"AUTH PLAIN " + b64("\0alice\0s3cret pw") + b"\r\n")
    assert replies == []
    assert action == CheckCredentials("alice", "s3cret pw")
    assert session.resume("alice") is None
    assert lines(session) == ["235 2.7.0 Authentication successful"]
    assert session.user == "alice"
    # Authenticated clients may relay even from outside mynetworks.
    action, replies = send(session, ENVELOPE + b"hi\r\n.\r\n")
    assert isinstance(action, Submit), replies
    assert action.user == "alice"


def test_auth_plain_with_authorization_identity():
    session = tls_session()
    action, _ = send(session, b"AUTH PLAIN " + b64("admin\0alice\0pw") + b"\r\n")
    assert action == CheckCredentials("alice", "pw")


def test_auth_plain_without_initial_response():
    session = tls_session()
    action, replies = send(session, b"auth plain\r\n")
    assert action is None
    assert replies == ["334 "]
    action, replies = send(session, b64("\0bob\0pw") + b"\r\n")
    assert action == CheckCredentials("bob", "pw")


def test_auth_failure():
    session = tls_session(may_relay=False)
    send(session, b"AUTH PLAIN " + b64("\0alice\0wrong") + b"\r\n")
    assert session.resume(None) is None
    assert lines(session) == ["535 5.7.8 Authentication credentials invalid"]
    assert session.user is None
    _, replies = send(session, b"MAIL FROM:<a@b.example>\r\nRCPT TO:<c@d.example>\r\n")
    assert replies[-1].startswith("554 5.7.1")
    # A new attempt is allowed.
    action, _ = send(session, b"RSET\r\nAUTH PLAIN " + b64("\0alice\0right") + b"\r\n")
    assert action == CheckCredentials("alice", "right")


def test_auth_login_two_steps():
    session = tls_session()
    action, replies = send(session, b"AUTH LOGIN\r\n")
    assert (action, replies) == (None, ["334 VXNlcm5hbWU6"])
    action, replies = send(session, b64("carol") + b"\r\n")
    assert (action, replies) == (None, ["334 UGFzc3dvcmQ6"])
    action, replies = send(session, b64("pässword") + b"\r\n")
    assert replies == []
    assert action == CheckCredentials("carol", "pässword")
    session.resume("carol")
    assert lines(session) == ["235 2.7.0 Authentication successful"]


def test_auth_login_with_initial_response():
    session = tls_session()
    action, replies = send(session, b"AUTH LOGIN " + b64("carol") + b"\r\n")
    assert (action, replies) == (None, ["334 UGFzc3dvcmQ6"])
    action, _ = send(session, b64("pw") + b"\r\n")
    assert action == CheckCredentials("carol", "pw")


@pytest.mark.parametrize("start", [b"AUTH PLAIN\r\n", b"AUTH LOGIN\r\n"])
def test_auth_cancelled(start):
    session = tls_session()
    send(session, start)
    action, replies = send(session, b"*\r\nNOOP\r\n")
    assert action is None
    assert replies == ["501 5.7.0 Error: authentication cancelled", "250 2.0.0 Ok"]


def test_auth_login_cancelled_at_password():
    session = tls_session()
    send(session, b"AUTH LOGIN\r\n" + b64("carol") + b"\r\n")
    action, replies = send(session, b"*\r\n")
    assert action is None
    assert replies[0].startswith("501 5.7.0")


@pytest.mark.parametrize(
    "exchange",
    [
        b"AUTH PLAIN !!notbase64\r\n",
        b"AUTH PLAIN\r\n%%%\r\n",
        b"AUTH LOGIN\r\n@@@\r\n",
        b"AUTH LOGIN\r\n" + b64("carol") + b"\r\nnot base64!\r\n",
        b"AUTH PLAIN " + b64("only-two\0parts") + b"\r\n",
        b"AUTH PLAIN " + b64("\0\0pw") + b"\r\n",  # empty user
        "AUTH PLAIN é\r\n".encode(),  # not ASCII: base64 raised ValueError
        b"AUTH PLAIN \xff\r\n",
        b"AUTH LOGIN\r\n\xc3\xa9\r\n",
    ],
)
def test_auth_bad_data(exchange):
    session = tls_session()
    action, replies = send(session, exchange)
    assert action is None
    assert replies[-1].startswith("501 5.5.2")
    assert session.user is None
    _, replies = send(session, b"NOOP\r\n")
    assert replies == ["250 2.0.0 Ok"]


def test_auth_unknown_mechanism_twice_and_in_transaction():
    session = tls_session()
    _, replies = send(session, b"AUTH CRAM-MD5\r\n")
    assert replies[0].startswith("504")
    send(session, b"MAIL FROM:<a@b.example>\r\n")
    _, replies = send(session, b"AUTH PLAIN " + b64("\0a\0b") + b"\r\n")
    assert replies[0].startswith("503")
    send(session, b"RSET\r\nAUTH PLAIN " + b64("\0a\0b") + b"\r\n")
    session.resume("a")
    lines(session)
    _, replies = send(session, b"AUTH PLAIN " + b64("\0a\0b") + b"\r\n")
    assert replies == ["503 5.5.1 Error: already authenticated"]


def test_auth_required():
    session = tls_session(auth_required=True)
    assert mail(session, b"<a@b.example>") == ["530 5.7.0 Authentication required"]
    send(session, b"AUTH PLAIN " + b64("\0alice\0pw") + b"\r\n")
    session.resume("alice")
    lines(session)
    assert mail(session, b"<a@b.example>") == ["250 2.1.0 Ok"]


def test_pipelined_input_after_auth_waits_for_the_check():
    session = tls_session(may_relay=False)
    action, _ = send(
        session,
        b"AUTH PLAIN " + b64("\0alice\0pw") + b"\r\n" + ENVELOPE + b"x\r\n.\r\n",
    )
    assert isinstance(action, CheckCredentials)
    assert session.take_output() == b""
    submit = session.resume("alice")
    assert isinstance(submit, Submit)
    assert submit.user == "alice"
    assert lines(session)[0] == "235 2.7.0 Authentication successful"


def test_tls_reset_forgets_the_user():
    # Not reachable in a real session (AUTH needs TLS first), but resume(True)
    # must not keep anything from before the handshake.
    session = make(tls_available=True)
    send(session, b"EHLO c\r\nSTARTTLS\r\n")
    session.resume(True)
    assert session.user is None and session.helo == "" and not session.esmtp
