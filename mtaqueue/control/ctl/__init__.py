"""`mtaqueue-ctl`, the control socket's client, a noun a file: `main` (the entry point,
`mtaqueue.control.ctl.main:main`: the command line and its dispatch), `subcommands` (each
command's arguments and request), `render` (replies as text or JSON Lines), `top` (the live
view), `client` (config, socket path, connection; `protocol` speaks on it).

Nothing is imported here: `python -m mtaqueue.control.ctl.main` runs main.py as
``__main__``, and no second copy of it must be loaded beside that one.
"""
