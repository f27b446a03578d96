"""The HTTP API end to end: the daemon as a subprocess, real HTTP clients (urllib, curl),
real SMTP peers; every answer checked against the daemon's OpenAPI document."""

from __future__ import annotations

import base64
import email
import email.policy
import json
import os
import shutil
import signal
import subprocess
import threading
import time

import pytest
from api_client import TOKENS, TOKENS_FILE, ApiClient, Contract
from e2e_helpers import FAST, MailNet, wait_for
from openapi_spec_validator import validate as validate_spec
from test_crash_e2e import writer_pid
from test_webhooks_e2e import hook_config
from webhook_receiver import WebhookReceiver

from mtaqueue.api.openapi import OPENAPI_PATH, document
from mtaqueue.api.server import Api
from mtaqueue.api.tokens import Tokens


@pytest.fixture
def start_api(start_daemon, tmp_path):
    """Factory: a daemon serving the API with TOKENS (overrides as for start_daemon), and
    a client of it that checks every answer against the served OpenAPI document."""
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS_FILE)
    tokens.chmod(0o600)

    def start(*overrides: str, **kw) -> tuple:
        daemon = start_daemon(
            "api.address=127.0.0.1:0", f"api.tokens_file={tokens}", *overrides, **kw
        )
        served = ApiClient(daemon).get(OPENAPI_PATH, token=None)
        assert served.status == 200
        return daemon, ApiClient(daemon, Contract(served.body))

    return start


def test_the_served_document_is_valid_openapi_and_documents_every_route():
    doc = document()
    validate_spec(doc)
    routes = {
        (route.method, route.resource.canonical)
        for route in Api(None, Tokens([])).app().router.routes()  # type: ignore[arg-type]
        if route.method != "HEAD"  # aiohttp's, with each GET
    }
    documented = {(m.upper(), path) for path, item in doc["paths"].items() for m in item}
    assert routes == documented


def test_every_documented_operation_answers_as_documented(start_api):
    _, api = start_api()
    contract = api.contract
    served = api.get(OPENAPI_PATH, token=None).body  # with the classes and limits configured
    assert served == json.loads(json.dumps(document(("p0", "p1", "p2"), 1000)))
    accepted = api.submit(key="order-1", token="shop")
    assert accepted.status == 202
    queue_id = accepted.body["id"]
    assert api.get(f"/v1/messages/{queue_id}").status == 200
    assert api.get("/v1/messages?idempotency_key=order-1&tenant=shop").status == 200
    assert api.put("/v1/suppressions/gone@example.org").status == 200
    assert api.get("/v1/suppressions").status == 200
    assert api.delete("/v1/suppressions/gone@example.org").status == 200
    assert api.delete(f"/v1/messages/{queue_id}").status == 200
    again = api.submit(key="order-2")
    assert api.delete("/v1/messages?idempotency_key=order-2").body["id"] == again.body["id"]
    every = {(m.upper(), path) for path, item in document()["paths"].items() for m in item}
    assert contract.exercised == every


