"""A family plugin written against plugin API 0 (the first release), kept as its author wrote it.

Flat ``FamilySpec`` fields, ``TrainingObjective(runtime_module=...)``, a
``quant_deny`` dict and the ``fp16_compute_safe`` pair: every spelling that
moved in plugin API 1. The engine must still load it (with deprecation
warnings naming the new spellings) and the contract kit must pass it. It is
the worked example's family as it was first written (its runtime module and
tiny pipeline are the example's); the tests block the installed example so
the two do not claim one family.
"""

from collections.abc import Callable, Iterable

from diffusion_engine_sd3 import SD3

from engine.contract.hookspecs import hookimpl
from engine.contract.types import FamilySpec, QuantDeny, TrainingObjective

OLD_SD3 = FamilySpec(
    name="sd3",
    label="Stable Diffusion 3.5 (plugin API 0)",
    architecture="dit",
    pipeline_class="StableDiffusion3Pipeline",
    pipeline_class_names=("StableDiffusion3Pipeline",),
    checkpoints=SD3.checkpoints,
    sizes=SD3.sizes,
    training_dense_gb=4.9,
    lora_targets=("to_q", "to_k", "to_v", "to_out.0"),
    compile_regions=("JointTransformerBlock",),
    fp16_compute_safe=True,
    base_precision_applies=True,
    training_requires_bf16=True,
    quant_deny={"training": (QuantDeny("fp8", "not measured for this family"),)},
    prequantised_patterns=("*bnb-4bit*",),
    tiny_pipeline=SD3.tiny_pipeline,
    capabilities=SD3.capabilities,
    optimization_deny=SD3.speed.optimization_deny,
    training_objective=TrainingObjective(
        prediction="flow_matching", timestep_sampling="logit_normal",
        runtime_module=SD3.runtime_module,
    ),
)


@hookimpl
def engine_register_families(register: Callable[[FamilySpec], None]) -> None:
    register(OLD_SD3)


@hookimpl
def engine_quant_deny(family: FamilySpec, purpose: str) -> Iterable[QuantDeny] | None:
    if family.name != "sd3":
        return None
    # Reading a moved field the old way works too (a hook written for API 0).
    return family.quant_deny.get(purpose, ())
