#!/bin/sh
# The Mooncake transfer engine (prefill/decode disaggregation, the `pd` extra) loads
# libibverbs, libnuma and libcurl even for its TCP transport. Installs the Debian packages
# that are missing when this may (root with apt-get); otherwise says so: the daemon still
# runs (mode null), and PD's tests skip with the reason.
missing=""
for lib in libibverbs.so.1:libibverbs1 libnuma.so.1:libnuma1 libcurl.so.4:libcurl4; do
    ldconfig -p | grep -q "${lib%%:*}" || missing="$missing ${lib#*:}"
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
else
    echo "prefill/decode disaggregation needs the Debian package(s)$missing (apt-get install$missing as root);" \
        "without them --disaggregation-mode cannot start and its tests skip"
fi