def test_a_message_submitted_by_api_is_delivered_with_its_attempt_history(start_api):
    with MailNet(["127.0.0.2"]) as net:
        (peer,) = net.peers
        net.add_domain("example.org", "127.0.0.2")
        peer.on("rcpt", "451 4.3.0 mailbox busy", times=1)
        daemon, api = start_api(*net.daemon_overrides(), *FAST, 'retry.schedule=["60s"]')
        logo = bytes(range(256)) * 4
        b64 = lambda data: base64.b64encode(data).decode()  # noqa: E731
        answer = api.submit(
            **{"from": "Shop <shop@example.com>"},
            to=["Bob <bob@example.org>"],
            subject="Your order ✓",
            text="Thanks for your order.\n",
            html='<p>Thanks! <img src="cid:logo"></p>\n',
            attachments=[
                {"filename": "invoice.txt", "content": b64(b"total: 42\n")},
                {"filename": "logo.png", "content": b64(logo), "content_id": "logo"},
            ],
            headers={"Reply-To": "help@example.com"},
            **{"class": "p0"},
        )  # fmt: skip
        assert answer.status == 202
        queue_id = answer.body["id"]
        # The first attempt is deferred: the message shows it, as `list --json` does.
        deferred = wait_for(
            lambda: (
                (m := api.get(f"/v1/messages/{queue_id}").body)["recipients"][0]["attempts"] and m
            ),
            what="the first attempt",
        )
        (listed,) = [m for m in daemon.messages().values() if m["id"] == queue_id]
        assert deferred == listed
        (rcpt,) = deferred["recipients"]
        assert rcpt["state"] == "deferred" and rcpt["history"][0]["reply"].startswith("451")
        assert deferred["class"] == "p0" and deferred["sender"] == "shop@example.com"

        assert daemon.ctl("flush", "--all").returncode == 0
        (received,) = wait_for(lambda: peer.messages, what="delivery")
        assert received.mail_from == "shop@example.com" and received.rcpt_tos == ["bob@example.org"]
        msg = email.message_from_bytes(received.content, policy=email.policy.default)
        assert msg["Subject"] == "Your order ✓" and msg["To"] == "Bob <bob@example.org>"
        assert msg["Reply-To"] == "help@example.com" and msg["Message-ID"]
        assert "with HTTP" in msg["Received"] and f"id {queue_id}" in msg["Received"]
        assert msg.get_body(("plain",)).get_content().rstrip() == "Thanks for your order."
        parts = {p.get_filename(): p for p in msg.iter_attachments()}
        assert parts["invoice.txt"].get_content() == "total: 42\n"
        assert (
            parts["logo.png"].get_content() == logo and parts["logo.png"]["Content-ID"] == "<logo>"
        )
        assert received.content.isascii()  # 7-bit clean: any receiver takes it
        wait_for(lambda: api.get(f"/v1/messages/{queue_id}").status == 404, what="it to leave")


def test_raw_goes_through_the_same_header_preparation_as_smtp(start_api):
    daemon, api = start_api()
    raw = (
        "From: app@example.com\nSubject: raw\nX-Mtaqueue-Class: p2\n"
        "X-Mtaqueue-Expires: 1h\n\nline one\n.line two starts with a dot\n"
    )
    answer = api.submit(raw=raw)
    assert answer.status == 202
    message = api.get(f"/v1/messages/{answer.body['id']}").body
    assert message["class"] == "p2"
    assert message["expires"] - message["created"] == pytest.approx(3600)
    stored = daemon.stored(answer.body["id"])
    assert b"X-Mtaqueue" not in stored and stored.startswith(b"Received: from [127.0.0.1]")
    assert stored.endswith(b"\r\n\r\nline one\r\n.line two starts with a dot\r\n")
    assert b"\r\nMessage-ID: <" in stored and b"\r\nDate: " in stored
    # The request's fields win over the raw message's headers.
    steered = api.submit(raw=raw, expires="2h", **{"class": "p0"}).body["id"]
    message = api.get(f"/v1/messages/{steered}").body
    assert message["class"] == "p0"
    assert message["expires"] - message["created"] == pytest.approx(7200)
    refused = api.submit(raw="X-Mtaqueue-Class: urgent\n\nx\n")
    assert refused.status == 400 and "urgent" in refused.body["error"]


def test_idempotency_key_within_the_window_and_per_tenant(start_api):
    daemon, api = start_api()
    first = api.submit(key="order-7", token="shop")
    again = api.submit(key="order-7", token="shop", subject="resent")
    assert (first.status, again.status) == (202, 200)
    assert again.body == {"id": first.body["id"], "duplicate": True}
    other_tenant = api.submit(key="order-7", token="blog")
    assert other_tenant.status == 202 and other_tenant.body["id"] != first.body["id"]
    found = api.get("/v1/messages?idempotency_key=order-7", token="shop").body["messages"]
    assert [m["id"] for m in found] == [first.body["id"]] and found[0]["tenant"] == "shop"
    assert api.get("/v1/messages?idempotency_key=nope", token="shop").body == {"messages": []}
    daemon.restart()  # the key is durable, as over SMTP
    api = ApiClient(daemon, api.contract)
    assert api.submit(key="order-7", token="shop").body["id"] == first.body["id"]
    assert len(daemon.messages()) == 2


