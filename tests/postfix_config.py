"""The configuration files of a private Postfix instance (tests/postfix_instance.py).

    main_cf(pf) -> {parameter: value}   main.cf for the instance's mode and options
    write_config(pf)                    conf/main.cf, conf/master.cf and the map files
                                        (and queue/etc/resolv.conf with a `resolver`)
    TLSMGR, VIRTUAL                     master.cf lines for smtpd's TLS, Maildir delivery

`pf` is a PostfixInstance; these read its settings and write nothing outside its workdir.
"""

from __future__ import annotations

import pwd
from typing import TYPE_CHECKING

from postfix_tools import parse_loopback, unused_port

if TYPE_CHECKING:
    from postfix_instance import PostfixInstance

# Default master.cf minus TLS, local/virtual/lmtp delivery and the pipe examples; chroot off
# (a chroot would need copies of /etc files in the queue directory). The smtpd line is added
# in front, bound to the one address given; it alone runs chrooted with a `resolver`.
_MASTER_CF = """\
pickup    unix  n       -       n       60      1       pickup
cleanup   unix  n       -       n       -       0       cleanup
qmgr      unix  n       -       n       300     1       qmgr
rewrite   unix  -       -       n       -       -       trivial-rewrite
bounce    unix  -       -       n       -       0       bounce
defer     unix  -       -       n       -       0       bounce
trace     unix  -       -       n       -       0       bounce
verify    unix  -       -       n       -       1       verify
flush     unix  n       -       n       1000?   0       flush
proxymap  unix  -       -       n       -       -       proxymap
proxywrite unix -       -       n       -       1       proxymap
smtp      unix  -       -       n       -       -       smtp
relay     unix  -       -       n       -       -       smtp
showq     unix  n       -       n       -       -       showq
error     unix  -       -       n       -       -       error
retry     unix  -       -       n       -       -       error
discard   unix  -       -       n       -       -       discard
anvil     unix  -       -       n       -       1       anvil
scache    unix  -       -       n       -       1       scache
postlog   unix-dgram n  -       n       -       1       postlogd
"""
# smtpd's TLS needs it (without: "no entropy for TLS key generation: disabling TLS support",
# and 454 4.7.0 to STARTTLS).
TLSMGR = "tlsmgr    unix  -       -       n       1000?   1       tlsmgr\n"
# Delivery to the mailboxes' Maildirs (receive mode's `mailboxes`).
VIRTUAL = "virtual   unix  -       n       n       -       -       virtual\n"


