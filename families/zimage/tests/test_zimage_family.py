"""The zimage plugin: the contract, and its table's specifics."""

from engine.contract.plugins import Registry
from engine.testing import FamilyContract


class TestZImageContract(FamilyContract):
    family_name = "zimage"


def test_zimage_turbo_and_base_defaults(engine_registry: Registry) -> None:
    zimage = engine_registry.family("z-image")
    assert zimage.checkpoint("Tongyi-MAI/Z-Image-Turbo").default_steps == 9
    assert zimage.checkpoint("Tongyi-MAI/Z-Image").default_steps == 20
    assert zimage.checkpoint("/models/z-image-turbo-q8").name == "z-image-turbo"


def test_zimage_bnb_repo_names_the_turbo_base(engine_registry: Registry) -> None:
    zimage = engine_registry.family("zimage")
    assert engine_registry.dense_base(zimage, "someone/Z-Image-Turbo-bnb-4bit") == (
        "Tongyi-MAI/Z-Image-Turbo"
    )


def test_zimage_is_not_fp16_safe(engine_registry: Registry) -> None:
    assert not engine_registry.family("zimage").precision.fp16_safe()
