"""The web page served by ``serve``, driven in a real Chromium (Playwright) against a
real server on loopback with a token and tiny pipelines: sign in, the machine page,
generate, train / watch / stop, a doomed start, two viewports, no console errors."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from engine.hardware.probe import probe
from engine.contract.plugins import load_registry
from engine.server.app import ServerSettings, create_app
from engine.service.facade import Engine
from engine.testing.datasets import write_clip, write_clip_dataset, write_dataset
from tests.support import HostModel, LiveServer

CHROMIUM = Path("/usr/bin/chromium")
TOKEN = "web-s3cret"
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
WAIT_MS = 120_000  # an upper bound on waits for real work (a trainer child starting), never a timing assertion

if not CHROMIUM.exists():  # `make test` installs it where it can (root with apt-get)
    pytest.fail("Debian's chromium is missing: apt-get install -y chromium (`make browser` does, as root)",
                pytrace=False)
from playwright import sync_api  # noqa: E402 - after the browser check, which names the fix


@dataclass
class Site:
    url: str
    engine: Engine
    host: HostModel
    roots: Path
    shots: Path


@dataclass
class Watched:
    """A page with its console errors and uncaught exceptions collected."""

    page: object
    errors: list[str] = field(default_factory=list)
    #: Every URL the page requested (path and query).
    requests: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, tiny_pipeline: Callable[[str], Path]) -> Iterator[Site]:
    base = tmp_path_factory.mktemp("web")
    models, datasets, outputs = (base / n for n in ("models", "datasets", "outputs"))
    for folder in (models, datasets, outputs):
        folder.mkdir()
    shutil.copytree(tiny_pipeline("sdxl"), models / "tiny-sdxl")
    shutil.copytree(tiny_pipeline("flux"), models / "tiny-flux")
    shutil.copytree(tiny_pipeline("wan"), models / "tiny-wan")
    shutil.copytree(tiny_pipeline("ltx2"), models / "tiny-ltx2")
    write_dataset(datasets / "shapes", count=2, size=64)
    write_clip_dataset(datasets / "moving", clips=2, images=1, frames=9)
    corrupt = write_dataset(datasets / "corrupt", count=2, size=64)
    (corrupt / "zero.png").write_bytes(b"")
    # This machine, as when idle: what the page offers must not hang on what another test holds
    # at the moment the fixture probes (the CPU int8 mode of FLUX needs about 21 GB free).
    machine = probe(verify=False)
    engine = Engine(registry=load_registry(), hardware=machine.replace(free_memory_gb=machine.total_memory_gb),
                    runs_dir=outputs)
    host = HostModel(engine, name="host.llm", size_gb=0.0)
    settings = ServerSettings(model_roots=(models,), dataset_roots=(datasets,), output_roots=(outputs,), token=TOKEN)
    with LiveServer(create_app(engine, settings)) as url:
        yield Site(url, engine, host, base, tmp_path_factory.mktemp("screenshots"))


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with sync_api.sync_playwright() as playwright:
        # Clips with sound play without a click, as a user's click would let them.
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM),
                                              args=["--autoplay-policy=no-user-gesture-required"])
        yield chromium
        chromium.close()


@pytest.fixture
def open_page(browser: object) -> Iterator[Callable[..., Watched]]:
    contexts = []

    def open_(viewport: dict[str, int] = DESKTOP) -> Watched:
        context = browser.new_context(viewport=viewport)  # type: ignore[attr-defined]
        context.set_default_timeout(WAIT_MS)
        contexts.append(context)
        watched = Watched(context.new_page())
        watched.page.on("console", lambda m: watched.errors.append(m.text) if m.type == "error" else None)  # type: ignore[attr-defined]
        watched.page.on("pageerror", lambda e: watched.errors.append(f"uncaught: {e}"))  # type: ignore[attr-defined]
        watched.page.on("request", lambda r: watched.requests.append(r.url.split("/", 3)[3]))  # type: ignore[attr-defined]
        return watched

    yield open_
    for context in contexts:
        context.close()


def signed_in(site: Site, watched: Watched) -> object:
    page = watched.page
    page.goto(site.url)  # type: ignore[attr-defined]
    page.fill("#token", TOKEN)  # type: ignore[attr-defined]
    page.click("#sign-in button[type=submit]")  # type: ignore[attr-defined]
    page.wait_for_selector("#machine .family")  # type: ignore[attr-defined]
    return page


def pick(page: object, select: str, path: Path) -> None:
    """Choose ``path`` in the ``select`` list once the page has listed it (the roots load async)."""
    page.wait_for_selector(f"{select} option[value$='{path.name}']", state="attached")  # type: ignore[attr-defined]
    page.select_option(select, value=str(path))  # type: ignore[attr-defined]


def tab(page: object, name: str) -> None:
    page.click(f"#tabs button[data-tab={name}]")  # type: ignore[attr-defined]


def only_refusals(errors: list[str], *statuses: int) -> bool:
    """Every console error is the browser's note of an API refusal with one of ``statuses``."""
    allowed = re.compile(r"Failed to load resource: the server responded with a status of (%s)" % "|".join(map(str, statuses)))
    return all(allowed.search(error) for error in errors)


