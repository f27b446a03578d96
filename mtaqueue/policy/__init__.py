"""Delivery decisions without I/O (sans-IO, like h11): classify replies, back off, expire,
suspend hosts. Plain functions and small state objects; the time (`now`) and a
`random.Random` are passed in, so every decision is testable with a fake clock."""
