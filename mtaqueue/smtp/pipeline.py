"""The mail transactions of one SMTP session, once its handshake is over.

    Pipeline(stream, extensions, host, ip)
    await .exchange(message, recipients, content) -> (Exchange, unsent) | Reply
    await .begin(message, recipients, content, t) -> Pending | [Reply]
    await .finish(pending, t, then=None) -> [Reply]
    .ahead                                          the transaction written behind the last
    .timed() -> [(kind, seconds)]                   replies timed since the last call
    await .quit() / .close()
    .usable  .pipelining  .dsn  .lockstep  .out_of_step

Where the server offers PIPELINING (RFC 2920) a transaction's MAIL, RCPTs and DATA go in
one write; where it offers CHUNKING (RFC 3030) the content goes in that write too, behind
`BDAT n LAST`: one round trip a message. Without CHUNKING, `finish` can write the next
transaction's MAIL, RCPTs and DATA (`then`, an Exchange of the same connection) right
behind this one's final dot, so that in steady state each message costs one round trip
whatever its recipients; its replies are read with this one's and kept (`ahead`) for
its own `begin`. No RSET follows a transaction that ended cleanly.

Each reply is read for its own command (exchange.judge). A server that answers out of
step (a reply that fits no command of ours there, one too many, replies that stop coming
in the middle of a group) is closed at once and marked (`out_of_step`): the caller then
speaks to that host in lock-step (`lockstep`). With DATA the 354 is a reply no other
command should get, so a reply shifted onto the wrong command shows before the content
goes — unless the server also answered a recipient with 354 and DATA not at all; in a BDAT
group every reply may be a 250, and a server that answers one command twice and BDAT not
at all cannot be told from one in step either (no client can). Nor can a server that
leaves a final dot unanswered and cuts the group behind it short with a 421: read in step,
the dot got the next MAIL's 250 and MAIL the 421, which is what a server that took the
message and then refused more says; the message is taken as delivered.

Replies are timed for the destination's latency (policy/latency.py), each from the write
that asked for it: a group's first reply ("mail": a round trip and the server's work), each
lock-step command's, and the reply after the final dot ("dot"), when the content went to
the kernel in that write (else its size would count). Replies read with another's (a
group's others, those behind a dot) took no time of their own.

A transaction whose reply after the dot was not read is left to
the ambiguous-outcome policy; one written behind it whose replies never came was never
sent as far as the caller is concerned (`ahead` is None): it goes back uncharged.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from dataclasses import dataclass

from ..config import TimeoutsConfig
from ..conversion import Refused, prepare
from ..logs import get_logger
from ..model import Message, Recipient
from ..policy.replies import COMPLETES, Reply
from .addresses import xtext_encode
from .exchange import Exchange, Judged, judge
from .reply_stream import ReplyStream, StreamError

# Content up to this size is checked for the hop on the event loop (tens of microseconds);
# larger content in a thread (25 MiB: ~0.1 s to check, ~0.7 s to re-encode).
CONVERT_INLINE = 256 * 1024

log = get_logger("delivery")


@dataclass(frozen=True, slots=True)
class Pending:
    """A transaction whose 354 came: its content is next (`finish`)."""

    exchange: Exchange
    judged: Judged
    unsent: dict[int, Reply]  # recipients left out of the exchange, by index


@dataclass(frozen=True, slots=True)
class Ahead:
    """A transaction written behind the last one's final dot, and the replies it got."""

    message_id: str
    exchange: Exchange
    unsent: dict[int, Reply]
    replies: list[Reply]