def test_a_tenant_token_sees_and_cancels_only_its_own_mail(start_api):
    daemon, api = start_api()
    shop = api.submit(key="k", token="shop").body["id"]
    assert daemon.messages()[shop]["tenant"] == "shop"
    assert api.get(f"/v1/messages/{shop}", token="blog").status == 404
    assert api.delete(f"/v1/messages/{shop}", token="blog").status == 404
    assert api.get("/v1/messages?idempotency_key=k", token="blog").body == {"messages": []}
    assert api.get("/v1/messages?idempotency_key=k&tenant=shop", token="blog").status == 403
    assert api.get(f"/v1/messages/{shop}", token="shop").status == 200
    assert api.get(f"/v1/messages/{shop}").status == 200  # the operator sees all
    assert api.get("/v1/suppressions", token="shop").status == 403
    assert api.put("/v1/suppressions/x@example.org", token="shop").status == 403
    assert shop in daemon.messages()


def test_cancel_removes_what_is_not_delivered_without_a_dsn(start_api):
    daemon, api = start_api()
    queue_id = api.submit(to=["a@example.org", "b@example.org"], token="shop").body["id"]
    cancelled = api.delete(f"/v1/messages/{queue_id}", token="shop")
    assert cancelled.status == 200
    assert cancelled.body == {"id": queue_id, "cancelled": ["a@example.org", "b@example.org"]}
    assert queue_id not in daemon.messages()
    assert api.get(f"/v1/messages/{queue_id}").status == 404
    assert api.delete(f"/v1/messages/{queue_id}").status == 409  # test_api_edges_e2e.py
    deleted = daemon.wait_event("deleted")
    assert deleted["id"] == queue_id and deleted["reason"] == "cancelled"
    by_key = api.submit(key="order-9").body["id"]
    assert api.delete("/v1/messages?idempotency_key=order-9").body["id"] == by_key
    assert api.delete("/v1/messages?idempotency_key=order-9").status == 409
    daemon.restart()  # the cancel was durable
    assert daemon.messages() == {}


def test_the_application_hears_the_tenants_accepted_and_cancelled_events(start_api):
    with WebhookReceiver() as receiver:
        _, api = start_api(config=hook_config(receiver))
        queue_id = api.submit(key="order-5", token="shop").body["id"]
        assert api.delete(f"/v1/messages/{queue_id}", token="shop").status == 200
        wait_for(lambda: receiver.of("cancelled"), what="the cancelled event")
        evs = [(e["type"], e["tenant"], e["idempotency_key"]) for e in receiver.events]
        assert evs == [("accepted", "shop", "order-5"), ("cancelled", "shop", "order-5")]
        assert {e["message_id"] for e in receiver.events} == {queue_id}


def test_suppressions_round_trip_and_refuse_the_address_over_api_and_smtp(start_api):
    daemon, api = start_api()
    put = api.put("/v1/suppressions/Gone@Example.org", {"reason": "unsubscribed", "for": "1h"})
    assert put.status == 200 and put.body["address"] == "gone@example.org"
    assert 3590 < put.body["until"] - time.time() <= 3600
    listed = api.get("/v1/suppressions").body["suppressions"]
    assert listed == [put.body]
    assert json.loads(daemon.ctl("suppress", "list", "--json").stdout) == put.body
    refused = api.submit(to=["ok@example.org", "gone@example.org"])
    assert refused.status == 422 and refused.body["error"].startswith("to[1]: <gone@example.org>")
    assert "unsubscribed" in refused.body["error"]
    with daemon.smtp() as client:
        client.mail("app@example.com")
        code, reply = client.rcpt("gone@example.org")
        assert code == 550 and b"suppressed" in reply
    assert api.put("/v1/suppressions/not-an-address").status == 400
    assert api.put("/v1/suppressions/x@example.org", {"for": "soon"}).status == 400
    assert api.put("/v1/suppressions/x@example.org", {"until": 1}).status == 400
    blank = {"Content-Type": "application/json"}  # (schemathesis found it: "\t" was taken)
    assert api.put("/v1/suppressions/x@example.org", data=b"\t", headers=blank).status == 400
    assert api.put("/v1/suppressions/y@example.org", data=b"", headers=blank).status == 200
    assert api.delete("/v1/suppressions/y@example.org").status == 200
    assert api.delete("/v1/suppressions/gone@example.org").body == {
        "address": "gone@example.org",
        "removed": True,
    }
    assert api.delete("/v1/suppressions/gone@example.org").status == 404
    assert api.get("/v1/suppressions").body == {"suppressions": []}
    assert api.submit(to=["gone@example.org"]).status == 202


