"""The intake's pages in a real browser: headless Chromium driven by Selenium, against 127.0.0.1 only.

Run: `python -m pytest -m browser tests/test_web_browser.py` (Debian: `apt-get install -y chromium chromium-driver`;
pip: selenium). Skipped, saying why, where Chromium or its driver is missing. Screenshots go to the test's tmp
folder, or to $HF_UNLEARN_SCREENSHOTS when set (how docs/images/web-*.png were made).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from .test_trace_common import get_recorded, get_trace_data, ids_at_step
from .test_web_intake import OPERATOR, REF, SUBJECT, TOKEN, submit

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1100,1300"]


@pytest.fixture
def browser(tmp_path):
    if not (CHROMIUM and DRIVER):
        pytest.skip("chromium and chromium-driver are not installed (Debian: apt-get install -y chromium "
                    "chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="chromium-profile-")  # a new, empty profile per test
    for flag in FLAGS + [f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def heading_becomes(driver, text: str, timeout: float = 20) -> None:
    """Wait for the page a click loads (the old page's elements go stale while it does)."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def ready(d):
        try:
            return d.find_element(By.TAG_NAME, "h1").text == text
        except StaleElementReferenceException:
            return False

    WebDriverWait(driver, timeout, ignored_exceptions=(StaleElementReferenceException,)).until(ready)


def shot(driver, tmp_path, name) -> Path:
    folder = Path(os.environ.get("HF_UNLEARN_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"web-{name}.png"
    driver.save_screenshot(str(path))
    assert path.stat().st_size > 5000  # a rendered page, not a blank one
    return path


def test_a_request_from_intake_to_its_status_page_and_the_operator_page(browser, tmp_path):
    from selenium.webdriver.common.by import By

    from hf_unlearn.deletion import DeletionLedger
    from hf_unlearn.web.intake import Intake, IntakeServer

    run = get_recorded()
    subjects = tmp_path / "subjects.json"
    subjects.write_text(json.dumps({SUBJECT: ids_at_step(run, 3)[:2]}))
    ledger = DeletionLedger(run, tmp_path / "ledger")
    with IntakeServer(Intake(ledger, subjects=subjects), {TOKEN: "privacy-tool"}, [OPERATOR]) as server:
        # the privacy tool's webhook call: a ticket with a status link
        ticket = json.loads(submit(server, {"subject": SUBJECT, "ref": REF}, "browser-1")[2])
        browser.get(ticket["status_url"])
        assert browser.find_element(By.TAG_NAME, "h1").text == "Deletion request r-0001"
        assert browser.find_element(By.ID, "state").text == "acknowledged"
        text = browser.find_element(By.TAG_NAME, "body").text
        assert "Nothing has been deleted yet" in text and "deadline" in text
        assert "hf-unlearn requests verify r-0001.ack.bundle.json --public-key issuer.pub" in text
        assert REF not in browser.page_source and SUBJECT not in browser.page_source
        links = [a.text for a in browser.find_elements(By.CSS_SELECTOR, "#files a")]
        assert links == ["r-0001.ack.bundle.json", "r-0001.ack.json"]
        shot(browser, tmp_path, "ticket-acknowledged")

        # the exact batch runs (cron: `requests serve --due`); a reload shows the new state and what it proves
        ledger.serve_exact(tokenizer=get_trace_data()[0], progress=False, log=lambda m: None)
        browser.refresh()
        assert browser.find_element(By.ID, "state").text == "exact"
        steps = [li.text.split()[0] for li in browser.find_elements(By.CSS_SELECTOR, "#timeline > li")]
        assert steps == ["acknowledged", "exact"]
        assert "training was replayed" in browser.find_element(By.ID, "proven").text
        assert "r-0001.exact.bundle.json" in browser.find_element(By.ID, "verify").text
        shot(browser, tmp_path, "ticket-exact")

        # the operator page: a sign-in form first, then the list; a request recorded through its form
        browser.get(server.url + "/operator")
        assert browser.find_element(By.TAG_NAME, "h1").text == "Operator sign-in"
        browser.find_element(By.ID, "token").send_keys("not-the-token")
        browser.find_element(By.ID, "signin").click()
        heading_becomes(browser, "Operator sign-in")
        assert "not an operator token" in browser.find_element(By.TAG_NAME, "body").text
        browser.find_element(By.ID, "token").send_keys(OPERATOR)
        browser.find_element(By.ID, "signin").click()
        heading_becomes(browser, "Deletion requests")
        rows = browser.find_elements(By.CSS_SELECTOR, "#requests tr")
        assert len(rows) == 2 and "r-0001" in rows[1].text and "exact" in rows[1].text
        assert "batch-0001" in browser.find_element(By.ID, "batches").text
        assert "not run" in browser.find_element(By.ID, "batches").text  # the batch ran without the oracle
        shot(browser, tmp_path, "operator")
        browser.find_element(By.NAME, "ids").send_keys(str(ids_at_step(run, 7)[0]))
        browser.find_element(By.NAME, "ref").send_keys("PHONE-CALL-12")
        browser.find_element(By.ID, "submit").click()
        heading_becomes(browser, "Deletion request r-0002")
        assert "/t/" in browser.current_url and "PHONE-CALL-12" not in browser.page_source
        # a bad id is refused on the page, in one line, without echoing it
        browser.get(server.url + "/operator")
        browser.find_element(By.NAME, "ids").send_keys("424242424")
        browser.find_element(By.ID, "submit").click()
        heading_becomes(browser, "Deletion requests")
        error = browser.find_element(By.ID, "form-error").text
        assert "refused" in error and "424242424" not in browser.page_source
    assert [r.id for r in ledger.requests()] == ["r-0001", "r-0002"]
