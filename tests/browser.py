"""Headless Chromium for the page tests: Playwright's API over Debian's Chromium (no browser
download), or a skip that says what is missing."""
from __future__ import annotations

import os
import shutil

import pytest


def chromium():
    """(playwright's ``sync_playwright``, the Chromium executable), or ``pytest.skip``."""
    path = shutil.which("chromium") or "/usr/bin/chromium"
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright)")
    if not os.path.exists(path):
        pytest.skip("Chromium is not installed (make installs Debian's chromium package with "
                    "apt-get as root; it could not here)")
    return sync_playwright, path