# -- the guard ---------------------------------------------------------------------------------------


def test_the_page_is_public_and_every_api_call_needs_the_token(site: Site) -> None:
    page = httpx.get(f"{site.url}/")
    assert page.status_code == 200 and 'content="yes"' in page.text  # the page knows to ask for the token
    for asset in ("core.js", "generate.js", "datasets.js", "train.js", "video.js", "kept.js", "app.js", "app.css"):
        assert httpx.get(f"{site.url}/static/{asset}").status_code == 200
    for path in ("/v1/families", "/v1/roots", "/v1/training/runs", "/static/../v1/families", "/static%2F..%2Fv1/families",
                 "/staticx", "/index.html"):
        response = httpx.get(f"{site.url}{path}")
        assert response.status_code == 401, path
        assert response.json()["error"]["code"] == "unauthorized"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    roots = httpx.get(f"{site.url}/v1/roots", headers=auth).json()
    assert sorted(m["family"] for m in roots["models"]) == ["flux", "ltx2", "sdxl", "wan"]
    assert {d["name"]: (d["images"], d["clips"]) for d in roots["datasets"]} == {
        "corrupt": (3, 0), "shapes": (2, 0), "moving": (1, 2)}
    # The dry run over HTTP: the plan a start would run, or its refusal, with nothing loaded or evicted.
    body = {"base_model": "tiny-sdxl", "dataset_dir": "shapes", "resolution": 64, "steps": 2, "device": "cpu"}
    dry = httpx.post(f"{site.url}/v1/training/plan", json=body, headers=auth, timeout=60)
    assert dry.status_code == 200 and dry.json()["dataset"]["images"] == 2 and dry.json()["memory"]["estimate"]
    doomed = httpx.post(f"{site.url}/v1/training/plan", json={**body, "dataset_dir": "corrupt"}, headers=auth, timeout=60)
    assert doomed.status_code == 400 and "zero.png" in doomed.json()["error"]["message"]
    outside = httpx.post(f"{site.url}/v1/training/plan", json={**body, "dataset_dir": "/etc"}, headers=auth)
    assert outside.json()["error"]["code"] == "path_outside_roots"
    assert site.host.evicted == 0 and site.engine.training.status() is None
    # Each family's plan or why it cannot run here; each training mode not offered, with why.
    plans = httpx.get(f"{site.url}/v1/images/plans", headers=auth, timeout=60).json()
    assert plans["sdxl"]["resolved"] and all("resolved" in p or p["error"]["message"] for p in plans.values())
    training = httpx.get(f"{site.url}/v1/training/info", headers=auth, timeout=60).json()
    assert "needs a CUDA GPU" in training["flux"]["denied_modes"]["bf16"]


# -- pages -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sign_in_then_the_machine_page_lists_every_family_with_reasons(site: Site, open_page: Callable[..., Watched]) -> None:
    watched = open_page()
    page = watched.page
    page.goto(site.url)  # type: ignore[attr-defined]
    assert page.is_visible("#sign-in") and not page.is_visible("#machine")  # type: ignore[attr-defined]
    page.fill("#token", "wrong")  # type: ignore[attr-defined]
    page.click("#sign-in button[type=submit]")  # type: ignore[attr-defined]
    page.wait_for_selector("#sign-in .error:not([hidden])")  # type: ignore[attr-defined]
    assert "unauthorized" in page.inner_text("#sign-in .error")  # type: ignore[attr-defined]
    assert only_refusals(watched.errors, 401) and len(watched.errors) == 1
    watched.errors.clear()
    signed_in(site, watched)
    families = page.eval_on_selector_all(".family", "cards => cards.map(c => c.dataset.family)")  # type: ignore[attr-defined]
    assert {"flux", "qwen_image", "sdxl", "zimage"} <= set(families) and len(families) >= 4
    for family in families:  # each: the plan's decisions with their reasons, or why it cannot run here
        card = f'.family[data-family="{family}"]'
        plan = page.inner_text(f"{card} .plan")  # type: ignore[attr-defined]
        assert page.locator(f"{card} .plan tbody tr").count() > 3 or "cannot run here" in plan, family  # type: ignore[attr-defined]
        assert page.inner_text(f"{card} .modes").strip() or page.inner_text(f"{card} .reason").strip()  # type: ignore[attr-defined]
    assert page.locator('.family[data-family="sdxl"] .plan tbody tr').count() > 3  # type: ignore[attr-defined]
    assert "memory_mode" in page.inner_text('.family[data-family="sdxl"] .plan')  # type: ignore[attr-defined]
    # A mode this CPU machine does not offer is listed with why.
    assert "not offered: FLUX.1 LoRA training needs a CUDA GPU" in page.inner_text('.family[data-family="flux"] .modes')  # type: ignore[attr-defined]
    page.screenshot(path=str(site.shots / "machine.png"))  # type: ignore[attr-defined]
    assert watched.errors == []