def test_refusals_name_the_field_and_have_the_right_status(start_api):
    daemon, api = start_api(
        "listen.max_message_size=20000", "listen.max_recipients=2", "listen.max_line_length=1000"
    )
    missing = api.get("/v1/suppressions", token=None)
    assert (
        missing.status == 401 and missing.headers["WWW-Authenticate"] == 'Bearer realm="mtaqueue"'
    )
    wrong = api.get("/v1/suppressions", token="not-a-token-of-ours-at-all")
    assert wrong.status == 401 and 'error="invalid_token"' in wrong.headers["WWW-Authenticate"]
    cases = [
        ({"to": "a@example.org"}, "$.to"),
        ({"to": []}, "to:"),
        ({"to": ["a@example.org"] * 3}, "to: more than 2"),
        ({"to": ["ok@example.org", "not an address"]}, "to[1]:"),
        ({"from": "nobody"}, "from:"),
        ({"class": "urgent"}, "class: unknown class 'urgent' (known: p0, p1, p2)"),
        ({"expires": "last week"}, "expires:"),
        ({"text": None, "html": None}, "text:"),
        ({"raw": "Subject: x\n\nx\n"}, "raw:"),  # with subject and text too
        ({"colour": "blue"}, "colour"),
        ({"headers": {"Bad Name": "x"}}, "headers:"),
        ({"headers": {"X-A": "one\r\nX-B: two"}}, "headers.X-A"),
        ({"headers": {"Subject": "again"}}, "headers.Subject"),
        ({"attachments": [{"filename": "a", "content": "***"}]}, "attachments[0].content"),
        (
            {"attachments": [{"filename": "a", "content": "", "content_type": "text/"}]},
            "attachments[0].content_type",
        ),
        ({"subject": "one\nX-Injected: two"}, "subject:"),
    ]
    for fields, named in cases:
        answer = api.submit(**fields) if "raw" not in fields else api.post(
            "/v1/messages", {"from": "a@b.org", "to": ["a@example.org"], "subject": "s",
                             "text": "t", **fields})  # fmt: skip
        assert answer.status == 400 and named in answer.body["error"], (fields, answer)
    past = api.submit(expires="2000-01-01T00:00:00Z")  # valid, but the moment refuses it
    assert past.status == 422 and "is already past" in past.body["error"]
    schema = api.get(OPENAPI_PATH, token=None).body["components"]["schemas"]["Submission"]
    assert schema["properties"]["to"]["maxItems"] == 2  # listen.max_recipients
    assert schema["properties"]["class"]["enum"] == ["p0", "p1", "p2", None]
    large = api.submit(raw="Subject: x\n\n" + "x" * 100_000 + "\n")
    assert large.status == 413 and "request body is larger" in large.body["error"]
    long_line = api.submit(raw="Subject: x\n\n" + "x" * 1001 + "\n")
    assert long_line.status == 400 and "line over 1000" in long_line.body["error"]
    too_big = api.submit(raw="Subject: x\n\n" + "x\n" * 10500)
    assert too_big.status == 413 and too_big.body["error"].startswith("raw: message too big")
    key = api.submit(key="k" * 257)
    assert key.status == 400 and key.body["error"].startswith("Idempotency-Key:")
    not_json = api.post("/v1/messages", data=b"from=a", headers={"Content-Type": "text/plain"})
    assert not_json.status == 415
    broken = api.post("/v1/messages", data=b"{", headers={"Content-Type": "application/json"})
    assert broken.status == 400 and "not JSON" in broken.body["error"]
    assert api.get("/v1/messages/0000000000000000").status == 404
    assert api.get("/v1/messages").status == 400  # no idempotency_key
    assert api.request("PATCH", "/v1/messages").status == 405
    assert api.get("/v1/nothing").status == 404
    assert daemon.messages() == {}  # nothing refused left anything behind


