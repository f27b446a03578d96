"""mtaqueue: a durable, polite outbound mail queue daemon."""

__version__ = "0.1.0"
