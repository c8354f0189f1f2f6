"""Every error code the engine can give: its HTTP status and what it means.

The codes are stable between releases (UIs and HTTP clients switch on them);
this table is their one home. :attr:`engine.errors.EngineError.status`
reads a refusal's HTTP status from it, the server answers with that status,
``docs/errors.md`` is generated from it (``python -m engine.error_catalogue``),
and a test checks that every code raised anywhere in the engine, the
built-in families and the example plugin has a row here, once.

A plugin raising a code of its own gets 400 unless its error class says
otherwise (``status`` on the class).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class ErrorCode:
    code: str
    #: The HTTP status the server answers with.
    status: int
    #: What went wrong, for the docs (the error's own message says which file or flag).
    meaning: str
    #: Where it comes from: a refusal before anything loads, a failure while running, the server.
    when: str = "refused before anything loads"


_RUNTIME = "while loading, generating or training (the job reports it)"
_SERVER = "by the HTTP server, before the engine sees the request"
_RUN = "in a run's record (`runs show`, `GET /v1/training/runs`)"

_ROWS: tuple[ErrorCode, ...] = (
    # -- the request itself (422) --------------------------------------------------------
    ErrorCode("invalid_request", 422, "A value is out of its bounds, of the wrong type or not one of its choices; "
              "the message names the flag (terminal) or the JSON field (HTTP)."),
    ErrorCode("usage", 422, "A command line the terminal's parser cannot take: an unknown flag (named, with the "
              "nearest known one), a missing required flag, a value of the wrong form. Exit status 2.",
              "at the terminal, before anything runs"),
    ErrorCode("invalid_config", 422, "A training config (flags, `--config` file or HTTP body) is incomplete or "
              "holds a value the trainer cannot take."),
    ErrorCode("invalid_path", 422, "A path no file system call could take: a NUL byte, not valid Unicode, or "
              "longer than the system's limits."),
    ErrorCode("invalid_base_precision", 400, "`base_precision` is not one of the training precisions."),
    ErrorCode("invalid_device", 400, "`device` is not one of auto, cuda, cpu."),
    ErrorCode("invalid_dtype", 400, "`dtype` is not one of auto, bf16, fp16, fp32."),
    ErrorCode("invalid_memory_mode", 400, "`memory` is not one of the memory modes."),
    ErrorCode("invalid_image", 400, "An input image (img2img, mask, control, edit, dataset) is missing, not an "
              "image, or beyond the caps (8192 x 8192 px, 256 MB)."),
    ErrorCode("invalid_lora", 400, "A LoRA file holds no LoRA matrices (a full checkpoint, say)."),
    ErrorCode("incompatible_options", 400, "Two options that cannot run together (a quant scheme with a memory "
              "mode, compile with a LoRA mode...); the message names the pair."),
    ErrorCode("incompatible_plan", 400, "A control asked for explicitly conflicts with another explicit one."),
    ErrorCode("sdcpp_unavailable", 400, "`engine=sdcpp` was asked where stable-diffusion.cpp cannot run the load: "
              "a diffusers folder or hub id, a family or file kind it does not read, a companion file missing, "
              "the binding not installed, or LoRAs asked; the message names which."),
    ErrorCode("unsupported_on_sdcpp", 400, "A generate input the sd.cpp engine does not run for the loaded model "
              "(a mask, a ControlNet image, LoRAs); load with `engine=diffusers`."),
    ErrorCode("overridden", 400, "`--strict`: the engine would override a value given explicitly."),
    ErrorCode("output_not_writable", 400, "A run's `output_dir` cannot be written (no folder can be made "
              "there); found at the dry run, before anything loads."),
    ErrorCode("output_exists", 400, "The output file or run folder already holds something; choose another or "
              "pass `--overwrite`."),
    ErrorCode("base_required", 400, "A single denoiser file or GGUF needs a base pipeline for its text encoders "
              "and VAE (`--base`, `base`)."),
    ErrorCode("unsupported_workflow", 400, "The loaded checkpoint does not serve this workflow (img2img, "
              "inpaint, edit, ControlNet)."),
    ErrorCode("invalid_video_shape", 422, "A clip's frame count is off the family's lattice (k * step + "
              "offset) or its range, or its size is not a multiple of the family's or beyond its presets; the "
              "message names the nearest valid counts and the presets."),
    ErrorCode("wrong_output", 400, "A video model asked for images, or an image model for a video "
              "(`engine.videos` / `engine.images`, `--frames`); the message names the right door."),
    ErrorCode("unreadable_output", 500, "The pipeline returned something its family's output kind does not "
              "describe (a plugin's table says images for a video pipeline)."),
    ErrorCode("not_applicable", 400, "The request does not apply to what is loaded."),
    ErrorCode("port_in_use", 409, "`serve --port`: another process listens on that port (checked before a "
              "model loads); stop it or pass another port.", "at the terminal, before anything runs"),
    ErrorCode("empty_token", 400, "`serve --token` (or `DIFFUSION_ENGINE_TOKEN`) is set but empty."),
    ErrorCode("insecure_server", 400, "`serve --host` beyond loopback without a token (pass one, or "
              "`--insecure-no-token`)."),
    ErrorCode("missing_extra", 400, "A command needs an optional extra that is not installed "
              "(`pip install -e '.[server]'`)."),
    # -- names and paths that are not there (404) -----------------------------------------
    ErrorCode("unknown_name", 404, "A name that is not one of the valid ones."),
    ErrorCode("unknown_family", 404, "No installed family has this name or alias (`diffusion-engine families`)."),
    ErrorCode("unknown_checkpoint", 404, "The family has no checkpoint of this name."),
    ErrorCode("unknown_hook", 404, "No hook of the plugin contract has this name (`families --hook`)."),
    ErrorCode("unknown_preset", 404, "No hardware preset has this name (the message lists them)."),
    ErrorCode("gated_repo", 403, "The hub repo is gated: request access on its page (accept the licence), then "
              "add a token this machine uses."),
    ErrorCode("repo_not_found", 404, "The hub has no such repo, or it is private and no token with access is set."),
    ErrorCode("model_not_found", 404, "The model path does not exist, and it is neither a hub repo id nor a "
              "checkpoint name."),
    ErrorCode("dataset_not_found", 404, "The dataset folder does not exist."),
    ErrorCode("lora_not_found", 404, "The LoRA file (or run folder) does not exist."),
    ErrorCode("run_not_found", 404, "No run of this id in the runs folder, and no run folder at that path."),
    ErrorCode("unknown_run", 404, "The server's runs folder holds no run of this id.", _SERVER),
    ErrorCode("unknown_run_file", 404, "The run holds no such file.", _SERVER),
    ErrorCode("gallery_entry_not_found", 404, "No gallery entry of this id (deleted, removed by the gallery's "
              "bounds, or never kept).", _SERVER),
    ErrorCode("unsafe_root", 400, "A folder the engine keeps records in (the gallery under the outputs folder, "
              "the compile cache) is a symlink leading out of its parent, or not a folder; the engine would write "
              "and delete elsewhere. Refused at start."),
    ErrorCode("unreadable_record", 500, "A record the engine reads back (a gallery entry, a run record, a "
              "marker, a manifest) is outside its folder, too large, not JSON or holds a field of the wrong type "
              "or range; the message names the file and the field. A listing skips it and logs this line.",
              "when a record is read back"),
    ErrorCode("no_gallery", 409, "The server keeps no gallery: it was started without an outputs folder.", _SERVER),
    ErrorCode("job_not_found", 404, "No generate job of this id (it finished long ago, or never was).", _SERVER),
    ErrorCode("not_ready", 409, "A video's content was asked for before its job completed (or after its files "
              "were dropped).", _SERVER),
    ErrorCode("no_sound", 404, "A video's sound was asked for (variant=wav), but its model renders silent clips.",
              _SERVER),
    ErrorCode("model_file_missing", 400, "A pipeline folder lacks a component its model_index.json lists."),
    ErrorCode("component_missing", 400, "A pipeline folder lacks a component its family's repos name without "
              "shipping (a gated encoder), and the repo the family takes it from is not in the hub "
              "cache while the hub is offline."),
    ErrorCode("no_tiny_pipeline", 400, "The family provides no tiny pipeline builder."),
    # -- what the model is -----------------------------------------------------------------
    ErrorCode("not_a_pipeline", 400, "A folder that is neither a diffusers pipeline nor a single-file "
              "checkpoint, or a training base that is not a pipeline."),
    ErrorCode("unsupported_format", 400, "A single file holds quantised codes in a publisher's layout the engine "
              "does not read yet (int8 or packed 4-bit tensors): it is never loaded as if its codes were weights."),
    ErrorCode("corrupt_checkpoint", 400, "A weights file is truncated or its header is broken "
              "(an interrupted download)."),
    ErrorCode("corrupt_quantised_model", 400, "A folder stored pre-quantised by `diffusion-engine quantize` does "
              "not hold what its marker says: the marker, a tensor's torchao class, dtype or shape, the model class "
              "in model_index.json, config.json or the marker, or remote code asked for; the message names the file "
              "and the field. Refused before anything is evicted."),
    ErrorCode("base_mismatch", 400, "A single-file or GGUF denoiser whose width is not its base's: the base is "
              "another model's; give the pipeline the file was made from."),
    ErrorCode("sdcpp_files_refused", 400, "stable-diffusion.cpp could not read the model's files (it refused "
              "them or crashed reading them) and diffusers could not take the model over; the message names the "
              "files and holds the library's last log lines."),
    ErrorCode("family_unknown", 400, "The model's family cannot be told from its files or name; give `--family`."),
    ErrorCode("family_mismatch", 400, "The family given disagrees with the model's own files."),
    ErrorCode("gguf_unsupported", 400, "The family cannot load a GGUF transformer (the message says why)."),
    ErrorCode("unsupported_encoder_checkpoint", 400, "A text encoder stored in a form the engine cannot load."),
    ErrorCode("prequantised_base", 400, "A pre-quantised base cannot be trained in the precision asked for."),
    ErrorCode("hub_offline", 400, "A hub model that is not in the local cache, and the hub is offline "
              "(`HF_HUB_OFFLINE`) or does not answer."),
    ErrorCode("download_not_allowed", 400, "A hub model that is not in the local cache, and no consent to "
              "download it (`--allow-download`, `serve --allow-hub`, `Engine(allow_download=True)`)."),
    ErrorCode("hub_not_allowed", 400, "A hub id or checkpoint name sent to a server started without `--allow-hub`."),
    ErrorCode("path_outside_roots", 400, "A path outside the server's configured roots (`..`, an absolute path "
              "elsewhere, a symlink leading out).", _SERVER),
    ErrorCode("path_outside_root", 400, "A dataset file (image or caption) that is a symlink leading out of "
              "the dataset folder."),
    # -- what the machine can do -----------------------------------------------------------
    ErrorCode("bf16_unsupported", 400, "bf16 asked for on a device without native bf16 (a T4, a V100)."),
    ErrorCode("fp16_unsafe", 400, "fp16 compute renders black or fails for this family."),
    ErrorCode("fp16_on_bf16_family", 400, "fp16 mixed precision for a family whose trainer computes in bf16."),
    ErrorCode("no_safe_dtype", 400, "No compute dtype this device runs is safe for this family."),
    ErrorCode("no_native_bf16", 400, "The family trains in bf16 and the device has no native bf16."),
    ErrorCode("needs_cuda", 400, "The request needs a CUDA GPU (pass `--device cpu` to train slowly on the CPU)."),
    ErrorCode("not_enough_cores", 400, "`--gpus N --device cpu` asks for more CPU processes than the machine has "
              "cores."),
    ErrorCode("not_enough_gpus", 400, "`--gpus N` asks for more GPUs than the machine has."),
    ErrorCode("quant_denied", 400, "The family's table denies this quantisation scheme for this purpose, "
              "with the measured reason."),
    ErrorCode("fp8_unsupported", 400, "fp8 needs an Ada / Hopper or newer GPU (sm89+) and a working torchao."),
    ErrorCode("mxfp8_unsupported", 400, "mxfp8 needs a Blackwell GPU (sm100+) and a working torchao."),
    ErrorCode("torchao_unavailable", 400, "int8 / fp8 asked for, and torchao is missing or a stub."),
    ErrorCode("bitsandbytes_unavailable", 400, "nf4 (or 8-bit AdamW) asked for, and bitsandbytes cannot run here."),
    ErrorCode("optimizer_unavailable", 400, "The optimizer asked for cannot run here (8-bit AdamW needs CUDA and "
              "bitsandbytes)."),
    ErrorCode("insufficient_memory", 400, "The job would not fit in the memory this device has, even after "
              "evicting the residents; the message lists what would fit."),
    ErrorCode("not_trainable", 400, "The family's plugin provides no trainer."),
    ErrorCode("stored_scheme_unsupported", 400, "The model is stored pre-quantised in a scheme this machine "
              "cannot compute (nf4 without an NVIDIA GPU, fp8 below sm89, SVDQuant on Hopper...); the message "
              "names what the scheme needs. Load the dense model, or run on such a machine."),
    ErrorCode("prequantised_model", 400, "The model's denoiser is stored pre-quantised in one scheme, and the "
              "request asks for another (or for dense); drop --quant, or load the model it was made from."),
    ErrorCode("parallel_unsupported", 400, "A request asked to run on several GPUs (`--gpus`) in a way that "
              "cannot work: more GPUs than the machine has, a denoiser with no context-parallel plan, CFG "
              "parallel without guidance on every step, a step cache asked beside the split; the message says "
              "what would work."),
    ErrorCode("rank_lost", 500, "A rank of a request split across GPUs died before it finished (killed, out of "
              "memory); the job failed and its other ranks were stopped. The next request starts fresh ranks."),
    ErrorCode("rank_failed", 500, "A rank of a request split across GPUs raised an unexpected error; the "
              "message names the rank and the error."),
    # -- datasets and LoRAs ---------------------------------------------------------------
    ErrorCode("bad_dataset", 400, "A dataset image cannot be decoded, or a caption cannot be read."),
    ErrorCode("empty_dataset", 400, "The dataset folder holds no images or clips."),
    ErrorCode("short_clips", 400, "Dataset clips are shorter than the training window (--frames at the family's "
              "fps); the message names them. Use fewer frames, longer clips, or --short-clips pad."),
    ErrorCode("clips_not_supported", 400, "The dataset holds video clips, but the base's family renders images: "
              "train a video family on clips, or give an image family images."),
    ErrorCode("no_second_expert", 400, "--expert names a high- or low-noise expert, but the base has one "
              "denoiser; drop --expert."),
    ErrorCode("dataset_in_use", 409, "A training run (here, or in another process sharing the runs folder) is "
              "using this dataset; change it when the run has finished."),
    ErrorCode("image_exists", 409, "A dataset already has an image of this name (or the upload names one twice); "
              "delete it first or rename the upload."),
    ErrorCode("image_not_found", 404, "No image of this name in the dataset."),
    ErrorCode("small_images", 400, "`--strict`: images under half the training resolution."),
    ErrorCode("lora_unreadable", 400, "A LoRA file's header cannot be read (truncated, not safetensors)."),
    ErrorCode("lora_not_finite", 400, "A LoRA file holds NaN, infinite or overflowing (2**64 or more) weights."),
    ErrorCode("lora_mismatch", 400, "A LoRA's keys do not land on the model's modules (a LoRA for another "
              "model; the message says which family it looks like)."),
    ErrorCode("unknown_lora_target", 400, "A LoRA target names no layer of the denoiser."),
    # -- training runs ----------------------------------------------------------------------
    ErrorCode("checkpoint_unreadable", 400, "A checkpoint to resume from is missing, malformed or not a "
              "`step-N` folder; it is never unpickled."),
    ErrorCode("resume_mismatch", 400, "The resumed run's recorded settings disagree with the config in a way "
              "a checkpoint cannot honour."),
    ErrorCode("no_checkpoint", 409, "The run to resume wrote no checkpoint."),
    ErrorCode("run_in_progress", 409, "A training run is in progress (in this engine, or another process holds "
              "the runs folder's lock)."),
    ErrorCode("run_not_removable", 409, "The run's folder is a symlink, or holds the runs folder itself; it "
              "is not deleted."),
    ErrorCode("not_training", 409, "No training run is in progress to stop, cancel or wait for."),
    ErrorCode("trainer_machine_mismatch", 400, "The trainer child found another machine than the plan was made "
              "for.", _RUN),
    ErrorCode("ranks_diverged", 400, "The ranks of a multi-GPU run hold different LoRAs.", _RUN),
    ErrorCode("non_finite_loss", 400, "The loss became NaN or infinite; the run stopped before it touched the "
              "LoRA, keeping the last checkpoint.", _RUN),
    ErrorCode("trainer_gone", 400, "The trainer process is gone without a final record (killed, or the "
              "machine restarted).", _RUN),
    ErrorCode("trainer_died", 500, "The trainer process ended without finishing (killed by a signal, or "
              "an exit code); the last checkpoint is kept.", _RUN),
    ErrorCode("nodes_not_joined", 504, "Not every rank of a multi-node run came to node 0's `--main-address` "
              "within `--join-timeout` seconds (default 600): another node was never started, or cannot reach "
              "node 0.", _RUN),
    ErrorCode("node_lost", 500, "A run over several machines (`train --nodes`) lost another node's ranks: that "
              "node died or the link to it broke; this node's ranks were stopped and nothing was saved "
              "after the last checkpoint.", _RUN),
    ErrorCode("trainer_crashed", 500, "The trainer process failed; its record holds the traceback.", _RUN),
    ErrorCode("trainer_start_failed", 500, "The trainer process could not be started.", _RUN),
    ErrorCode("watcher_failed", 500, "The engine could not follow the run; the trainer was stopped.", _RUN),
    ErrorCode("disk_full", 507, "A write failed: the disk is full.", _RUN),
    ErrorCode("write_failed", 500, "A write failed (permissions, a read-only file system).", _RUN),
    # -- jobs and the engine's state (409) ---------------------------------------------------
    ErrorCode("busy", 409, "Another job holds the engine (a load, a generate, a training run); try again when "
              "it is done.", _RUNTIME),
    ErrorCode("too_many_images", 400, "More input images than the checkpoint's edit takes at once."),
    ErrorCode("not_loaded", 409, "No image pipeline is loaded; load one first.", _RUNTIME),
    ErrorCode("not_with_replicas", 409, "A route that would change one replica of a replicated service (`serve "
              "--replicas`): loading or unloading a model, training, dataset edits; the replicas serve their "
              "`--load` model.", _SERVER),
    ErrorCode("replica_lost", 500, "The replica that ran this job stopped serving (killed, crashed); the job "
              "failed with it and another replica takes the next.", _RUNTIME),
    ErrorCode("cancelled", 499, "The generate was cancelled (its client went away, or a cancel was asked for).",
              _RUNTIME),
    # -- while running ----------------------------------------------------------------------
    ErrorCode("load_failed", 500, "The pipeline could not be loaded.", _RUNTIME),
    ErrorCode("sdcpp_failed", 500, "stable-diffusion.cpp refused the files, crashed or ran out of memory, and "
              "diffusers could not take the model over (a single file without `--base`); the message holds the "
              "library's last log lines.", _RUNTIME),
    ErrorCode("sdcpp_stalled", 504, "The stable-diffusion.cpp worker said nothing for its step timeout (a load, or "
              "one step: the library stuck, the process stopped) and was killed; the next generate starts a new one. "
              "`DIFFUSION_ENGINE_SDCPP_STEP_TIMEOUT` sets the seconds (default 900).", _RUNTIME),
    ErrorCode("placement_failed", 500, "The memory plan could not be applied to the loaded pipeline.", _RUNTIME),
    ErrorCode("quantisation_failed", 500, "The quantised build failed and no fallback was possible.", _RUNTIME),
    ErrorCode("canary_failed", 400, "A quantised slice of the model produced non-finite or wrong output on this "
              "machine; refused before eviction.", _RUNTIME),
    ErrorCode("evict_failed", 500, "A resident model could not be evicted.", _RUNTIME),
    ErrorCode("lora_load_failed", 500, "A LoRA could not be applied to the loaded pipeline.", _RUNTIME),
    ErrorCode("lora_adapter_failed", 500, "A LoRA adapter could not be set on the loaded pipeline.", _RUNTIME),
    ErrorCode("hardware_probe_failed", 500, "The machine could not be probed.", _RUNTIME),
    ErrorCode("internal_error", 500, "A failure the engine did not expect; the server logs it.", _RUNTIME),
    ErrorCode("engine_error", 400, "An engine error without a more specific code.", _RUNTIME),
    ErrorCode("preflight_failed", 400, "A preflight refusal without a more specific code."),
    # -- plugins ----------------------------------------------------------------------------
    ErrorCode("plugin_error", 500, "A plugin broke the contract (strict mode)."),
    ErrorCode("plugin_load_failed", 500, "A plugin could not be imported (listed by `families`)."),
    ErrorCode("plugin_object_missing", 500, "A plugin's entry point names an object that is not there."),
    ErrorCode("family_conflict", 500, "Two plugins claim the same family name or alias."),
    # -- the HTTP server ---------------------------------------------------------------------
    ErrorCode("unauthorized", 401, "A bearer token is required and was missing or wrong.", _SERVER),
    ErrorCode("token_required", 400, "`serve --host` beyond loopback without a token: give `--token`, bind "
              "127.0.0.1, or pass `--insecure-no-token`.", "when the server starts"),
    ErrorCode("host_not_allowed", 403, "The Host header names the server by a name it does not answer to "
              "(DNS rebinding); `serve --allow-host NAME`.", _SERVER),
    ErrorCode("cross_origin_refused", 403, "A browser request from another origin to a tokenless server.",
              _SERVER),
    ErrorCode("bad_request", 400, "A request the server cannot read (duplicate headers, say).", _SERVER),
    ErrorCode("not_found", 404, "No such route.", _SERVER),
    ErrorCode("method_not_allowed", 405, "The route does not take this method.", _SERVER),
    ErrorCode("body_too_large", 413, "The request body is larger than `serve --max-body-mb`.", _SERVER),
    ErrorCode("unsupported_media_type", 415, "A tokenless POST that is not JSON.", _SERVER),
    ErrorCode("queue_full", 429, "The generate queue is full; retry after `Retry-After` seconds.", _SERVER),
    ErrorCode("http_error", 400, "Another HTTP-level refusal.", _SERVER),
)

#: Code -> its row.
CATALOGUE: Mapping[str, ErrorCode] = MappingProxyType({row.code: row for row in _ROWS})


def status_of(code: str, default: int = 400) -> int:
    """The HTTP status of ``code`` (``default`` for a code a plugin made up)."""
    row = CATALOGUE.get(code)
    return row.status if row is not None else default


def render() -> str:
    """``docs/errors.md``: every code, its status and meaning, by HTTP status."""
    lines = [
        "# Error codes",
        "",
        "<!-- Generated from engine/error_catalogue.py by `python -m engine.error_catalogue`; do not edit. -->",
        "",
        "Every refusal and failure carries a stable `code` (switch on it; the message is for people and "
        "names the file, flag or field at fault). The CLI prints `error[code]: message` and exits 2; the "
        "HTTP API answers `{\"error\": {\"code\", \"message\"}}` with the status below; Python raises "
        "`engine.errors.EngineError` (its `.code`, `.message` and `.status`). A check that finds several "
        "refusals of one request (a training dry run's missing dataset and the machine's refusal) reports "
        "them together: the first's code, the others in `also` (each `{\"code\", \"message\"}`) and "
        "after `; also error[code]:` in the message.",
        "",
        "| code | HTTP | when | meaning |",
        "|---|---|---|---|",
    ]
    for row in sorted(_ROWS, key=lambda r: (r.status, r.code)):
        lines.append(f"| `{row.code}` | {row.status} | {row.when} | {row.meaning} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from engine.generated_docs import write_page

    return write_page("errors.md", render, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