@pytest.mark.slow
def test_generate_an_image_from_the_page(site: Site, open_page: Callable[..., Watched]) -> None:
    watched = open_page()
    page = signed_in(site, watched)
    tab(page, "generate")
    pick(page, "#gen-model", site.roots / "models" / "tiny-sdxl")
    page.click("#gen-plan")  # type: ignore[attr-defined]
    page.wait_for_selector("#gen-plan-out table")  # type: ignore[attr-defined]
    assert "sdxl" in page.inner_text("#gen-plan-out h3")  # type: ignore[attr-defined]
    page.fill("#gen-prompt", "a yellow square")  # type: ignore[attr-defined]
    for name, value in (("width", "64"), ("height", "64"), ("steps", "2")):
        page.fill(f"#gen-{name}", value)  # type: ignore[attr-defined]
    page.fill("#gen-seed", "7")  # type: ignore[attr-defined]
    page.click("#gen-go")  # type: ignore[attr-defined]
    page.wait_for_selector("#gallery figure.result figcaption:has-text('64x64')")  # the decoded image's size  # type: ignore[attr-defined]
    caption = page.inner_text("#gallery figure.result figcaption")  # type: ignore[attr-defined]
    assert "a yellow square" in caption and "seed 7" in caption and "64x64" in caption
    link = page.locator("#gallery figure.result a[download]")  # type: ignore[attr-defined]
    assert link.get_attribute("href").startswith("data:image/png;base64,")
    width = page.eval_on_selector("#gallery figure.result img", "img => img.naturalWidth")  # type: ignore[attr-defined]
    assert width == 64  # a real decoded PNG
    assert "100%" in page.get_attribute("#gen-progress > div", "style")  # type: ignore[attr-defined]
    # Progress came over the job's event stream (no fallback polling of the job).
    assert any(re.fullmatch(r"v1/images/jobs/[^/]+/events\?token=.+", url) for url in watched.requests)
    assert not any(re.fullmatch(r"v1/images/jobs/[^/?]+", url) for url in watched.requests)
    page.locator("#gallery").scroll_into_view_if_needed()  # type: ignore[attr-defined]
    page.screenshot(path=str(site.shots / "generate.png"))  # type: ignore[attr-defined]
    assert watched.errors == []
    site.engine.images.unload()


@pytest.mark.slow
def test_render_a_clip_and_play_it_in_the_page(site: Site, open_page: Callable[..., Watched]) -> None:
    """The Video tab lists the video models only, renders through the OpenAI videos API, and
    plays the MP4 in the page's player (decoded by the browser: its size and duration are read back)."""
    watched = open_page()
    page = signed_in(site, watched)
    tab(page, "video")
    pick(page, "#vid-model", site.roots / "models" / "tiny-wan")
    listed = page.eval_on_selector_all("#vid-model option", "os => os.map(o => o.value)")  # type: ignore[attr-defined]
    assert sorted(Path(v).name for v in listed) == ["tiny-ltx2", "tiny-wan"]  # the image models are not offered here
    for name, value in (("frames", "9"), ("fps", "8"), ("size", "64x64"), ("steps", "2")):
        page.fill(f"#vid-{name}", value)  # type: ignore[attr-defined]
    page.click("#vid-go")  # type: ignore[attr-defined]
    page.wait_for_selector("#vid-reel figure.result video")  # type: ignore[attr-defined]
    played = page.eval_on_selector("#vid-reel figure.result video", """v => new Promise((done) => {
        const report = () => done([v.videoWidth, v.videoHeight, Math.round(v.duration * 8)]);
        if (v.readyState >= 1) report(); else v.addEventListener("loadedmetadata", report);
        v.addEventListener("error", () => done(["error", v.error && v.error.code]));
    })""")  # type: ignore[attr-defined]
    assert played == [64, 64, 9], played  # 9 frames at 8 fps, decoded by the browser
    caption = page.inner_text("#vid-reel figure.result figcaption")  # type: ignore[attr-defined]
    assert "9 frames, 64x64, 8 fps" in caption
    assert any(re.fullmatch(r"v1/videos/[^/]+/events\?token=.+", url) for url in watched.requests)
    player = page.locator("#vid-reel figure.result video")  # type: ignore[attr-defined]
    player.scroll_into_view_if_needed()
    page.eval_on_selector("#vid-reel figure.result video", "v => { v.pause(); v.currentTime = 0.5; }")  # type: ignore[attr-defined]
    page.wait_for_function("() => !document.querySelector('#vid-reel video').seeking")  # type: ignore[attr-defined]
    page.screenshot(path=str(site.shots / "video.png"))  # type: ignore[attr-defined]
    box = player.bounding_box()
    from PIL import Image

    shown = Image.open(site.shots / "video.png").convert("L").crop(
        (int(box["x"]) + 2, int(box["y"]) + 2, int(box["x"] + box["width"]) - 2, int(box["y"] + box["height"] * 0.6)))
    low, high = shown.getextrema()
    assert high - low > 8, "the player shows a flat area, not the clip's frame"
    assert watched.errors == []
    site.engine.images.unload()


