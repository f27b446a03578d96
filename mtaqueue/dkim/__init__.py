"""DKIM signing (RFC 6376; Ed25519, RFC 8463) of accepted mail, once, before it is stored.

- `canonical`: relaxed header and body canonicalisation, the body hashed as it streams;
- `keys`: the private keys of the `[dkim."DOMAIN"]` tables and their DNS records;
- `signature`: one DKIM-Signature field from the signed fields and the body hash, whole
  or in two steps (all but the value, then the value in place of its placeholder);
- `signer`: which keys sign a message (its From domain, or a parent's) and the signing;
- `service`: signing on the acceptance path (the spool writer makes the values);
- `published`: what `mtaqueue-ctl dkim check` compares with the DNS.
"""
