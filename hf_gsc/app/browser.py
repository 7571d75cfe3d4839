"""The demo app in a headless Chromium, as a person uses it: load the page, upload an image, wait for the verdict,
read it, take a screenshot (the browser test and ``scripts/demo_app_figures.py``). Needs ``selenium`` and Debian's
``chromium`` and ``chromium-driver`` (``apt-get install chromium chromium-driver``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .demo import VERDICT_ID


CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
#: Headless, and nothing started that reaches the network on its own (updates, sync, QUIC probes).
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")


def chromium_missing() -> str | None:
    """Why the browser cannot run here (``None``: it can)."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.path.exists(path)]
    if missing:
        return f"{' and '.join(missing)} missing (apt-get install chromium chromium-driver)"
    return None


def start_chromium(profile: str | Path, window: tuple[int, int] = (1280, 1100)) -> Any:
    """A headless Chromium driven by ``/usr/bin/chromedriver``, with a fresh profile folder ``profile``."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}", f"--window-size={window[0]},{window[1]}"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def upload_and_read_verdict(browser: Any, url: str, image: str | Path, timeout: float = 30.0) -> str:
    """Open the app at ``url``, upload ``image`` through the page's file input, wait for the verdict and return it."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(url)
    wait = WebDriverWait(browser, timeout)
    wait.until(lambda b: b.find_element(By.CSS_SELECTOR, "input[type=file]")).send_keys(str(Path(image).resolve()))
    box = f"#{VERDICT_ID} textarea"
    return wait.until(lambda b: b.find_element(By.CSS_SELECTOR, box).get_attribute("value"))


__all__ = ["CHROMEDRIVER", "CHROMIUM", "FLAGS", "chromium_missing", "start_chromium", "upload_and_read_verdict"]