@pytest.mark.slow
def test_a_clip_with_sound_plays_its_sound_in_the_page(site: Site, open_page: Callable[..., Watched]) -> None:
    """An LTX-2 clip: the player is not muted, the browser decodes its audio track while it plays,
    the caption says what the sound is, and the WAV is offered beside the MP4 (the page muted
    every clip and had nowhere to hear one)."""
    watched = open_page()
    page = signed_in(site, watched)
    tab(page, "video")
    pick(page, "#vid-model", site.roots / "models" / "tiny-ltx2")
    for name, value in (("frames", "9"), ("size", "64x64"), ("steps", "2")):
        page.fill(f"#vid-{name}", value)  # type: ignore[attr-defined]
    page.click("#vid-go")  # type: ignore[attr-defined]
    page.wait_for_selector("#vid-reel figure.result video")  # type: ignore[attr-defined]
    heard = page.eval_on_selector("#vid-reel figure.result video", """v => new Promise((done) => {
        v.addEventListener("error", () => done(["error", v.error && v.error.code]));
        const listen = () => v.play().then(() => setTimeout(() => done([v.muted, v.webkitAudioDecodedByteCount]), 300),
                                           (why) => done(["play refused", String(why)]));
        if (v.readyState >= 2) listen(); else v.addEventListener("canplay", listen, { once: true });
    })""")  # type: ignore[attr-defined]
    assert heard[0] is False and heard[1] > 0, heard  # unmuted, and its audio decoded by the browser
    caption = page.inner_text("#vid-reel figure.result figcaption")  # type: ignore[attr-defined]
    assert "with sound (24 kHz, stereo)" in caption and "Download WAV" in caption
    assert watched.errors == []
    site.engine.images.unload()