def test_202_only_once_the_message_is_durable(start_api):
    daemon, api = start_api()
    pid = writer_pid(daemon)
    os.kill(pid, signal.SIGSTOP)  # the writer cannot sync anything
    answers = []
    thread = threading.Thread(target=lambda: answers.append(api.submit()), daemon=True)
    try:
        thread.start()
        thread.join(1.5)
        assert answers == []  # waiting for the disk
    finally:
        os.kill(pid, signal.SIGCONT)
    thread.join(30)
    (answer,) = answers
    assert answer.status == 202 and answer.body["id"] in daemon.messages()


def test_a_full_spool_is_a_507_with_retry_after(start_api):
    daemon, api = start_api('spool.min_free="99.9%"')
    answer = api.submit()
    assert answer.status == 507 and answer.headers["Retry-After"] == "30"
    assert daemon.messages() == {}


def test_no_tokens_means_every_request_is_refused(start_daemon):
    daemon = start_daemon("api.address=127.0.0.1:0")
    assert daemon.wait_event("api_no_tokens")["key"] == "api.tokens_file"
    api = ApiClient(daemon)
    assert api.get("/v1/suppressions").status == 401
    assert api.submit().status == 401


def test_the_tokens_file_is_read_again_on_reload(start_api, tmp_path):
    daemon, api = start_api()
    (tmp_path / "tokens").write_text("new-token-0123456789abcdef shop\n")
    daemon.proc.send_signal(signal.SIGHUP)
    daemon.wait_event("reloaded")
    assert api.submit(token="new-token-0123456789abcdef").status == 202
    assert api.submit(token="shop").status == 401  # revoked
    (tmp_path / "tokens").write_text("short\n")
    daemon.proc.send_signal(signal.SIGHUP)
    assert "api.tokens_file: line 1" in daemon.wait_event("reload_failed")["error"]
    assert api.submit(token="new-token-0123456789abcdef").status == 202  # the old ones stay


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_submits_a_large_message_and_reads_it_back(start_api, tmp_path):
    """curl, a client we did not write, with a message past spool.stream_threshold (its
    file written as the listener writes a streamed one) and a body decoded in a thread."""
    daemon, api = start_api()
    blob = os.urandom(600_000)
    attachment = {"filename": "blob.bin", "content": base64.b64encode(blob).decode()}
    request = tmp_path / "request.json"
    request.write_text(
        json.dumps(
            {
                "from": "app@example.com",
                "to": ["a@example.org"],
                "subject": "big",
                "text": "see attached\n",
                "attachments": [attachment],
            }
        )
    )  # fmt: skip

    def curl(*args: str) -> tuple[int, dict]:
        result = subprocess.run(
            ["curl", "-sS", "-w", "\\n%{http_code}",
             "-H", f"Authorization: Bearer {TOKENS['shop']}", *args],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        body, _, status = result.stdout.rpartition("\n")
        return int(status), json.loads(body)

    status, body = curl(
        "-H", "Content-Type: application/json", "-H", "Idempotency-Key: big-1",
        "--data-binary", f"@{request}", f"{api.base}/v1/messages",
    )  # fmt: skip
    assert status == 202
    queue_id = body["id"]
    stored = email.message_from_bytes(daemon.stored(queue_id), policy=email.policy.default)
    (attachment,) = stored.iter_attachments()
    assert attachment.get_content() == blob
    status, shown = curl(f"{api.base}/v1/messages/{queue_id}")
    assert status == 200 and shown["tenant"] == "shop" and shown["size"] > 800_000
    status, found = curl(f"{api.base}/v1/messages?idempotency_key=big-1")
    assert status == 200 and [m["id"] for m in found["messages"]] == [queue_id]
    status, cancelled = curl("-X", "DELETE", f"{api.base}/v1/messages/{queue_id}")
    assert status == 200 and cancelled["cancelled"] == ["a@example.org"]
