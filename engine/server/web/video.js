// diffusion-engine web page, part 5 of 7: the Video page (a video model's clip, played in the page).
// It speaks the OpenAI-compatible videos API: POST /v1/videos, follow the job, GET its content.
"use strict";

async function loadVideo() {
  const page = $("#video");
  await guarded(page, async () => {
    const [found, info] = await Promise.all([roots(true), api("GET", "/v1/images/info")]);
    const video = (m) => m.family && info.families[m.family] && info.families[m.family].output === "frames";
    fillSelect($("#vid-model"), found.models.filter(video), (m) => `${m.name} (${m.family})`);
    const status = await api("GET", "/v1/images/status");
    $("#vid-loaded").textContent = status.pipeline ? `loaded: ${status.pipeline.model.location}` : "nothing loaded";
  });
}

async function renderVideo(event) {
  event.preventDefault();
  const page = $("#video");
  const go = $("#vid-go");
  go.disabled = true;
  await guarded(page, async () => {
    const bar = $("#vid-progress");
    const status = await api("GET", "/v1/images/status");
    if (!status.pipeline || status.pipeline.model.location !== $("#vid-model").value) {
      progress(bar, 0, 0, "loading");
      await api("POST", "/v1/images/load", { model: $("#vid-model").value });
      $("#vid-loaded").textContent = `loaded: ${$("#vid-model").value}`;
    }
    const body = { prompt: $("#vid-prompt").value, seed: Number($("#vid-seed").value) };
    for (const name of ["frames", "fps", "steps"]) {
      const value = $(`#vid-${name}`).value;
      if (value !== "") body[name] = Number(value);
    }
    if ($("#vid-size").value.trim()) body.size = $("#vid-size").value.trim();
    const created = await api("POST", "/v1/videos", body);
    progress(bar, 0, 0, "queued");
    const job = await followJob({ id: created.id }, (name, data) => {
      if (name === "queued") progress(bar, 0, 0, `queued: position ${data.position}`);
      else progress(bar, data.step, data.steps, `denoising: step ${data.step} of ${data.steps}`);
    }, "videos");
    if (job.state !== "done") throw new ApiError(409, job.error ? job.error.code : job.state,
      job.error ? job.error.message : `the video was ${job.state}`);
    const clip = await api("GET", `/v1/videos/${encodeURIComponent(created.id)}`);
    const url = await blobUrl(`/v1/videos/${encodeURIComponent(created.id)}/content`);
    progress(bar, 1, 1, `done in ${job.seconds} s`);
    // A clip with sound plays it (the player starts unmuted); a silent one stays muted.
    const sound = clip.audio;
    const player = el("video", { src: url, controls: true, loop: true, muted: !sound, playsinline: true });
    player.muted = !sound;
    const caption = `${clip.frames} frames, ${clip.size}, ${clip.fps} fps (${clip.seconds} s), seed ${body.seed}` +
      (sound ? `, with sound (${sound.sample_rate / 1000} kHz, ${sound.channels === 2 ? "stereo" : "mono"})` : "") +
      (clip.snapped ? `; ${clip.snapped}` : "");
    const links = [el("a", { href: url, download: `clip-seed${body.seed}.mp4`, text: "Download MP4" })];
    if (sound) {
      const wav = await blobUrl(`/v1/videos/${encodeURIComponent(created.id)}/content?variant=wav`);
      links.push(" ", el("a", { href: wav, download: `clip-seed${body.seed}.wav`, text: "Download WAV" }));
    }
    const reel = $("#vid-reel");
    $(".muted", reel)?.remove();
    reel.prepend(el("figure", { class: "result" }, player, el("figcaption", {}, el("div", { text: body.prompt }),
      el("div", { class: "muted", text: caption }), ...links)));
  });
  go.disabled = false;
}
