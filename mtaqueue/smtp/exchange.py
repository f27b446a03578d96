"""One mail transaction as the client writes it, and what its replies mean. Pure: no I/O.

    Exchange(mail, rcpts, content, chunking)
    .steps -> [(phase, bytes)]   MAIL, each RCPT, then DATA, or BDAT with the content
    .body() -> bytes             after a 354: the content dot-stuffed, and its final dot
    judge(replies, count, chunking) -> Judged
        what the replies read so far (mail, rcpt..., data|data_end; cut short by a network
        event, a 421 or a step not taken) settle: each recipient's reply, or None while
        its content is yet to go; whether the content goes; whether an RSET is due

With PIPELINING (RFC 2920) the client writes the steps in one go and reads one reply per
step, in order; with CHUNKING (RFC 3030) the content rides in the same write behind
`BDAT n LAST`, so a transaction is one round trip. Lock-step, it writes a step only
after the reply to the one before, and stops at a refused MAIL or when no recipient is
left. Either way the same judgement applies.

A server out of step (a code that no reply to that command may have: 354 to RCPT, 250
to DATA, 250 to RCPT after a refused MAIL, 2xx to BDAT with no recipient) has every
reply of the group in doubt: an extra reply shifts each later one onto the wrong
command. Then no recipient keeps what was read: each gets a protocol event at the step
it reached (after the content went with BDAT: ambiguous, as any doubt after the content).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..policy.replies import COMPLETES, Reply


@dataclass(frozen=True, slots=True)
class Exchange:
    mail: bytes  # each a CRLF-terminated command line
    rcpts: tuple[bytes, ...]
    content: bytes  # as prepared for the hop, CRLF-terminated
    chunking: bool

    @property
    def steps(self) -> list[tuple[str, bytes]]:
        if self.chunking:
            last = ("data_end", b"BDAT %d LAST\r\n" % len(self.content) + self.content)
        else:
            last = ("data", b"DATA\r\n")
        return [("mail", self.mail), *(("rcpt", rcpt) for rcpt in self.rcpts), last]

    def body(self) -> bytes:
        # Every line that starts with a dot gets one more (RFC 5321 4.5.2): a line
        # starts at the content's start and after each LF, as `^` in a MULTILINE regex,
        # which scanned every octet (replace finds each LF as memchr does).
        stuffed = self.content.replace(b"\n.", b"\n..")
        if stuffed.startswith(b"."):
            stuffed = b"." + stuffed
        return stuffed + b".\r\n"


@dataclass(frozen=True, slots=True)
class Judged:
    recipients: list[Reply | None]  # None: accepted, its content goes next (DATA only)
    content: bool  # DATA got its 354 and a recipient waits: the content goes
    lone_dot: bool  # a 354 with no recipient left: end it with a lone dot (RFC 2920 3.1)
    reset: bool  # a transaction may be open on the server: RSET before the next
    in_step: bool


def judge(replies: list[Reply], count: int, chunking: bool) -> Judged:
    """The transaction's state after `replies` (to MAIL, then RCPTs, then DATA/BDAT, as
    many as were read) for `count` recipients."""
    wrong = _out_of_step(replies, count, chunking)
    if wrong is not None:
        return Judged([wrong] * count, False, False, False, False)
    mail, rcpts = replies[0], replies[1 : count + 1]
    last = replies[count + 1] if len(replies) == count + 2 else None
    ended = replies[-1] if _ends_session(replies[-1]) else None
    if mail.code not in COMPLETES["mail"]:  # (RSET all the same, as before any reuse)
        return Judged([mail] * count, False, False, ended is None, True)
    recipients: list[Reply | None] = [r if r.code // 100 != 2 else None for r in rcpts]
    recipients += [ended] * (count - len(rcpts))  # not read: the session ended first
    accepted = [i for i, r in enumerate(recipients) if r is None]
    if ended is not None or last is None:  # no reply to DATA/BDAT: no content went
        for i in accepted:  # (lock-step stops before DATA only when none is accepted)
            recipients[i] = ended
        return Judged(recipients, False, False, ended is None, True)
    if last.phase == "data" and last.code == 354:
        return Judged(recipients, bool(accepted), not accepted, not accepted, True)
    for i in accepted:
        recipients[i] = last  # the BDAT's outcome, or DATA refused
    return Judged(recipients, False, False, last.code // 100 != 2, True)


def _out_of_step(replies: list[Reply], count: int, chunking: bool) -> Reply | None:
    """What each recipient gets when a reply came that no server in step with us would
    give: that reply, if its code does not fit its step (the policy reads it as a
    protocol error); else a protocol event there; after content sent with BDAT, a
    protocol event after the content: ambiguous. None: in step."""
    mail_refused = replies[0].code != 0 and replies[0].code not in COMPLETES["mail"]
    for i, reply in enumerate(replies):
        if reply.code == 0:  # a network event ends the group: not a reply
            continue
        fits = reply.code in COMPLETES[reply.phase] or 400 <= reply.code < 600
        # After a refused MAIL a RCPT accepted or a DATA that waits for content is a
        # server that took a reply for another command.
        if not fits or (i > 0 and mail_refused and reply.code in (250, 251, 354)):
            if reply.phase == "data_end":
                break
            if not fits:  # read as a protocol error where it came
                return reply
            text = f"protocol error: {reply.code} to {reply.phase} after a refused MAIL"
            return Reply(reply.phase, 0, "", text, network="protocol")
    else:
        last = replies[count + 1] if len(replies) == count + 2 else None
        if not (chunking and last is not None and last.code // 100 == 2):
            return None
        if any(r.code // 100 == 2 for r in replies[1 : count + 1]):
            return None  # delivered to a recipient accepted
    text = "protocol error: replies out of step with the commands"
    return Reply("data_end", 0, "", text, network="protocol")


def _ends_session(reply: Reply) -> bool:
    return reply.code == 0 or reply.code == 421
