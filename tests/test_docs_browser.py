"""The built site works where the README opens it (build/docs/index.html, file://) and over HTTP, in a real browser.

Headless Chromium (Debian: ``apt-get install chromium``) loads pages of a freshly built site with ``--dump-dom``;
``--virtual-time-budget`` lets the page's scripts (navigation, the search worker) finish before the DOM is dumped.
Where a check needs an action in the page (a click, measuring code blocks), a small script is added to the test's own
copy of the page. Slow (a build and a few browser starts); skipped, with the reason, where Chromium is absent.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager

import pytest

from .conftest import ROOT

pytestmark = [pytest.mark.browser, pytest.mark.slow]

BROWSER = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
DRIVER = shutil.which("chromedriver")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--no-proxy-server",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    if BROWSER is None:
        pytest.skip("Chromium is not installed (Debian: apt-get install -y chromium): the site is not loaded in a browser")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def dom(url: str, width: int = 1280) -> str:
    """The page's DOM after its scripts ran (a fresh profile each time: no cache, no stored state)."""
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run([BROWSER, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},900",
                               "--virtual-time-budget=10000", "--dump-dom", url],
                              capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and "<html" in proc.stdout, proc.stderr[-2000:]
    return proc.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(cwd, command):
    """A local process, ``command(port)``, listening on a free port (yields the port); stopped on exit."""
    port = free_port()
    proc = subprocess.Popen(command(port), cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@contextmanager
def webdriver():
    """A Chromium session through chromedriver's W3C WebDriver HTTP API (four endpoints over urllib: selenium is not a
    dependency). Needed where --dump-dom cannot wait: a real search worker answers in real time, not virtual time."""
    if DRIVER is None:
        pytest.skip("chromedriver is not installed (Debian: apt-get install -y chromium-driver)")
    with serving(None, lambda port: [DRIVER, f"--port={port}"]) as port, tempfile.TemporaryDirectory() as profile:
        def call(method, path, body=None):
            req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                         data=None if body is None else json.dumps(body).encode())
            with urllib.request.urlopen(req, timeout=120) as r:
                return json.load(r)["value"]

        options = {"binary": BROWSER, "args": [*FLAGS, f"--user-data-dir={profile}", "--window-size=1280,900"]}
        session = call("POST", "/session", {"capabilities": {"alwaysMatch": {"goog:chromeOptions": options}}})
        sid = session["sessionId"]

        class Session:
            def get(self, url):
                call("POST", f"/session/{sid}/url", {"url": url})

            def js(self, script):
                return call("POST", f"/session/{sid}/execute/sync", {"script": script, "args": []})

            def wait(self, script, seconds=30):
                deadline = time.monotonic() + seconds
                while not (value := self.js(script)) and time.monotonic() < deadline:
                    time.sleep(0.2)
                return value
        try:
            yield Session()
        finally:
            call("DELETE", f"/session/{sid}")


def add_script(page, script: str) -> None:
    text = page.read_text(encoding="utf-8")
    page.write_text(text.replace("</body>", f"<script>addEventListener('load', () => {{{script}}})</script></body>"),
                    encoding="utf-8")


def title(html: str) -> str:
    return re.search(r"<title>([^<]*)</title>", html).group(1)


def search_hits(html: str) -> int:
    return len(re.findall(r'class="md-search-result__item"', html))


def test_from_file_urls_a_click_on_a_nav_link_lands_on_the_page(site, tmp_path):
    copy = shutil.copytree(site, tmp_path / "site")
    home = dom((copy / "index.html").as_uri())
    nav = re.findall(r'<a href="([^"#]+)" class="md-nav__link', home)
    assert "quickstart.html" in nav and "reference/cli.html" in nav
    assert all(not h.endswith("/") and (copy / h).is_file() for h in nav), [h for h in nav if not (copy / h).is_file()]
    add_script(copy / "index.html", """setTimeout(() => document.querySelector('a.md-nav__link[href="reference/cli.html"]').click(), 200)""")
    landed = dom((copy / "index.html").as_uri())
    assert title(landed).startswith("CLI - hf_unlearn") and "Index of" not in landed
    assert 'class="md-content"' in landed and "usage: hf-unlearn forget" in landed


def test_search_works_from_file_urls(site):
    html = dom((site / "index.html").as_uri() + "?q=oracle")
    assert re.search(r"\d+ matching documents", html) and search_hits(html) > 0


def test_navigation_and_search_work_over_http(site):
    """Served by `python -m http.server` the site uses directory-free links too, and search runs in a real worker."""
    with serving(site, lambda port: [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]) as port, \
            webdriver() as browser:
        browser.get(f"http://127.0.0.1:{port}/index.html?q=oracle")
        hits = browser.wait("return document.querySelectorAll('.md-search-result__item').length")
        assert hits > 0, browser.js("return document.querySelector('.md-search-result__meta').textContent")
        browser.js("document.querySelector('a.md-nav__link[href=\"quickstart.html\"]').click()")
        assert browser.wait("return document.title.startsWith('Quickstart') && location.href").endswith("/quickstart.html")
        assert browser.js("return document.querySelector('.md-content h1').textContent").startswith("Quickstart")


@pytest.mark.parametrize("width", [1280, 800])
def test_no_code_line_is_cut(site, tmp_path, width):
    """Every code block of the quickstart and the CLI reference shows its whole width (wrapped: nothing hidden behind
    a scrollbar), at a desktop and a narrow window; the quickstart's forget command is on the page whole."""
    copy = shutil.copytree(site, tmp_path / "site")
    measure = ("const blocks = [...document.querySelectorAll('.md-content pre > code')];"
               "document.body.dataset.blocks = blocks.length;"
               "document.body.dataset.cut = blocks.filter(c => c.scrollWidth > c.clientWidth + 1).length;")
    for name in ("quickstart.html", "reference/cli.html"):
        add_script(copy / name, measure)
        html = dom((copy / name).as_uri(), width)
        blocks, cut = (int(re.search(rf'data-{k}="(\d+)"', html).group(1)) for k in ("blocks", "cut"))
        assert blocks > 0 and cut == 0, f"{name} at {width}px: {cut} of {blocks} code blocks are cut"
    text = re.sub(r"<[^>]+>", "", dom((site / "quickstart.html").as_uri()))
    assert "hf-unlearn forget runs/ft/trace --ids request.jsonl --out deletion-1 --oracle --tokenizer tokenizer" in text