@pytest.mark.slow
def test_the_gallery_page_shows_what_was_kept_and_pins_and_deletes(site: Site, open_page: Callable[..., Watched]) -> None:
    """Outputs made through the API are in the Gallery tab with their recipe; Pin and Delete
    there change the gallery itself (the API answers so afterwards)."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    made = httpx.post(f"{site.url}/v1/images/generate", json={
        "prompt": "a kept lighthouse", "model": "tiny-sdxl", "seeds": [11, 12], "steps": 1, "width": 64, "height": 64,
    }, headers=auth, timeout=120).json()["gallery"]
    watched = open_page()
    page = signed_in(site, watched)
    tab(page, "kept")
    for entry in made:
        page.wait_for_selector(f"#kept-grid figure[data-id='{entry}'] img")  # type: ignore[attr-defined]
    card = f"#kept-grid figure[data-id='{made[0]}']"
    caption = page.inner_text(f"{card} figcaption")  # type: ignore[attr-defined]
    assert "a kept lighthouse" in caption and "seed 11" in caption and "64x64" in caption
    width = page.eval_on_selector(f"{card} img", "img => img.naturalWidth")  # type: ignore[attr-defined]
    assert width == 64  # the kept PNG, fetched with the token and decoded
    page.click(f"{card} summary")  # type: ignore[attr-defined]
    assert '"engaged"' in page.inner_text(f"{card} details pre")  # type: ignore[attr-defined]
    page.click(f"{card} button.pin")  # type: ignore[attr-defined]
    page.wait_for_selector(f"#kept-grid figure.pinned[data-id='{made[0]}']")  # type: ignore[attr-defined]
    assert httpx.get(f"{site.url}/v1/gallery/{made[0]}", headers=auth).json()["pinned"] is True
    page.click(f"#kept-grid figure[data-id='{made[1]}'] button.delete")  # type: ignore[attr-defined]
    page.wait_for_selector(f"#kept-grid figure[data-id='{made[1]}']", state="detached")  # type: ignore[attr-defined]
    assert httpx.get(f"{site.url}/v1/gallery/{made[1]}", headers=auth).status_code == 404
    total = httpx.get(f"{site.url}/v1/gallery", headers=auth).json()["total"]
    page.wait_for_function(f"() => document.querySelector('#kept-summary').textContent.startsWith('{total} kept')")  # type: ignore[attr-defined]
    page.screenshot(path=str(site.shots / "gallery.png"))  # type: ignore[attr-defined]
    assert watched.errors == []
    site.engine.images.unload()


def test_the_dataset_manager_uploads_captions_and_deletes_from_the_page(
    site: Site, open_page: Callable[..., Watched], tmp_path: Path
) -> None:
    """The Datasets page over /v1/datasets: a new dataset made by its first upload, thumbnails,
    a caption saved where the trainer reads it, a delete, and a second upload of a name that
    is there refused (409 image_exists) with its code shown."""
    from PIL import Image

    from engine.preflight.dataset import discover_dataset

    for name, colour in (("a.png", "red"), ("b.png", "blue")):
        Image.new("RGB", (48, 40), colour).save(tmp_path / name)
    watched = open_page()
    page = signed_in(site, watched)
    tab(page, "datasets")
    page.wait_for_selector("#ds-list button[data-dataset=shapes]")  # type: ignore[attr-defined]
    assert "2 images, 2 captioned" in page.inner_text("#ds-list")  # type: ignore[attr-defined]
    page.fill("#ds-new-name", "mine")  # type: ignore[attr-defined]
    page.click("#ds-new button[type=submit]")  # type: ignore[attr-defined]
    page.set_input_files("#ds-files", [str(tmp_path / "a.png"), str(tmp_path / "b.png")])  # type: ignore[attr-defined]
    page.click("#ds-upload button[type=submit]")  # type: ignore[attr-defined]
    page.wait_for_selector('#ds-images figure[data-image="b.png"]')  # type: ignore[attr-defined]
    page.wait_for_function("[...document.querySelectorAll('#ds-images img')].every(i => i.naturalWidth > 0)")  # type: ignore[attr-defined]
    assert page.eval_on_selector('#ds-images figure[data-image="a.png"] img', "i => i.naturalWidth") == 48  # type: ignore[attr-defined]
    card = '#ds-images figure[data-image="a.png"]'
    page.fill(f"{card} textarea", "a red square, pixel art")  # type: ignore[attr-defined]
    page.click(f"{card} button:has-text('Save caption')")  # type: ignore[attr-defined]
    page.wait_for_selector(f"{card} div:has-text('saved to a.txt')")  # type: ignore[attr-defined]
    folder = site.roots / "datasets" / "mine"
    assert {i.relative: i.caption for i in discover_dataset(folder).items} == {
        "a.png": "a red square, pixel art", "b.png": ""}
    page.once("dialog", lambda dialog: dialog.accept())  # type: ignore[attr-defined]
    page.click('#ds-images figure[data-image="b.png"] button:has-text("Delete")')  # type: ignore[attr-defined]
    page.wait_for_selector('#ds-images figure[data-image="b.png"]', state="detached")  # type: ignore[attr-defined]
    assert sorted(p.name for p in folder.iterdir()) == ["a.png", "a.txt"]
    page.set_input_files("#ds-files", [str(tmp_path / "a.png")])  # type: ignore[attr-defined]
    page.click("#ds-upload button[type=submit]")  # type: ignore[attr-defined]
    page.wait_for_selector("#datasets .error:not([hidden])")  # type: ignore[attr-defined]
    assert "image_exists" in page.inner_text("#datasets .error")  # type: ignore[attr-defined]
    page.screenshot(path=str(site.shots / "datasets.png"), full_page=True)  # type: ignore[attr-defined]
    assert only_refusals(watched.errors, 409) and len(watched.errors) == 1


def test_the_train_page_offers_the_precisions_of_the_device_chosen(site: Site, open_page: Callable[..., Watched]) -> None:
    """On this CPU machine a FLUX run with Device auto offers nothing (it needs a GPU, and
    says to pick the CPU); with Device cpu the page asks again and offers what trains on
    the CPU, never telling the user to pass device=cpu while it is chosen."""
    watched = open_page()
    page = signed_in(site, watched)
    tab(page, "train")
    pick(page, "#train-base", site.roots / "models" / "tiny-flux")
    page.wait_for_selector("#train-precision label.mode")  # type: ignore[attr-defined]
    assert page.locator("#train-precision input:not([disabled])").count() == 0  # type: ignore[attr-defined]
    assert "device=cpu" in page.inner_text("#train-precision")  # type: ignore[attr-defined]
    # A question asked on Device auto whose answer comes after the CPU's must not bring back
    # the auto offer: hold that answer until the CPU choice is shown, then let it through.
    held: list[object] = []
    stale = lambda url: "v1/training/info" in url and "device=auto" in url and "resolution=96" in url  # noqa: E731
    page.route(stale, lambda route: held.append(route))  # type: ignore[attr-defined]
    page.fill("#train-resolution", "96")  # type: ignore[attr-defined]
    page.press("#train-resolution", "Tab")  # type: ignore[attr-defined]
    page.select_option("#train-device", "cpu")  # type: ignore[attr-defined]
    page.wait_for_selector("#train-precision input:not([disabled])")  # type: ignore[attr-defined]
    assert len(held) == 1
    with page.expect_response(lambda r: stale(r.url)):  # type: ignore[attr-defined]
        held[0].continue_()  # type: ignore[attr-defined]
    page.evaluate("() => new Promise((done) => setTimeout(done, 200))")  # type: ignore[attr-defined]
    assert page.locator("#train-precision input:not([disabled])").count() > 0  # type: ignore[attr-defined]
    assert "Pass device=cpu" not in page.inner_text("#train-precision")  # type: ignore[attr-defined]
    # auto is preselected (the run decides and records it), and the choices are sized from
    # the chosen base's own headers at the Resolution given, not from the real FLUX.1-dev.
    assert page.locator("#train-precision input:checked").get_attribute("value") == "auto"  # type: ignore[attr-defined]
    assert "from its file headers" in page.inner_text("#train-precision")  # type: ignore[attr-defined]
    with page.expect_response(lambda r: "v1/training/info" in r.url and "resolution=128" in r.url):  # type: ignore[attr-defined]
        page.fill("#train-resolution", "128")  # type: ignore[attr-defined]
        page.press("#train-resolution", "Tab")  # type: ignore[attr-defined]
    asked = [url for url in watched.requests if "v1/training/info?device=cpu" in url]
    assert any("base_model=" in url and "tiny-flux" in url and "resolution=128" in url for url in asked), asked
    assert watched.errors == []


def choose_dataset(page: object, name: str, *, images: int) -> None:
    """The Train tab, with the tiny SDXL base and the dataset root's ``name`` picked once listed."""
    tab(page, "train")
    page.wait_for_selector("#train-base option[value$='tiny-sdxl']", state="attached")  # type: ignore[attr-defined]
    page.select_option("#train-base", label="tiny-sdxl (sdxl)")  # type: ignore[attr-defined]
    page.wait_for_selector(f"#train-dataset option[value$='{name}']", state="attached")  # type: ignore[attr-defined]
    page.select_option("#train-dataset", label=f"{name} ({images} images)")  # type: ignore[attr-defined]


