"""mtaqueue's revalidation against software we did not write: a Django view served by gunicorn.

    pip install django gunicorn   # not project dependencies: this bench's only
    sudo python bench/revalidation_django.py [--keep]

The bench writes a single-file Django project in its work directory (settings, one URL,
one view) and serves it with gunicorn (gthread workers, an access log) on 127.0.0.5. The
view reads the JSON body through Django's request, checks X-Mtaqueue-Signature as the
README says an application should (HMAC-SHA256 of "<t>.<body>" with the shared secret, an
old t refused: written here from that description, mtaqueue is not imported), records
what it verified, and answers from a table keyed by idempotency key: 200 (send), 410
(cancel), an exception (Django's own 500 page) or a sleep past revalidate.timeout.

mtaqueue (this tree, the shipped conf/mtaqueue.toml with the revalidate keys, the class's
revalidate_after, a short retry schedule and delivery.relayhost as overrides) delivers to
a private Postfix (tests/postfix_instance.py, receive mode, example.org kept in a Maildir)
that defers every recipient at first (451 4.3.0, no greylisting words); once each
message's first attempt was deferred (young: not checked) Postfix takes mail, and each
retry (late) is checked. Two more answers: a Django redirect (302, not followed) and a 200
StreamingHttpResponse (chunked by gunicorn). on_error is "hold": the 500, the slow answer
and the redirect put their messages in review; the table then says 200 and
`mtaqueue-ctl release --review` sends them. Webhooks go to a second view (events.jsonl):
the 410's "cancelled" event. Before mtaqueue starts, the bench asks the stream answer once
itself (http.client, "bench-probe"): gunicorn's access log does not show the chunking,
that reply's headers do. Needs root (Postfix's master); exits 2 when django, gunicorn or
Postfix are missing, 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import re
import smtplib
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # postfix_instance: a private Postfix
from common import free_port, print_checks, stop_process, work_directory  # noqa: E402
from postfix_instance import PostfixInstance, postfix_available  # noqa: E402
from postfix_smarthost import Mtaqueue  # noqa: E402

APP_HOST = "127.0.0.5"
SMTP_HOST = "127.0.0.1"  # Postfix binds only addresses an interface has
SECRET = "django-shared-secret"
PATH = "/mail/revalidate/"
TIMEOUT = 1.0  # revalidate.timeout
SLOW = 3.0  # the slow answer's sleep
PROBE_AGENT = "bench-probe"
# idempotency key -> what the view does
ANSWERS = {
    "order-200": 200,
    "order-410": 410,
    "order-500": "raise",  # Django's own 500 page (DEBUG off: HTML)
    "order-slow": "sleep",  # SLOW s, past revalidate.timeout
    "order-302": "redirect",  # a Django redirect: not followed, on_error
    "order-chunked": "stream",  # a 200 StreamingHttpResponse: gunicorn sends it chunked
}
TENANTS = dict.fromkeys(ANSWERS, "shop") | {"order-500": "billing", "order-slow": None}
HELD = {"order-500": 500, "order-slow": None, "order-302": 302}  # the first check's status
SENT = ("order-200", "order-chunked")

APP = r'''
"""A minimal Django project in one file: settings, one URL, one view (written by the bench)."""
import hashlib
import hmac
import json
import os
import time
from pathlib import Path

import django
from django.conf import settings
from django.http import HttpResponse, HttpResponseRedirect, JsonResponse, StreamingHttpResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

HERE = Path(__file__).resolve().parent
settings.configure(
    DEBUG=False,
    SECRET_KEY="bench-only",
    ALLOWED_HOSTS=[os.environ["APP_HOST"]],
    ROOT_URLCONF=__name__,
    MIDDLEWARE=[
        "django.middleware.security.SecurityMiddleware",
        "django.middleware.common.CommonMiddleware",
        "django.middleware.csrf.CsrfViewMiddleware",
    ],
    LOGGING={
        "version": 1,
        "disable_existing_loggers": False,
        "handlers": {"console": {"class": "logging.StreamHandler"}},
        "loggers": {"django": {"handlers": ["console"], "level": "INFO"}},
    },
)
django.setup()

SECRET = os.environ["REVALIDATE_SECRET"].encode()
TOLERANCE = 300


def verify(header, body):
    """The README's scheme: t=<epoch>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>."""
    fields = {}
    for part in header.split(","):
        key, _, value = part.strip().partition("=")
        fields[key] = value
    try:
        t = int(fields["t"])
    except (KeyError, ValueError):
        return False, "no t"
    if abs(time.time() - t) > TOLERANCE:
        return False, "t too old"
    mac = hmac.new(SECRET, str(t).encode() + b"." + body, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(mac, fields.get("v1", "")):
        return False, "bad v1"
    return True, "ok"


@csrf_exempt  # a machine-to-machine endpoint: the signature is its authentication
@require_POST
def revalidate(request):
    header = request.headers.get("X-Mtaqueue-Signature", "")
    valid, why = verify(header, request.body)
    body = json.loads(request.body) if request.content_type == "application/json" else None
    answers = json.loads((HERE / "answers.json").read_text())
    key = (body or {}).get("idempotency_key") or (body or {}).get("message_id")
    answer = answers.get(key, 200) if valid else 403
    seen = {
        "time": time.time(),
        "method": request.method,
        "path": request.path,
        "content_type": request.content_type,
        "content_length": request.headers.get("Content-Length"),
        "transfer_encoding": request.headers.get("Transfer-Encoding"),
        "user_agent": request.headers.get("User-Agent"),
        "signature": header,
        "valid": valid,
        "why": why,
        "body": body,
        "answer": answer,
        "pid": os.getpid(),
    }
    with open(HERE / "seen.jsonl", "a") as f:
        f.write(json.dumps(seen) + "\n")
    if answer == "raise":
        raise RuntimeError(f"the application failed on {key}")  # Django's 500 page
    if answer == "sleep":
        time.sleep(float(os.environ["SLOW"]))
        answer = 200
    if answer == "redirect":
        return HttpResponseRedirect("/mail/elsewhere/")
    if answer == "stream":
        chunks = iter([b'{"decision": ', b"200}"])
        return StreamingHttpResponse(chunks, content_type="application/json")
    if answer == 410:
        return HttpResponse("this order was cancelled\n", status=410, content_type="text/plain")
    return JsonResponse({"decision": answer}, status=answer)


@csrf_exempt
@require_POST
def events(request):
    """mtaqueue's webhooks (a JSON array of events), signed the same way."""
    valid, why = verify(request.headers.get("X-Mtaqueue-Signature", ""), request.body)
    if not valid:
        return HttpResponse(why, status=401, content_type="text/plain")
    with open(HERE / "events.jsonl", "a") as f:
        for event in json.loads(request.body):
            f.write(json.dumps(event) + "\n")
    return HttpResponse(status=204)


urlpatterns = [path("mail/revalidate/", revalidate), path("mail/events/", events)]

from django.core.wsgi import get_wsgi_application  # noqa: E402

application = get_wsgi_application()
'''


# client, request line, status, body bytes, user agent, seconds, Content-Type and
# Transfer-Encoding of the response
ACCESS_FORMAT = (
    '%(h)s "%(r)s" %(s)s %(b)s "%(a)s" %(L)ss %({content-type}o)s %({transfer-encoding}o)s'
)


class Gunicorn:
    """The Django app under gunicorn: its access log and error log in the work directory."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir / "app"
        self.dir.mkdir()
        (self.dir / "revalapp.py").write_text(APP)
        self.answers(ANSWERS | {"probe-chunked": "stream"})
        self.port = free_port(APP_HOST)
        self.url = f"http://{APP_HOST}:{self.port}{PATH}"
        self.access, self.errors = self.dir / "access.log", self.dir / "error.log"
        env = {"APP_HOST": APP_HOST, "REVALIDATE_SECRET": SECRET, "SLOW": str(SLOW)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "--chdir", str(self.dir),
             "--bind", f"{APP_HOST}:{self.port}", "--worker-class", "gthread",
             "--workers", "2", "--threads", "4", "--timeout", "30",
             "--access-logfile", str(self.access), "--error-logfile", str(self.errors),
             "--capture-output",  # Django's log (the 500's traceback) in the error log
             "--access-logformat", ACCESS_FORMAT,
             "revalapp:application"],
            env={**env, "PATH": "/usr/bin:/bin"}, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:  # a GET: 405 from require_POST once Django answers
            try:
                urllib.request.urlopen(self.url, timeout=2)
            except urllib.error.HTTPError as exc:
                if exc.code == 405:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"gunicorn did not start: {self.errors.read_text()}")
            time.sleep(0.2)

    def probe_chunked(self) -> str:
        """Ask the stream answer ourselves (signed with our own HMAC code, not mtaqueue's):
        the reply's Transfer-Encoding."""
        import hashlib
        import hmac
        import http.client

        body = json.dumps({"message_id": "probe", "idempotency_key": "probe-chunked"}).encode()
        t = int(time.time())
        mac = hmac.new(SECRET.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
        headers = {
            "Content-Type": "application/json",
            "X-Mtaqueue-Signature": f"t={t},v1={mac}",
            "User-Agent": PROBE_AGENT,
        }
        conn = http.client.HTTPConnection(APP_HOST, self.port, timeout=10)
        try:
            conn.request("POST", PATH, body, headers)
            response = conn.getresponse()
            response.read()
            return f"{response.status} {response.getheader('Transfer-Encoding')}"
        finally:
            conn.close()

    def answers(self, table: dict) -> None:
        (self.dir / "answers.json").write_text(json.dumps(table))

    def seen(self) -> list[dict]:
        path = self.dir / "seen.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def events(self) -> list[dict]:
        path = self.dir / "events.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def access_log(self) -> list[str]:
        return self.access.read_text().splitlines() if self.access.exists() else []

    def stop(self) -> None:
        stop_process(self.proc, 30)


def parse_access(line: str) -> tuple[str, ...]:
    """(method, path, status, content type, transfer encoding) of an ACCESS_FORMAT line."""
    m = re.search(r'"(\w+) (\S+) HTTP/[\d.]+" (\d+) \S+ ".*" [\d.]+s (.*) (\S+)$', line)
    return m.groups() if m else ("", "", "", "", "")


def submit(port: int, key: str, tenant: str | None, n: int) -> str:
    """One message to rcpt-N@example.org with its idempotency key (and tenant): its queue id."""
    head = f"X-Mtaqueue-Idempotency-Key: {key}\r\n"
    head += f"X-Tenant: {tenant}\r\n" if tenant else ""
    content = head + f"From: app@sender.test\r\nSubject: {key}\r\n\r\nabout {key}\r\n"
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as client:
        client.ehlo("app.test")
        client.mail("app@sender.test")
        client.rcpt(f"rcpt-{n}@example.org")
        code, reply = client.data(content.encode())
    assert code == 250, (code, reply)
    return reply.decode().rsplit(" ", 1)[1]


def run(workdir: Path) -> int:
    defer = workdir / "defer_rcpts"
    defer.write_text("example.org 451 4.3.0 temporary local problem\n")
    smtp_port = free_port(SMTP_HOST)
    app = Gunicorn(workdir)
    probe = app.probe_chunked()
    # The shipped config, and a [[webhooks]] entry (an array of tables: not an -o override)
    # for the Django app's events view.
    config = workdir / "mtaqueue.toml"
    hook = app.url.replace(PATH, "/mail/events/")
    config.write_text(
        (REPO / "conf" / "mtaqueue.toml").read_text()
        + f'\n[[webhooks]]\nurl = "{hook}"\nsecret = "{SECRET}"\n'
    )
    rows: list[tuple[str, list[str], bool]] = []
    try:
        with PostfixInstance(
            workdir / "postfix",
            listen=f"{SMTP_HOST}:{smtp_port}",
            mode="receive",
            domains=("example.org",),
            mailboxes=("example.org",),
            main_cf={"smtpd_recipient_restrictions": f"check_recipient_access texthash:{defer}"},
            cleanup=False,
        ) as pf:
            daemon = Mtaqueue(
                workdir,
                f"delivery.relayhost=[{SMTP_HOST}]:{smtp_port}",
                f'revalidate.url="{app.url}"',
                f'revalidate.secret="{SECRET}"',
                f"revalidate.timeout={TIMEOUT:g}s",
                "revalidate.on_error=hold",
                "classes.p1.revalidate_after=3s",
                "submission.tenant_header=X-Tenant",
                config=config,
                retry='["6s", "10s"]',
            )
            try:
                rows = exercise(workdir, pf, daemon, app, probe)
            except (TimeoutError, RuntimeError):
                for event in daemon.events[-10:]:
                    print(f"  mtaqueue: {json.dumps(event)[:300]}")
                raise
            finally:
                daemon.stop()
                time.sleep(1)  # postlogd writes asynchronously
                print("\nPostfix's maillog (smtpd NOQUEUE, virtual):")
                for line in pf.maillog.read_text(errors="replace").splitlines():
                    if re.search(r"NOQUEUE|virtual\[", line):
                        print("  " + re.sub(r"^\S+ \S+ ", "", line)[:200])
    finally:
        app.stop()
    print("\ngunicorn's access log:")
    for line in app.access_log():
        print("  " + line)
    print("\ngunicorn's error log (Django's, for the 500):")
    for line in app.errors.read_text().splitlines():
        print("  " + line)
    return print_checks(["check", "seen", "expected"], rows)


def exercise(
    workdir: Path, pf: PostfixInstance, daemon: Mtaqueue, app: Gunicorn, probe: str
) -> list:
    ids = {key: submit(daemon.port, key, TENANTS[key], n) for n, key in enumerate(ANSWERS)}
    who = {v: k for k, v in ids.items()}
    shown = {
        key: json.loads(daemon.ctl("show", "--json", queue_id)) for key, queue_id in ids.items()
    }
    shown = {k: (v[0] if isinstance(v, list) else v) for k, v in shown.items()}
    print("queued:", json.dumps(ids))
    daemon.wait("delivery", 30, count=len(ids), outcome="transient")
    (workdir / "defer_rcpts").write_text("")  # Postfix takes mail from now on
    subprocess.run(
        ["/usr/sbin/postfix", "-c", str(pf.config_dir), "reload"],
        check=True, capture_output=True, stdin=subprocess.DEVNULL, timeout=30,
    )  # fmt: skip
    print("first attempts deferred; Postfix reloaded to take mail")
    for key in SENT:
        daemon.wait("delivery", 60, outcome="delivered", id=ids[key])
    daemon.wait("deleted", 60, id=ids["order-410"])
    for key in HELD:
        daemon.wait("revalidation_failed", 60, id=ids[key])
    time.sleep(1)
    review = [json.loads(x) for x in daemon.ctl("review", "--json").splitlines()]
    stored_before = pf.stored("example.org")
    seen_before = [r for r in app.seen() if r["body"]["message_id"] != "probe"]

    # The application recovers: both held messages are asked again and go.
    app.answers(ANSWERS | dict.fromkeys(HELD, 200))
    released = daemon.ctl("release", "--review").strip()
    for key in HELD:
        daemon.wait("delivery", 60, outcome="delivered", id=ids[key])
    deadline = time.monotonic() + 30
    while not any(e["type"] == "cancelled" for e in app.events()) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(SLOW + 1)  # the slow request's own log line (its answer came after the timeout)
    stored = pf.stored("example.org")
    seen = [r for r in app.seen() if r["body"]["message_id"] != "probe"]
    access = [x for x in app.access_log() if f'"{PROBE_AGENT}"' not in x]
    events = daemon.events

    def ev(name: str, key: str) -> list[dict]:
        return [e for e in events if e.get("event") == name and e.get("id") == ids[key]]

    def status_of(key: str) -> tuple:
        """The first check's status, decision and error (a release asks again)."""
        e = next(x for x in events if x.get("event") in ("revalidated", "revalidation_failed")
                 and x.get("id") == ids[key])  # fmt: skip
        return e.get("status"), e.get("decision"), e.get("error")

    def subject_in(key: str, mails: list[bytes]) -> bool:
        return any(f"Subject: {key}".encode() in m for m in mails)

    rows = []

    def check(name: str, seen_: object, expected: object, ok: bool) -> None:
        rows.append((str(len(rows) + 1), [name, str(seen_), str(expected)], ok))

    for key in SENT:
        s = status_of(key)
        check(f"{key}: status, decision, delivered to Postfix",
              (s[:2], subject_in(key, stored_before)), ((200, "send"), True),
              s[:2] == (200, "send") and subject_in(key, stored_before))  # fmt: skip
    s = status_of("order-410")
    deleted = ev("deleted", "order-410")
    reason = deleted[0].get("reason") if deleted else None
    dsns = [e for e in events if e.get("event") == "dsn_queued"]
    gone_ok = (
        s[:2] == (410, "cancel")
        and reason == "cancelled by revalidation"
        and not dsns
        and not subject_in("order-410", stored)
        and ids["order-410"] not in daemon.ctl("list")
    )
    check("410: decision, deleted reason, DSNs, reached Postfix",
          (s[:2], reason, len(dsns), subject_in("order-410", stored)),
          ((410, "cancel"), "cancelled by revalidation", 0, False), gone_ok)  # fmt: skip
    told = sorted((e["type"], e.get("reason")) for e in app.events()
                  if e["message_id"] == ids["order-410"])  # fmt: skip
    want_told = [("accepted", None), ("cancelled", "cancelled by revalidation"), ("deferred", None)]
    check("410: webhook events to the Django app (type, reason)", told, want_told,
          told == want_told)  # fmt: skip
    delivered_told = sorted(e["idempotency_key"] for e in app.events() if e["type"] == "delivered")
    want_delivered = sorted([*SENT, *HELD])
    check("webhook 'delivered' events", delivered_told, want_delivered,
          delivered_told == want_delivered)  # fmt: skip
    held = {e["id"]: e.get("reason") for e in review}
    for key, want in HELD.items():
        s = status_of(key)
        ok = (
            s[:2] == (want, "hold")
            and held.get(ids[key]) == "revalidation"
            and not subject_in(key, stored_before)
            and subject_in(key, stored)
        )
        check(f"{key}: status, decision, in review, held back, sent after release",
              (s[:2], held.get(ids[key]), subject_in(key, stored_before), subject_in(key, stored)),
              ((want, "hold"), "revalidation", False, True), ok)  # fmt: skip
    slow = status_of("order-slow")
    check("slow: error names the timeout", slow[2], f"within {TIMEOUT:g}s",
          bool(slow[2]) and f"{TIMEOUT:g}s" in slow[2])  # fmt: skip
    want_released = f"released {len(HELD)} messages"
    check("release --review", released, want_released, released == want_released)

    # The access log: one POST PATH a request, with the status the view gave.
    want_status = {k: str(v) for k, v in (HELD | {"order-slow": 200, "order-410": 410}).items()}
    want_status |= dict.fromkeys(SENT, "200")
    asked = list(seen_before)
    lines = [parse_access(x) for x in access]
    posts = sorted(line[:3] for line in lines if line[:2] == ("POST", PATH))
    expected_posts = sorted(
        [("POST", PATH, want_status[k]) for k in ANSWERS] + [("POST", PATH, "200")] * len(HELD)
    )
    check("access log: POSTs (method, path, status)", posts, expected_posts,
          posts == expected_posts)  # fmt: skip
    elsewhere = [line[:3] for line in lines if line[1] == "/mail/elsewhere/"]
    check("access log: the redirect not followed (requests to its Location)", elsewhere, [],
          elsewhere == [])  # fmt: skip
    error_pages = {line[3] for line in lines if line[2] == "500"}
    check("access log: the 500 is Django's HTML page", sorted(error_pages),
          ["text/html; charset=utf-8"], error_pages == {"text/html; charset=utf-8"})  # fmt: skip
    check("the stream answer is chunked (probe: status, Transfer-Encoding)", probe,
          "200 chunked", probe == "200 chunked")  # fmt: skip
    check("view: requests before release, one a message", len(asked), len(ANSWERS),
          sorted(r["body"]["idempotency_key"] for r in asked) == sorted(ANSWERS))  # fmt: skip
    check("view: every signature valid (README's scheme)", [r["why"] for r in seen], "all ok",
          bool(seen) and all(r["valid"] for r in seen))  # fmt: skip
    framing = {(r["content_type"], r["transfer_encoding"], bool(r["content_length"])) for r in seen}
    check("view: request Content-Type, Transfer-Encoding, Content-Length", sorted(framing),
          [("application/json", None, True)],
          all(r["content_type"] == "application/json" and r["transfer_encoding"] is None
              and r["content_length"] for r in seen))  # fmt: skip
    agents = sorted({r["user_agent"] for r in seen})
    check("view: User-Agent", agents, "mtaqueue/VERSION",
          len(agents) == 1 and agents[0].startswith("mtaqueue/"))  # fmt: skip
    fields_ok, diffs = True, []
    for r in seen:
        body = r["body"]
        key = who.get(body["message_id"])
        m = shown.get(key, {})
        age_ok = abs(body["age"] - (r["time"] - m.get("created", 0))) < 1.5
        same = (
            key is not None
            and sorted(body) == ["age", "class", "idempotency_key", "message_id", "tenant"]
            and body["idempotency_key"] == m["idempotency_key"] == key
            and body["class"] == m["class"]
            and body["tenant"] == m["tenant"] == TENANTS[key]
            and age_ok
            and body["age"] >= 3
        )
        if not same:
            diffs.append((body, {k: m.get(k) for k in ("id", "class", "tenant", "created")}))
        fields_ok &= same
    check("JSON body = show --json (id, key, class, tenant, age)",
          diffs or f"{len(seen)} bodies equal", "equal", fields_ok and bool(seen))  # fmt: skip
    print("\nwhat the view recorded:")
    for r in seen:
        print(f"  {r['body']} valid={r['valid']} answer={r['answer']} sig={r['signature'][:30]}...")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    try:
        import django  # noqa: F401
        import gunicorn  # noqa: F401
    except ImportError:
        print("needs django and gunicorn: pip install django gunicorn", file=sys.stderr)
        return 2
    if not postfix_available():
        print("needs root and Postfix", file=sys.stderr)
        return 2
    with work_directory("revalidation-django-", keep=args.keep) as workdir:
        return run(workdir)


if __name__ == "__main__":
    sys.exit(main())
