"""Routing: where a recipient domain's mail goes (next hop) and the addresses to try there."""
