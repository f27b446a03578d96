#!/usr/bin/env bash
# Installs Debian's postfix package for the tests that run a private Postfix instance
# (tests/postfix_instance.py: `postfix -c DIR`, its own queue, loopback only), if it is not
# there. As root only. The system Postfix is neither configured ("No configuration") nor
# started (a policy-rc.d says no while the package goes in); the tests never use it.
# Called by .ci/run and by the tests' postfix_installed fixture.
set -euo pipefail
if [ -x /usr/sbin/postfix ] && [ -x /usr/sbin/postconf ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "install_postfix: not root: cannot install Debian's postfix package" >&2
    exit 1
fi
echo "postfix postfix/main_mailer_type select No configuration" | debconf-set-selections
if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends postfix
