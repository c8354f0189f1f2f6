"""The flux plugin: the family contract, and its figures checked against the sources."""

from engine.hardware.presets import preset
from engine.contract.plugins import Registry
from engine.policy.training import resolve_training_precision
from engine.testing import FamilyContract


class TestFluxContract(FamilyContract):
    family_name = "flux"


def test_flux_sampling_defaults(engine_registry: Registry) -> None:
    flux = engine_registry.family("flux")
    defaults = {c.label: (c.default_steps, c.default_guidance) for c in flux.checkpoints}
    assert defaults == {
        "FLUX.1-dev": (28, 3.5),
        "FLUX.1-schnell": (4, 0.0),
        "FLUX.1-Krea-dev": (28, 4.5),
        "FLUX.1-Kontext-dev": (28, 2.5),
    }


def test_flux_nf4_repo_trains_against_the_dev_base(engine_registry: Registry) -> None:
    flux = engine_registry.family("flux")
    assert engine_registry.dense_base(flux, "someone/FLUX.1-dev-nf4") == "black-forest-labs/FLUX.1-dev"
    assert engine_registry.dense_base(flux, "someone/flux.1-schnell-bnb-4bit") == (
        "black-forest-labs/FLUX.1-schnell"
    )


def test_flux_auto_training_precision_bands(engine_registry: Registry) -> None:
    flux = engine_registry.family("flux")
    h100 = preset("h100")
    pick = lambda free: resolve_training_precision(  # noqa: E731
        engine_registry, flux, h100.replace(free_memory_gb=free), "auto"
    ).value
    assert pick(80.0) == "bf16"  # > 1.5 x 23.8 = 35.7
    assert pick(30.0) == "int8"  # > 1.15 x 23.8 = 27.37
    assert pick(20.0) == "nf4"
    assert pick(None) == "nf4"
