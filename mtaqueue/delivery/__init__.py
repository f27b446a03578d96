"""Delivery: the queue manager that sends queued mail to its next hops."""
