"""`mtaqueue-ctl`, the control socket's client: run as `mtaqueue-ctl` (the entry point is
`mtaqueue.control.ctl.main:main`) or `python -m mtaqueue.control.ctl.main`.

Nothing is imported here, so that each command loads only what it needs.
"""
