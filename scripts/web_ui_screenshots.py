"""Screenshots of the chat page for docs/serving.md: `ferrum serve` with SmolLM2 on 127.0.0.1 and
the headless Chromium of the page's tests (tests/test_web_ui.py), a real reply with a code block,
then the settings. usage: .venv/bin/python scripts/web_ui_screenshots.py"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from selenium.webdriver.common.by import By  # noqa: E402

from ferrum.models import default_model_path  # noqa: E402
from server_harness import serve, stop  # noqa: E402
from test_web_ui import chrome, say, set_settings, settle  # noqa: E402


def main() -> None:
    out = ROOT / "docs" / "images"
    proc, url = serve(str(default_model_path()))
    driver = chrome((860, 780))
    try:
        driver.get(url)
        set_settings(driver, **{"temperature": "0", "max-tokens": "160"})
        say(driver, "Write a Python function that returns the square of a number.")
        settle(driver)
        driver.find_element(By.ID, "input").send_keys("Now in C, please.")
        driver.save_screenshot(str(out / "chat-page.png"))
        driver.find_element(By.ID, "open-settings").click()
        driver.find_element(By.ID, "system-prompt").send_keys("You are a helpful programming assistant.")
        driver.save_screenshot(str(out / "chat-settings.png"))
    finally:
        driver.quit()
        stop(proc)
    print("wrote", out / "chat-page.png", out / "chat-settings.png")


if __name__ == "__main__":
    main()
