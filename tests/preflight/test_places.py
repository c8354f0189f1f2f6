"""The one confinement test every root check shares: symlinks followed, ``..`` removed."""

from __future__ import annotations

from pathlib import Path

from engine.places import within


def test_within_follows_symlinks_and_dot_dots(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    (root / "out").symlink_to(outside)
    (root / "in").symlink_to(root / "a")
    (tmp_path / "link-to-root").symlink_to(root)
    assert within(root, root / "a") and within(root, root / "in" / "x") and within(root, root / "not-yet" / "made")
    assert not within(root, root / "out") and not within(root, root / "out" / "x")
    assert not within(root, root / ".." / "outside") and not within(root, "/etc/passwd")
    assert within(tmp_path / "link-to-root", root / "a")  # the root itself through a link
    assert within(root, root) and not within(root, root, strictly=True)
    assert not within(root, tmp_path / "root-sibling")  # a name that starts alike is not inside
