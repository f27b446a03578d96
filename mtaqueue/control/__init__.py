"""The control socket: the daemon's server side and the `mtaqueue-ctl` client.

Nothing is imported here so that the ctl does not pay for asyncio or the views.
"""
