"""A client of the daemon's HTTP API for end-to-end tests: the standard library's urllib
(an HTTP client we did not write), and every answer checked against the daemon's own
OpenAPI document: a documented operation must answer with a documented status, and its
body must match the documented schema.
"""

from __future__ import annotations

import contextlib
import json
import re
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from jsonschema import Draft202012Validator

TOKENS = {
    "operator": "operator-token-0123456789abcdef",
    "shop": "shop-token-0123456789abcdef",
    "blog": "blog-token-0123456789abcdef",
}
TOKENS_FILE = (
    "# the operator's (unbound), then two tenants'\n"
    f"{TOKENS['operator']}\n{TOKENS['shop']} shop\n{TOKENS['blog']} blog\n"
)


@dataclass
class Answer:
    status: int
    headers: Any  # http.client.HTTPMessage
    body: Any  # the JSON, or the raw bytes if it is not JSON

    def __repr__(self) -> str:  # what a failed assertion shows
        return f"Answer({self.status}, {self.body!r})"


@dataclass
class Contract:
    """The OpenAPI document, and the operations answered so far (method, path template)."""

    document: dict[str, Any]
    exercised: set[tuple[str, str]] = field(default_factory=set)

    def operation(self, method: str, path: str) -> tuple[str, dict[str, Any]] | None:
        for template, item in self.document["paths"].items():
            pattern = re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template))
            if re.fullmatch(pattern, path) and method.lower() in item:
                return template, item[method.lower()]
        return None

    def check(self, method: str, path: str, answer: Answer) -> None:
        found = self.operation(method, path)
        if found is None:
            return  # not an operation of ours (a test of an unknown route)
        template, operation = found
        documented = operation["responses"].get(str(answer.status))
        assert documented is not None, f"{method} {template}: {answer.status} is not documented"
        self.exercised.add((method.upper(), template))
        if "$ref" in documented:
            documented = self._resolve(documented["$ref"])
        schema = documented["content"]["application/json"]["schema"]
        assert answer.headers["Content-Type"].startswith("application/json")
        validator = Draft202012Validator({**schema, "components": self.document["components"]})
        errors = [e.message for e in validator.iter_errors(answer.body)]
        assert not errors, f"{method} {template} {answer.status}: {errors} in {answer.body!r}"

    def _resolve(self, ref: str) -> dict[str, Any]:
        node: Any = self.document
        for part in ref.removeprefix("#/").split("/"):
            node = node[part]
        return node


class ApiClient:
    def __init__(self, daemon, contract: Contract | None = None) -> None:
        (address,) = daemon.wait_event("api_listening")["address"]
        self.base = f"http://{address}"
        self.contract = contract

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        token: str | None = "operator",
        headers: dict[str, str] | None = None,
        data: bytes | None = None,
        timeout: float = 30,
    ) -> Answer:
        """`token`: a key of TOKENS, else the token itself; None sends none. `body` is
        sent as JSON, `data` as it is."""
        sent = dict(headers or {})
        if token is not None:
            sent.setdefault("Authorization", f"Bearer {TOKENS.get(token, token)}")
        if body is not None:
            data = json.dumps(body).encode()
            sent.setdefault("Content-Type", "application/json")
        request = urllib.request.Request(self.base + path, data, sent, method=method)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                answer = Answer(response.status, response.headers, response.read())
        except urllib.error.HTTPError as error:
            answer = Answer(error.code, error.headers, error.read())
        with contextlib.suppress(ValueError):  # not JSON: kept as bytes
            answer.body = json.loads(answer.body)
        if self.contract is not None:
            self.contract.check(method, path.split("?", 1)[0], answer)
        return answer

    def get(self, path: str, **kw: Any) -> Answer:
        return self.request("GET", path, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> Answer:
        return self.request("POST", path, body, **kw)

    def put(self, path: str, body: Any = None, **kw: Any) -> Answer:
        return self.request("PUT", path, body, **kw)

    def delete(self, path: str, **kw: Any) -> Answer:
        return self.request("DELETE", path, **kw)

    def submit(self, key: str | None = None, token: str = "operator", **fields: Any) -> Answer:
        """POST /v1/messages of a small text message, `fields` over the defaults."""
        body = {"from": "app@example.com", "to": ["a@example.org"], "subject": "hi"}
        body |= {"text": "hello\n"} if "raw" not in fields else {}
        body |= fields
        if "raw" in fields:
            body.pop("subject")
        headers = {"Idempotency-Key": key} if key is not None else {}
        return self.post("/v1/messages", body, token=token, headers=headers)