def test_clips_are_counted_framed_and_uploaded_from_the_page(
    site: Site, open_page: Callable[..., Watched], tmp_path: Path
) -> None:
    """A folder of clips is "2 clips, 1 image" on the Train page (it said "0 images"), the
    Frames field reaches the run's plan, and the Datasets picker takes an MP4 (it took images only)."""
    watched = open_page()
    page = signed_in(site, watched)
    tab(page, "train")
    pick(page, "#train-base", site.roots / "models" / "tiny-wan")
    page.wait_for_selector("#train-dataset option[value$='moving']", state="attached")  # type: ignore[attr-defined]
    page.select_option("#train-dataset", label="moving (2 clips, 1 image)")  # type: ignore[attr-defined]
    page.fill("#train-resolution", "64")  # type: ignore[attr-defined]
    page.fill("#train-frames", "5")  # type: ignore[attr-defined]
    page.select_option("#train-device", "cpu")  # type: ignore[attr-defined]
    with page.expect_request(lambda r: r.url.endswith("/v1/training/plan")) as asked:  # type: ignore[attr-defined]
        page.click("#train-check")  # type: ignore[attr-defined]
    assert asked.value.post_data_json["frames"] == 5
    page.wait_for_selector("#train-verdict:not([hidden])")  # type: ignore[attr-defined]
    verdict = page.inner_text("#train-verdict")  # type: ignore[attr-defined]
    assert "2 clips, 1 image in" in verdict and "each clip trains as 5 frames at 24" in verdict
    write_clip(tmp_path / "slide.mp4", frames=9, size=(64, 48))
    tab(page, "datasets")
    page.wait_for_selector("#ds-list button[data-dataset=moving]")  # type: ignore[attr-defined]
    assert "2 clips, 1 image" in page.inner_text("#ds-list")  # type: ignore[attr-defined]
    page.click("#ds-list button[data-dataset=moving]")  # type: ignore[attr-defined]
    page.set_input_files("#ds-files", [str(tmp_path / "slide.mp4")])  # type: ignore[attr-defined]
    page.click("#ds-upload button[type=submit]")  # type: ignore[attr-defined]
    page.wait_for_selector('#ds-images figure[data-image="slide.mp4"]')  # type: ignore[attr-defined]
    assert "s clip)" in page.inner_text('#ds-images figure[data-image="slide.mp4"]')  # type: ignore[attr-defined]
    assert "3 clips, 1 image" in page.inner_text("#ds-state")  # type: ignore[attr-defined]
    assert page.get_attribute("#ds-files", "accept").count("video/*") == 1  # type: ignore[attr-defined]
    assert watched.errors == []


