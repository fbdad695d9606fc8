#!/usr/bin/env bash
# Debian's Chromium for the browser test (Playwright drives it; it never downloads a browser).
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
  exit 0
fi
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium
