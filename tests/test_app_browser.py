"""The web app in a real headless Chromium (Debian's chromium + chromium-driver, driven by Selenium): upload the
bundled example, click on the sphere, add it, reconstruct on the tiny checkpoint, wait until the 3D viewer has
fetched the GLB and drawn it, save a screenshot. `make test-browser` installs what it needs and runs it;
`SAM3D_BROWSER_SCREENSHOT=path.png` keeps the screenshot (default: the test's temporary folder)."""
import os
import shutil
import socket
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.browser

gr = pytest.importorskip("gradio", reason="the web app needs gradio (extra `app`)")
webdriver = pytest.importorskip("selenium.webdriver", reason="the browser test needs selenium (extra `browser`)")

from sam3d_objects import app  # noqa: E402
from sam3d_objects.assets.example import EXAMPLE_DIR  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
if CHROMIUM is None or DRIVER is None:
    pytest.skip("needs Debian's chromium and chromium-driver (make test-browser installs them)",
                allow_module_level=True)

FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--enable-unsafe-swiftshader", "--window-size=1400,1700")
SPHERE = (170, 230)  # a pixel of the example's sphere (x, y)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from sam3d_objects.assets.tiny_checkpoint import ensure_tiny_checkpoint
    config = ensure_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", log=lambda *a: None)
    engine = app.Engine(config, random_weights=True, pointmap_default=app.DEPTH_CHOICES[1])
    demo = app.build_app(engine, default_device="cpu")
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
                allowed_paths=[str(engine.work_dir)])
    yield f"http://127.0.0.1:{port}/"
    demo.close()


@pytest.fixture()
def browser(tmp_path):
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'profile'}")
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(120)
    yield driver
    driver.quit()


def wait_for(predicate, timeout: float, what: str, poll: float = 0.5):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_upload_click_reconstruct_view_glb(server, browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    d = browser
    d.get(server)
    upload = wait_for(lambda: d.find_elements(By.CSS_SELECTOR, "#photo input[type=file]"), 60, "the upload field")
    upload[0].send_keys(str(EXAMPLE_DIR / "image.png"))

    # the annotated copy appears; click on the sphere (gradio maps the click to image pixels)
    img = wait_for(lambda: [e for e in d.find_elements(By.CSS_SELECTOR, "#annotated img") if e.size["width"] > 50],
                   60, "the annotated image")[0]
    natural_w = d.execute_script("return arguments[0].naturalWidth", img)
    natural_h = d.execute_script("return arguments[0].naturalHeight", img)
    assert (natural_w, natural_h) == (512, 384)
    w, h = img.size["width"], img.size["height"]
    scale = min(w / natural_w, h / natural_h)  # object-fit: contain
    dx = (SPHERE[0] - natural_w / 2) * scale
    dy = (SPHERE[1] - natural_h / 2) * scale
    ActionChains(d).move_to_element_with_offset(img, int(dx), int(dy)).click().perform()
    info = lambda: d.find_element(By.ID, "objects-info").text  # noqa: E731
    wait_for(lambda: "a mask is selected" in info(), 60, "the click's mask")
    d.find_element(By.XPATH, "//button[normalize-space()='Add object']").click()
    wait_for(lambda: "1 object(s) added" in info(), 30, "the added object")

    d.find_element(By.ID, "reconstruct-button").click()
    status = lambda: d.find_element(By.ID, "status").text  # noqa: E731
    wait_for(lambda: "Done:" in status() or "Error" in d.page_source[-5000:], 900, "the reconstruction")
    assert "1 object(s)" in status(), status()

    # the viewer fetched mesh.glb and draws it on a canvas
    fetched = wait_for(lambda: d.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name).filter(n => n.endsWith('mesh.glb'))"),
        120, "the viewer's request for mesh.glb")
    assert fetched
    canvas = wait_for(lambda: d.find_elements(By.CSS_SELECTOR, "#mesh-viewer canvas"), 60, "the viewer's canvas")[0]
    d.execute_script("arguments[0].scrollIntoView({block: 'center'})", canvas)
    time.sleep(3)  # let the viewer draw a few frames

    shot = Path(os.environ.get("SAM3D_BROWSER_SCREENSHOT") or tmp_path / "app.png")
    shot.parent.mkdir(parents=True, exist_ok=True)
    assert d.save_screenshot(str(shot))
    from PIL import Image
    page = np.asarray(Image.open(shot).convert("RGB")).astype(np.float32)
    ratio = d.execute_script("return window.devicePixelRatio") or 1
    r = d.execute_script("const b = arguments[0].getBoundingClientRect(); return [b.left, b.top, b.width, b.height]",
                         canvas)
    x0, y0 = int(r[0] * ratio), int(r[1] * ratio)
    region = page[y0:y0 + int(r[3] * ratio), x0:x0 + int(r[2] * ratio)]
    assert region.size > 0
    assert region.std() > 2.0, "the viewer's canvas is blank"