def test_a_doomed_start_names_the_bad_file_and_evicts_nothing(site: Site, open_page: Callable[..., Watched]) -> None:
    watched = open_page()
    page = signed_in(site, watched)
    choose_dataset(page, "corrupt", images=3)
    page.fill("#train-resolution", "64")  # type: ignore[attr-defined]
    before = site.host.evicted
    page.click("#train-start")  # type: ignore[attr-defined]
    page.wait_for_selector("#train .error:not([hidden])")  # type: ignore[attr-defined]
    shown = page.inner_text("#train .error")  # type: ignore[attr-defined]
    assert "bad_dataset" in shown and "zero.png" in shown
    assert site.host.evicted == before and site.engine.residency.owner is None
    assert site.engine.training.status() is None
    assert only_refusals(watched.errors, 400) and len(watched.errors) == 1  # the refusal, nothing else


@pytest.mark.slow
def test_train_watch_the_charts_stop_and_get_the_lora(site: Site, open_page: Callable[..., Watched]) -> None:
    watched = open_page()
    page = signed_in(site, watched)
    choose_dataset(page, "shapes", images=2)
    page.fill("#train-steps", "5000")  # type: ignore[attr-defined]
    page.fill("#train-resolution", "64")  # type: ignore[attr-defined]
    page.fill("#train-rank", "2")  # type: ignore[attr-defined]
    page.select_option("#train-device", "cpu")  # type: ignore[attr-defined]
    # every other mode shown disabled, with its reason, once the Device's answer has come back
    page.wait_for_function("document.querySelectorAll('#train-precision input[disabled]').length >= 5")  # type: ignore[attr-defined]
    page.click("#train-check")  # type: ignore[attr-defined]
    page.wait_for_selector("#train-verdict:not([hidden]) table")  # type: ignore[attr-defined]
    assert "2 images" in page.inner_text("#train-verdict")  # type: ignore[attr-defined]
    page.screenshot(path=str(site.shots / "train.png"))  # type: ignore[attr-defined]
    page.click("#train-start")  # type: ignore[attr-defined]
    page.wait_for_selector("#run:not([hidden])")  # type: ignore[attr-defined]
    page.wait_for_function("document.querySelector('.chart[data-metric=loss]')?.dataset.points >= 1")  # type: ignore[attr-defined]
    assert page.get_attribute("#run-facts", "data-status") == "running"  # type: ignore[attr-defined]
    seen = int(page.get_attribute(".chart[data-metric=loss]", "data-points"))  # type: ignore[attr-defined]
    # While it trains, a load is refused (409) and the page says which job holds the engine.
    tab(page, "generate")
    page.wait_for_selector("#gen-model option[value$='tiny-sdxl']", state="attached")  # type: ignore[attr-defined]
    page.click("#gen-load")  # type: ignore[attr-defined]
    page.wait_for_selector("#generate .error:not([hidden]) div")  # type: ignore[attr-defined]
    busy = page.inner_text("#generate .error")  # type: ignore[attr-defined]
    assert "busy" in busy and "held by: training" in busy
    # The dataset it trains on refuses changes while it runs (409 dataset_in_use), on the page too.
    tab(page, "datasets")
    page.click("#ds-list button[data-dataset=shapes]")  # type: ignore[attr-defined]
    page.wait_for_selector("#ds-state:has-text('is training on it')")  # type: ignore[attr-defined]
    page.click('#ds-images figure[data-image="image_000.png"] button:has-text("Save caption")')  # type: ignore[attr-defined]
    page.wait_for_selector("#datasets .error:not([hidden])")  # type: ignore[attr-defined]
    assert "dataset_in_use" in page.inner_text("#datasets .error")  # type: ignore[attr-defined]
    tab(page, "run")
    # The chart gains points as the run goes on.
    page.wait_for_function(f"document.querySelector('.chart[data-metric=loss]')?.dataset.points > {seen}")  # type: ignore[attr-defined]
    for metric in ("lr", "grad_norm"):
        assert int(page.get_attribute(f".chart[data-metric={metric}]", "data-points")) > seen  # type: ignore[attr-defined]
    page.screenshot(path=str(site.shots / "run.png"))  # type: ignore[attr-defined]
    page.click("#run-stop")  # type: ignore[attr-defined]
    page.wait_for_selector("#run-facts[data-status=stopped]")  # type: ignore[attr-defined]
    page.wait_for_selector("#run-files a.lora")  # type: ignore[attr-defined]
    assert page.inner_text("#run-files a.lora").endswith(".safetensors")  # type: ignore[attr-defined]
    with page.expect_download() as download:  # type: ignore[attr-defined]
        page.click("#run-files a.lora")  # type: ignore[attr-defined]
    assert download.value.suggested_filename.endswith(".safetensors")
    assert page.locator("#runs li[data-run] .chart").count() >= 1  # past runs, with their charts  # type: ignore[attr-defined]
    status = site.engine.training.status()
    assert status is not None and status["status"] == "stopped"
    # A run's files are served from its own folder only.
    files = f"{site.url}/v1/training/runs/{status['run_id']}/files"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    listed = [f["path"] for f in httpx.get(files, headers=auth).json()]
    assert any(p.endswith(".safetensors") for p in listed) and "run.json" in listed
    for escape in ("%2E%2E/%2E%2E/models/tiny-sdxl/model_index.json", "..%2F..%2Fmodels%2Ftiny-sdxl%2Fmodel_index.json",
                   "%2Fetc%2Fpasswd", "no-such-file"):
        response = httpx.get(f"{files}/{escape}", headers=auth)
        assert response.status_code == 404 and response.json()["error"]["code"] == "unknown_run_file", escape
    assert httpx.get(f"{site.url}/v1/training/runs/nope/files", headers=auth).json()["error"]["code"] == "unknown_run"
    assert httpx.get(f"{files}/run.json").status_code == 401
    assert only_refusals(watched.errors, 409) and len(watched.errors) == 2  # the busy load and the dataset in use
    assert "v1/training/events?token=" + TOKEN in watched.requests  # the run was followed over its event stream


