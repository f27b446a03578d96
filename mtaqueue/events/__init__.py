"""Events for the application: what happened to its mail, told over signed webhooks.

A state change's events are journaled with it (spool/), read back from the event log in
order and POSTed by the dispatcher; `derive` says which changes make which events.
"""
