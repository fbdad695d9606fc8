"""Regenerates docs/page.png, the README's picture of the page: `kvledger demo` on loopback, its page's first
screen taken by headless Chromium.

    bash scripts/ensure_chromium.sh && python scripts/screenshot.py [--out docs/page.png]

The demo runs in a fresh temporary folder as `--dir kvledger-demo`, so the page's header names the store a
user's own `kvledger demo` names. Exit status 1, with the demo's output, when the service never answers.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run", "--hide-scrollbars",
)  # fmt: skip
WINDOW = "1280,900"
"""The first screen of a laptop's browser: what a person sees before scrolling."""
SERVICE_WAIT_S = 300.0
"""The storm (seconds on one core) and the service's start; past this the script gives up."""
CHROMIUM_TIMEOUT_S = 120.0


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago (the script imports nothing of the project's)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_service(url: str, demo: subprocess.Popen[str]) -> bool:
    deadline = time.monotonic() + SERVICE_WAIT_S
    while time.monotonic() < deadline and demo.poll() is None:
        try:
            if httpx.get(f"{url}audit/summary", timeout=2.0).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    return False


def shoot(url: str, out: Path) -> None:
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [CHROMIUM, *CHROMIUM_ARGS, f"--user-data-dir={profile}", f"--screenshot={out}",
             f"--window-size={WINDOW}", url],
            check=True, capture_output=True, timeout=CHROMIUM_TIMEOUT_S,
        )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "page.png")
    out = parser.parse_args().out.resolve()
    if not Path(CHROMIUM).exists():
        print(f"{CHROMIUM} is missing: run `bash scripts/ensure_chromium.sh`", file=sys.stderr)
        return 2
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    with tempfile.TemporaryDirectory() as work:
        demo = subprocess.Popen(
            ["kvledger", "demo", "--dir", "kvledger-demo", "--port", str(port)],
            cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            if not wait_for_service(url, demo):
                demo.terminate()
                print(demo.communicate(timeout=30)[0], file=sys.stderr)
                print(f"the demo's service never answered at {url}", file=sys.stderr)
                return 1
            shoot(url, out)
        finally:
            if demo.poll() is None:
                demo.terminate()
                demo.communicate(timeout=30)
    print(f"{out}: {out.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