@pytest.mark.slow
def test_a_run_that_finishes_says_training_complete(site: Site, open_page: Callable[..., Watched]) -> None:
    """A run that reached its last step says "Training complete" in the success colour (the
    earlier system's finished-run marker), not a bare status word."""
    watched = open_page()
    page = signed_in(site, watched)
    choose_dataset(page, "shapes", images=2)
    for name, value in (("steps", "1"), ("resolution", "64"), ("rank", "2")):
        page.fill(f"#train-{name}", value)  # type: ignore[attr-defined]
    page.select_option("#train-device", "cpu")  # type: ignore[attr-defined]
    page.click("#train-start")  # type: ignore[attr-defined]
    page.wait_for_selector("#run-facts[data-status=completed]")  # type: ignore[attr-defined]
    page.wait_for_selector("#run-outcome:not([hidden])")  # type: ignore[attr-defined]
    assert page.inner_text("#run-outcome") == "\u2714 Training complete"  # type: ignore[attr-defined]
    colour = page.eval_on_selector("#run-outcome", "e => getComputedStyle(e).color")  # type: ignore[attr-defined]
    assert colour == "rgb(29, 122, 62)"  # --ok, the success colour
    assert watched.errors == []


@pytest.mark.slow
def test_every_page_at_desktop_and_phone_width(site: Site, open_page: Callable[..., Watched]) -> None:
    for name, viewport in (("desktop", DESKTOP), ("phone", PHONE)):
        watched = open_page(viewport)
        page = signed_in(site, watched)
        for page_name in ("machine", "generate", "kept", "datasets", "train", "run"):
            tab(page, page_name)
            page.wait_for_load_state("networkidle")  # type: ignore[attr-defined]
            assert page.is_visible(f"#{page_name}")  # type: ignore[attr-defined]
            # Nothing wider than the screen: no sideways scrolling on a phone.
            overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")  # type: ignore[attr-defined]
            assert overflow <= 0, (name, page_name, overflow)
            page.screenshot(path=str(site.shots / f"{name}-{page_name}.png"), full_page=True)  # type: ignore[attr-defined]
        assert watched.errors == [], name
    assert len(list(site.shots.glob("phone-*.png"))) == 6
