// diffusion-engine web page, part 7 of 7: wiring the controls once the page is parsed.
// Every call carries the token the person signed in with (sessionStorage: this tab only).
"use strict";

// -- wiring ----------------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  $("#sign-in").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("#token").value.trim());
    clearError($("#sign-in"));
    start();
  });
  $("#sign-out").addEventListener("click", () => { sessionStorage.removeItem(TOKEN_KEY); location.reload(); });
  document.querySelectorAll("#tabs button").forEach((b) => b.addEventListener("click", () => showTab(b.dataset.tab)));
  $("#gen-plan").addEventListener("click", planModel);
  $("#gen-load").addEventListener("click", () => guarded($("#generate"), loadModel));
  $("#gen-form").addEventListener("submit", generate);
  $("#gen-cancel").addEventListener("click", () => guarded($("#generate"), async () => {
    if (state.job) await api("DELETE", `/v1/images/jobs/${encodeURIComponent(state.job)}`);
  }));
  $("#vid-form").addEventListener("submit", renderVideo);
  $("#ds-new").addEventListener("submit", newDataset);
  $("#ds-upload").addEventListener("submit", uploadImages);
  for (const choice of ["#train-base", "#train-device", "#train-resolution"]) $(choice).addEventListener("change", trainingChoicesChanged);
  $("#train-check").addEventListener("click", () => guarded($("#train"), dryRun));
  $("#train-form").addEventListener("submit", startTraining);
  $("#run-stop").addEventListener("click", () => stopRun(false));
  $("#run-stop-now").addEventListener("click", () => stopRun(true));
  window.addEventListener("error", (event) => showError(document, event.error || new Error(event.message)));
  window.addEventListener("unhandledrejection", (event) => showError(document, event.reason || new Error("unknown failure")));
  start();
});
