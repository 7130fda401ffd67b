#!/bin/sh
# Make sure a Chromium that Playwright can drive exists, for the browser tests.
#
# Playwright's own browser download needs the open internet; Debian's `chromium` package
# comes through the ordinary package mirror instead, and the tests launch it by path
# (/usr/bin/chromium, or $GLASSFORMER_CHROMIUM). Installing needs root; without root, or
# when apt fails, this says so and exits 0: the browser tests then skip with a reason.
set -u
BROWSER="${GLASSFORMER_CHROMIUM:-/usr/bin/chromium}"
if [ -x "$BROWSER" ]; then
  echo "browser: $BROWSER"
  exit 0
fi
if [ "$(id -u)" != "0" ]; then
  echo "browser: $BROWSER is missing and we are not root; run 'sudo apt-get install chromium' to enable the browser tests"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "browser: $BROWSER is missing and apt-get is not available; the browser tests will be skipped"
  exit 0
fi
echo "browser: installing Debian's chromium with apt-get"
export DEBIAN_FRONTEND=noninteractive
apt-get -o DPkg::Lock::Timeout=300 update -qq >/dev/null 2>&1 || true
if apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null; then
  echo "browser: $BROWSER"
else
  echo "browser: apt-get install chromium failed; the browser tests will be skipped"
fi
exit 0
