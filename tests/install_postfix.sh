#!/usr/bin/env bash
# Installs the Debian packages of the third-party servers the tests run, if they are not
# there: postfix for a private Postfix instance (tests/postfix_instance.py: `postfix -c
# DIR`, its own queue, loopback only) and unbound for a private Unbound (bench/soak.py's
# DNS, run by tests/test_soak_bench.py). As root only. The system Postfix is neither
# configured ("No configuration") nor started, nor is the system Unbound (a policy-rc.d
# says no while the packages go in); the tests never use them.
# Called by .ci/run and by the tests' postfix_installed and unbound_installed fixtures.
set -euo pipefail
missing=()
if ! [ -x /usr/sbin/postfix ] || ! [ -x /usr/sbin/postconf ]; then
    missing+=(postfix)
fi
if ! [ -x /usr/sbin/unbound ]; then
    missing+=(unbound)
fi
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "install_postfix: not root: cannot install Debian's ${missing[*]} package(s)" >&2
    exit 1
fi
echo "postfix postfix/main_mailer_type select No configuration" | debconf-set-selections
if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