def main_cf(pf: PostfixInstance) -> dict[str, str]:
    """The main.cf parameters for the instance's current mode and options."""
    if pf.mode == "relay":
        assert pf.relay is not None
        relay_host, relay_port = parse_loopback(pf.relay)
        relayhost, defer = f"[{relay_host}]:{relay_port}", ""
    else:  # an unused port: nothing is ever attempted, defer_transports stops it first
        relayhost, defer = f"[127.0.0.1]:{unused_port()}", "smtp"
    if pf.mode == "receive":  # nothing is sent on: a port nobody listens on
        relayhost, defer = f"[127.0.0.1]:{unused_port()}", ""
    hold = "check_client_access static:HOLD" if pf.mode == "hold" else ""
    logfile = str(pf.maillog) if pf.maillog_enabled else "/dev/null"
    params = {
        "compatibility_level": "3.6",
        "config_directory": str(pf.config_dir),
        "queue_directory": str(pf.queue_dir),
        "data_directory": str(pf.data_dir),
        "meta_directory": "/etc/postfix",  # postfix-files, used by post-install
        "multi_instance_name": pf.name,
        "multi_instance_enable": "no",  # not registered with the system's postmulti
        "syslog_name": pf.name,
        "maillog_file": logfile,
        "maillog_file_prefixes": logfile if not pf.maillog_enabled else str(pf.workdir),
        "myhostname": f"{pf.name}.localdomain",
        "mydomain": "localdomain",
        "myorigin": "$myhostname",
        "inet_interfaces": ", ".join(f"[{h}]" if ":" in h else h for h, _ in pf.addresses),
        "inet_protocols": "all" if any(":" in h for h, _ in pf.addresses) else "ipv4",
        "mydestination": "",
        "mynetworks": "127.0.0.0/8",
        "smtpd_relay_restrictions": "permit_mynetworks, reject",
        "smtpd_recipient_restrictions": "",
        "smtpd_peername_lookup": "no",  # no reverse DNS of clients
        "local_transport": "error:local delivery is disabled",
        "local_recipient_maps": "",
        "alias_maps": "",
        "alias_database": "",
        "biff": "no",
        "relayhost": relayhost,
        "defer_transports": defer,
        "smtpd_data_restrictions": hold,
        "smtp_dns_support_level": "disabled",  # no DNS at all: relayhost is a literal IP
        "smtp_host_lookup": "native",
        "smtp_tls_security_level": "none",
        "smtpd_tls_security_level": "none",
    }
    if pf.mode == "receive":
        policy = f"check_policy_service inet:{pf.policy}" if pf.policy else ""
        params |= {
            "relay_domains": ", ".join(pf.domains),
            "relay_transport": "discard:",
            "default_transport": "discard:",
            "smtpd_relay_restrictions": "reject_unauth_destination",
            "smtpd_recipient_restrictions": policy,
            "smtpd_client_event_limit_exceptions": "",  # anvil limits apply to loopback
        }
        if pf.mailboxes:  # kept: each domain's mail in its Maildir, as nobody
            nobody = pwd.getpwnam("nobody")
            params |= {
                "virtual_mailbox_domains": ", ".join(pf.mailboxes),
                "virtual_mailbox_base": str(pf.mail_dir),
                "virtual_mailbox_maps": f"texthash:{pf.config_dir / 'mailboxes'}",
                "virtual_uid_maps": f"static:{nobody.pw_uid}",
                "virtual_gid_maps": f"static:{nobody.pw_gid}",
            }
    if pf.tls is not None:
        params |= {
            "smtpd_tls_cert_file": pf.tls[0],
            "smtpd_tls_key_file": pf.tls[1],
            "smtpd_tls_security_level": "may",
            "smtpd_tls_loglevel": "1",
        }
    client = []
    if pf.client_access:
        client.append(f"check_client_access cidr:{pf.config_dir / 'client_access.cidr'}")
    if pf.dnsbl:  # looked up through the resolver; a reply of the map's, else Postfix's own
        client += [f"reject_rbl_client {zone}" for zone in pf.dnsbl]
        if any(pf.dnsbl.values()):
            params["rbl_reply_maps"] = f"texthash:{pf.config_dir / 'rbl_replies'}"
    if client:
        params["smtpd_client_restrictions"] = ", ".join(client)
    if pf.reply_lines:
        params["smtpd_reject_footer_maps"] = f"regexp:{pf.config_dir / 'reply_lines.regexp'}"
    params.update(pf.extra)
    return params


def write_config(pf: PostfixInstance) -> None:
    """Write the instance's configuration (its queue directory must exist)."""
    conf = pf.config_dir
    main = "".join(f"{k} = {v}\n" for k, v in main_cf(pf).items())
    chroot = "y" if pf.resolver else "n"  # smtpd alone: its resolv.conf is in queue/etc
    hosts = [(f"[{h}]" if ":" in h else h, p) for h, p in pf.addresses]
    smtpd = "".join(f"{h}:{p} inet n - {chroot} - - smtpd\n" for h, p in hosts)
    if pf.resolver:  # read by smtpd's resolver inside its chroot, the queue directory
        etc = pf.queue_dir / "etc"
        etc.mkdir(mode=0o755, exist_ok=True)
        (etc / "resolv.conf").write_text(
            f"nameserver {pf.resolver}\noptions timeout:1 attempts:2\n"
        )
    if pf.client_access:  # cidr: tables are read as they are, no postmap
        (conf / "client_access.cidr").write_text(
            "".join(f"{net} {action}\n" for net, action in pf.client_access.items())
        )
    if any(pf.dnsbl.values()):  # "$" would start a parameter: the texts go as they are
        (conf / "rbl_replies").write_text(
            "".join(
                f"{zone} {reply.replace('$', '$$')}\n" for zone, reply in pf.dnsbl.items() if reply
            )
        )
    if pf.reply_lines:  # "\c": no empty line between the reply and its footer
        (conf / "reply_lines.regexp").write_text(
            "".join(
                f"/{pattern}/ \\c" + "".join(f"\\n{line}" for line in lines) + "\n"
                for pattern, lines in pf.reply_lines.items()
            )
        )
    services = pf.services
    if pf.mailboxes:  # "@domain domain/": every address, one Maildir (the "/")
        (conf / "mailboxes").write_text(
            "".join(f"@{domain} {domain}/\n" for domain in pf.mailboxes)
        )
        services += VIRTUAL
    (conf / "main.cf").write_text("# generated by tests/postfix_config.py\n" + main)
    (conf / "master.cf").write_text(smtpd + _MASTER_CF + services)
