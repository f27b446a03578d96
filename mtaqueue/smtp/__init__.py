"""The two SMTP edges: the submission listener and (later) the delivery client.

They translate between the wire and our records; they decide nothing.
"""
