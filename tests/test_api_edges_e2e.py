"""The API's edges against the running daemon: an Idempotency-Key given but not a key is a
400 (nothing queued), and a DELETE of mail that has left the queue is a 409 naming its
state (cancelled, deleted, delivered, bounced), never telling one tenant of another's.
Every answer is checked against the served OpenAPI document (api_client.py)."""

from __future__ import annotations

from api_client import ApiClient
from e2e_helpers import FAST, MailNet, wait_for
from test_api_e2e import start_api  # noqa: F401  (a fixture)

from mtaqueue.submission import MAX_KEY_LENGTH


def _utf8(text: str) -> str:
    """`text` as urllib sends it: header values go out as Latin-1, so this sends UTF-8."""
    return text.encode().decode("latin-1")


def test_a_key_given_but_not_a_key_is_a_400_naming_the_header(start_api):  # noqa: F811
    daemon, api = start_api()
    for key, why in [
        ("", "empty"),
        ("   ", "empty"),  # HTTP drops the spaces around a value: also empty
        ("\t", "empty"),
        ("k" * (MAX_KEY_LENGTH + 1), f"longer than {MAX_KEY_LENGTH}"),
        (_utf8("order-1\u00a0"), "a space at either end"),  # no-break space: not stripped
        (_utf8("a\u200b"), "a space at either end"),
        ("order-\xff", "not valid UTF-8"),  # the octet 0xff
    ]:
        answer = api.submit(key=key)
        assert answer.status == 400, (key, answer)
        assert answer.body["error"].startswith("Idempotency-Key: "), answer
        assert why in answer.body["error"], (key, answer)
    assert daemon.messages() == {}
    # The limits' own edges are keys: as long as allowed, UTF-8, spaces inside.
    longest = api.submit(key="k" * MAX_KEY_LENGTH)
    unicode = api.submit(key=_utf8("commande-é №1"))
    assert (longest.status, unicode.status) == (202, 202)
    keys = {m["idempotency_key"] for m in daemon.messages().values()}
    assert keys == {"k" * MAX_KEY_LENGTH, "commande-é №1"}


def test_a_second_delete_is_a_409_with_the_state_and_the_tenant_kept_apart(
    start_api,  # noqa: F811
):
    daemon, api = start_api()
    queue_id = api.submit(token="shop").body["id"]
    assert api.delete(f"/v1/messages/{queue_id}", token="shop").status == 200
    again = api.delete(f"/v1/messages/{queue_id}", token="shop")
    assert again.status == 409
    assert again.body["id"] == queue_id and again.body["state"] == "cancelled"
    assert api.delete(f"/v1/messages/{queue_id}").status == 409  # the operator's token
    other = api.delete(f"/v1/messages/{queue_id}", token="blog")
    assert other.status == 404 and "state" not in other.body  # not the blog's to know of
    assert api.get(f"/v1/messages/{queue_id}", token="shop").status == 404  # not queued
    assert api.delete("/v1/messages/0000000000000000").status == 404  # never was

    # By idempotency key: the key is the tenant's own, so another's finds nothing.
    by_key = api.submit(key="order-9", token="shop").body["id"]
    assert api.delete("/v1/messages?idempotency_key=order-9", token="shop").status == 200
    again = api.delete("/v1/messages?idempotency_key=order-9", token="shop")
    assert again.status == 409 and again.body == {**again.body, "id": by_key, "state": "cancelled"}
    assert api.delete("/v1/messages?idempotency_key=order-9", token="blog").status == 404
    assert api.delete("/v1/messages?idempotency_key=nope", token="shop").status == 404

    # The operator's delete (mtaqueue-ctl) is a deletion.
    deleted = api.submit(token="shop").body["id"]
    assert daemon.ctl("delete", deleted).returncode == 0
    answer = api.delete(f"/v1/messages/{deleted}", token="shop")
    assert answer.status == 409 and answer.body["state"] == "deleted"

    # Ends are remembered in memory: after a restart, a 404 as if it never was.
    daemon.restart()
    api = ApiClient(daemon, api.contract)  # a new port
    assert api.delete(f"/v1/messages/{queue_id}", token="shop").status == 404


def test_a_delete_of_delivered_or_bounced_mail_is_a_409_saying_so(start_api):  # noqa: F811
    with MailNet(["127.0.0.2"]) as net:
        (peer,) = net.peers
        net.add_domain("example.org", "127.0.0.2")
        _, api = start_api(*net.daemon_overrides(), *FAST)
        delivered = api.submit(token="shop").body["id"]
        wait_for(lambda: peer.messages, what="delivery")
        gone = lambda queue_id: api.get(f"/v1/messages/{queue_id}").status == 404  # noqa: E731
        wait_for(lambda: gone(delivered), what="the delivered message to leave the queue")
        answer = api.delete(f"/v1/messages/{delivered}", token="shop")
        assert answer.status == 409
        assert answer.body["id"] == delivered and answer.body["state"] == "delivered"
        assert api.delete(f"/v1/messages/{delivered}", token="blog").status == 404

        peer.on("rcpt", "550 5.1.1 no such user", times=1)
        bounced = api.submit(token="shop").body["id"]
        wait_for(lambda: gone(bounced), what="the bounced message to leave the queue")
        answer = api.delete(f"/v1/messages/{bounced}", token="shop")
        assert answer.status == 409 and answer.body["state"] == "bounced"
