r"""What the API takes in a field, where JSON Schema can say it: each rule is one pattern
(and length) that the server checks and the OpenAPI document publishes, so the two agree
by construction. The patterns are written in the syntax Python's `re` and ECMA-262 (with
the `u` flag) read alike, as smtp/addresses.py's are; the server matches them whole
(fullmatch: Python's `$` also matches before a final newline, ECMA-262's does not).

What a pattern cannot say is checked apart and stated in the field's description: that
a text is UTF-8 (JSON may escape a lone surrogate; not every ECMA-262 engine takes one in
a pattern), and lengths in octets (a pattern counts characters, the same for ASCII).
"""

from __future__ import annotations

import string

from ..smtp.addresses import MAX_LOCAL_PART, MAX_PATH, WS, either, mailbox_pattern

WHITESPACE = string.whitespace  # ASCII white space, trimmed around an address: WS
CONTROL = r"\x00-\x1f\x7f-\x9f"  # C0, DEL, C1

# An Idempotency-Key: 1 to MAX_KEY_LENGTH characters, no control character, no space
# (nor zero-width one) at either end.
_SPACE = r"\x20\xa0\u1680\u2000-\u200b\u2028\u2029\u202f\u205f\u3000\ufeff"
KEY_PATTERN = f"^[^{CONTROL}{_SPACE}](?:[^{CONTROL}]*[^{CONTROL}{_SPACE}])?$"

# "addr" or "Name <addr>" (from, to[]): white space around either, and around the addr
# inside the brackets, is dropped. The name is what comes before the last "<": no control
# character in it (white space at its ends aside), quotes around it are dropped.
MAX_ADDRESS_FIELD = 998  # characters: a line of RFC 5322 (and a bound on the pattern's work)
_NAME = f"[^{CONTROL} ](?:[^{CONTROL}]*[^{CONTROL} ])?"
_NAME_ADDR = rf"(?:{_NAME}{WS}*)?<{WS}*{mailbox_pattern(False, f'{WS}*>{WS}*$')}{WS}*>"
ADDRESS_PATTERN = rf"^{WS}*{either(mailbox_pattern(after=f'{WS}*$'), _NAME_ADDR)}{WS}*$"

ADDRESS_RULE = (
    f"a local part of at most {MAX_LOCAL_PART} and an address of at most {MAX_PATH} octets"
    " (in UTF-8: the pattern counts characters)"
)