class Pipeline:
    def __init__(self, stream: ReplyStream, extensions: frozenset[str], host: str, ip: str):
        self.stream = stream
        self.extensions = extensions  # the EHLO keywords, lower case
        self.host, self.ip = host, ip
        self.lockstep = False  # this host answers pipelined groups out of step (learned)
        self.out_of_step = False  # it just did, on this session
        self.ahead: Ahead | None = None
        self._timings: list[tuple[str, float]] = []

    def timed(self) -> list[tuple[str, float]]:
        """(kind, seconds) of the replies timed since the last call."""
        timings, self._timings = self._timings, []
        return timings

    @property
    def dsn(self) -> bool:
        return "dsn" in self.extensions

    @property
    def pipelining(self) -> bool:
        return "pipelining" in self.extensions and not self.lockstep

    @property
    def usable(self) -> bool:
        return self.stream.open and not self.out_of_step

    # -- a transaction -------------------------------------------------------------------

    async def begin(
        self, message: Message, recipients: list[Recipient], content: bytes, t: TimeoutsConfig
    ) -> Pending | list[Reply]:
        """MAIL, the RCPTs and DATA (or BDAT and the content) and their replies: each
        recipient's reply when the transaction ended there, else Pending."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None:  # written behind the last one: its replies are read
            if ahead.message_id != message.id:  # not what was written: a bug of ours
                self.close()
                text = f"local error: {ahead.message_id} was written ahead, not {message.id}"
                return [network("mail", "local", text)] * len(recipients)
            exchange, unsent, replies = ahead.exchange, ahead.unsent, ahead.replies
        else:
            made = await self.exchange(message, recipients, content)
            if isinstance(made, Reply):
                return [made] * len(recipients)
            exchange, unsent = made
            replies = await self._steps(exchange, t)
        judged = judge(replies, len(exchange.rcpts), exchange.chunking)
        if judged.in_step and self.stream.buffered:  # a reply too many (closed after it, say)
            text = "protocol error: more replies than commands"
            extra = network(replies[-1].phase, "protocol", text)
            judged = Judged([extra] * len(exchange.rcpts), False, False, False, False)
        if not judged.in_step:
            self._out_of_step()
        elif judged.content:
            return Pending(exchange, judged, unsent)
        if judged.lone_dot:
            await self._final(b".\r\n", t)
        if judged.reset:
            await self._reset()
        return _each(judged, unsent, None, len(recipients))

    async def finish(
        self, pending: Pending, t: TimeoutsConfig, then: Ahead | None = None
    ) -> list[Reply]:
        """The content, its final dot and the reply to it; with `then` (its replies
        empty), that transaction's steps go in the same write and their replies are read
        here: kept in `ahead` if they fit, else the session is closed and this one's
        delivery is in doubt."""
        count = len(pending.judged.recipients) + len(pending.unsent)
        body = pending.exchange.body()
        if then is not None and self.pipelining:
            body += b"".join(command for _, command in then.exchange.steps)
        else:
            then = None
        final = await self._final(body, t)
        if then is not None and self.usable:
            replies = await self._replies(then.exchange, t)
            judged = judge(replies, len(then.exchange.rcpts), then.exchange.chunking)
            # Out of step here (`_replies` marks a group whose replies stopped midway: one
            # short, so the dot's may have been its first): the dot's may be another's.
            if not judged.in_step or self.stream.buffered or self.out_of_step:
                self._out_of_step()
                text = "protocol error: replies out of step after the end of data"
                final = network("data_end", "protocol", text)
            elif replies[-1].network == "timeout":  # commands behind a dot went unheard
                self.out_of_step = True
            else:
                self.ahead = Ahead(then.message_id, then.exchange, then.unsent, replies)
        return _each(pending.judged, pending.unsent, final, count)

    async def exchange(
        self, message: Message, recipients: list[Recipient], content: bytes
    ) -> tuple[Exchange, dict[int, Reply]] | Reply:
        """The transaction's commands and content for this hop, and the recipients left out
        of it (by index: an address that does not encode fails alone, as ours); or the
        reply that refuses it here (a server without SMTPUTF8, content that cannot be
        carried, a sender that does not encode), before anything is sent."""
        ext = self.extensions
        if message.smtputf8 and "smtputf8" not in ext:
            return Reply("mail", 553, "5.6.7", f"{self.host} does not support SMTPUTF8")
        # RFC 6531 makes 8BITMIME part of SMTPUTF8; Postfix also takes one for the other.
        eightbitmime = "8bitmime" in ext
        eight_bit_hop = eightbitmime or "smtputf8" in ext
        if len(content) < CONVERT_INLINE:
            prepared = prepare(content, eightbitmime=eight_bit_hop)
        else:  # scanning (or re-encoding) megabytes would stall every other session
            prepared = await asyncio.to_thread(prepare, content, eightbitmime=eight_bit_hop)
        if isinstance(prepared, Refused):
            return Reply("mail", 554, prepared.status, f"{prepared.reason} ({self.host})")
        dsn = self.dsn
        body = prepared.content
        if not body.endswith(b"\r\n"):
            body += b"\r\n"
        options = [f"SIZE={len(body)}"]
        if prepared.eight_bit and eightbitmime:
            options.append("BODY=8BITMIME")
        if message.smtputf8:
            options.append("SMTPUTF8")
        if dsn and message.ret:
            options.append(f"RET={message.ret}")
        if dsn and message.envid:
            options.append(f"ENVID={xtext_encode(message.envid)}")
        # Addresses in UTF-8 only with SMTPUTF8 (RFC 6531 3.2); else they are ASCII.
        encoding = "utf-8" if message.smtputf8 else "ascii"
        try:
            mail = _command("MAIL FROM", message.sender, options, encoding)
        except UnicodeEncodeError as exc:  # nothing sent: the session is as it was
            return network("mail", "local", f"local error: {exc}")
        rcpts: list[bytes] = []
        unsent: dict[int, Reply] = {}
        for i, rcpt in enumerate(recipients):
            try:
                rcpts.append(_command("RCPT TO", rcpt.address, _rcpt_options(rcpt, dsn), encoding))
            except UnicodeEncodeError as exc:
                unsent[i] = network("rcpt", "local", f"local error: {exc}")
        if not rcpts:
            return unsent[0]
        return Exchange(mail, tuple(rcpts), body, chunking="chunking" in ext), unsent

    # -- the wire --------------------------------------------------------------------------

    async def _steps(self, exchange: Exchange, t: TimeoutsConfig) -> list[Reply]:
        """Write the steps and read a reply to each: in one write where the server
        pipelines, else each after the reply to the one before (lock-step stops at a
        refused MAIL, and before DATA when every RCPT was refused)."""
        if self.pipelining:
            if not self._write(b"".join(command for _, command in exchange.steps)):
                return [network("mail", "lost", "connection lost before MAIL was sent")]
            flushed = self.stream.flushed
            replies = await self._replies(exchange, t)
            self._time("mail", replies[0])
            if exchange.chunking and flushed and len(replies) == len(exchange.steps):
                self._time("dot", replies[-1])  # BDAT LAST's reply: the content's end
            return replies
        replies: list[Reply] = []
        for phase, command in exchange.steps:
            refused = replies and replies[0].code not in COMPLETES["mail"]
            none_left = phase != "rcpt" and not any(r.code // 100 == 2 for r in replies[1:])
            if refused or (len(replies) > 1 and none_left):
                break
            if not self._write(command):
                replies.append(network(phase, "lost", f"connection lost before {phase}"))
                break
            replies.append(await self._read(phase, _timeout(phase, t)))
            self._time("dot" if phase == "data_end" else phase, replies[-1])
            if replies[-1].code in (0, 421):  # the session is over
                break
        return replies

    async def _replies(self, exchange: Exchange, t: TimeoutsConfig) -> list[Reply]:
        """A reply to each step of a pipelined group, until a network event or a 421 ends
        the session. A group's replies come together: one that stops coming after the
        first (too few: a server that drops commands it reads ahead) is out of step."""
        replies: list[Reply] = []
        for phase, _ in exchange.steps:
            replies.append(await self._read(phase, _timeout(phase, t)))
            if replies[-1].code in (0, 421):
                if replies[-1].network == "timeout" and len(replies) > 1:
                    self.out_of_step = True
                break
        return replies

    async def _final(self, body: bytes, t: TimeoutsConfig) -> Reply:
        """The content after a 354, and the reply after its final dot: from the dot on,
        anything but a reply is ambiguous (the server may have the message), and only a
        2xx is a delivery."""
        if not self._write(body):
            return network("data", "lost", "connection lost before the content was sent")
        flushed = self.stream.flushed
        reply = await self._read("data_end", t.data_done)
        if flushed:
            self._time("dot", reply)
        if reply.code // 100 not in (2, 4, 5):
            self.close()  # a later reply could be taken for this one's
        return reply

    def _write(self, data: bytes) -> bool:
        try:
            self.stream.write(data)
        except StreamError:
            return False
        return True

    async def _read(self, phase: str, timeout: float) -> Reply:
        """The next reply, as a Reply of `phase`; a network event where none came (and
        then the session is closed)."""
        try:
            code, text = await self.stream.reply(timeout)
        except StreamError as exc:
            self.close()
            what = {"timeout": f"timed out waiting for the {phase} reply"}.get(exc.event)
            return network(phase, exc.event, what or f"{phase}: {exc}")
        if code == 421:  # the server closes: nothing more is read on this session
            self.close()
        return smtp_reply(phase, code, text)

    def _time(self, kind: str, reply: Reply) -> None:
        """`reply`, just read, as a sample of `kind` (a network event is none)."""
        if reply.code:
            self._timings.append((kind, self.stream.arrived - self.stream.written))

    def _out_of_step(self) -> None:
        """Replies came for other commands than ours: the session is closed, and this host
        is spoken to in lock-step from now on (the sender remembers it)."""
        self.out_of_step = True
        self.close()

    async def _reset(self) -> None:
        if not self.usable:
            return
        # (Read as a reply before the next MAIL.)
        reply = await self._read("mail", 30) if self._write(b"RSET\r\n") else None
        if reply is None or reply.code != 250:  # "421 too many errors" and the like
            log.warning("rset_failed", host=self.host, ip=self.ip, reply=reply and reply.line())
            self.close()

    async def quit(self) -> None:
        with contextlib.suppress(Exception):  # a courtesy: whatever happens, it is closed
            if self.usable and self.ahead is None and self._write(b"QUIT\r\n"):
                await self.stream.reply(10)
        self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError, RuntimeError):
            self.stream.close()


def _each(judged: Judged, unsent: dict[int, Reply], final: Reply | None, count: int) -> list[Reply]:
    """Each recipient's reply, in the message's order: left out, or as judged (the reply
    after the dot for those accepted)."""
    outcomes = iter(judged.recipients)
    return [unsent.get(i) or next(outcomes) or final for i in range(count)]  # type: ignore[misc]


def _timeout(phase: str, t: TimeoutsConfig) -> float:
    return {"mail": t.mail, "rcpt": t.rcpt, "data": t.data_start}.get(phase, t.data_done)


def _command(verb: str, address: str, options: list[str], encoding: str) -> bytes:
    """MAIL FROM:<address> or RCPT TO:<address>, with its parameters, as a line."""
    words = [f"{verb}:<{address}>".encode(encoding), *(o.encode("ascii") for o in options)]
    return b" ".join(words) + b"\r\n"


def _rcpt_options(rcpt: Recipient, dsn: bool) -> list[str]:
    options = []
    if dsn and rcpt.notify:
        options.append(f"NOTIFY={rcpt.notify}")
    if dsn and rcpt.orcpt:
        kind, _, address = rcpt.orcpt.partition(";")
        options.append(f"ORCPT={kind};{xtext_encode(address)}")
    return options


# A server answers with the same few texts over and over (a Reply is frozen): parsed once.
@functools.lru_cache(maxsize=256)
def smtp_reply(phase: str, code: int, message: str) -> Reply:
    """A server's reply; one without a valid code is no SMTP reply at all."""
    if 100 <= code < 600:
        return Reply.parse(phase, code, message)
    return network(phase, "protocol", f"protocol error: {message}"[:500])


def network(phase: str, event: str, text: str) -> Reply:
    return Reply(phase, 0, "", text, network=event)
