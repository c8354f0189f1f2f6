"""Eager fusions in the denoiser's blocks: modulation and gated residuals as ``torch.addcmul``.

A DiT block spends many small kernels on elementwise glue: the adaptive norm's
modulation ``x * (1 + scale) + shift`` and each gated residual
``h = h + gate * out`` (or ``out = gate * out; h = h + out``) run as two
kernels and a temporary each. ``torch.addcmul(a, b, c)`` computes ``a + b * c``
in one. The rewrite is done on the block's own source (read with ``inspect``,
rewritten as an AST, compiled into a function over the block module's own
globals; nothing is executed at module level): nothing of
diffusers is copied here, and a block whose source changed is never patched
blindly. The family's table names each block class, the methods to rewrite and
how many rewrites it expects (:class:`~engine.contract.family_sections.FusionSite`);
a different count means diffusers changed that block, so it stays as it is,
with the reason.

The patch is per module instance (``module.forward`` and friends set on the
instance), so it is reversible (:func:`unfuse`) and idempotent (a fused module
is not fused again); ``DIFFUSION_ENGINE_EAGER_FUSIONS=0`` turns it off. The
results equal stock up to float rounding: ``addcmul`` rounds once where the two
kernels round twice.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from engine.policy.speed import EAGER_FUSIONS_KILL_SWITCH as KILL_SWITCH  # noqa: F401 - the plan reads it

_FUSED = "_diffusion_engine_fused"


@dataclass(frozen=True)
class FusionReport:
    """What :func:`fuse` did: modules patched, per class, and classes left alone with why."""

    fused: dict[str, int]
    skipped: dict[str, str]

    def to_dict(self) -> dict[str, object]:
        return {"fused": dict(self.fused), "skipped": dict(self.skipped)}


class _AddcmulRewrite(ast.NodeTransformer):
    """The two patterns, as AST rewrites (counted)."""

    def __init__(self) -> None:
        self.count = 0

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:  # noqa: N802 - ast's spelling
        self.generic_visit(node)
        # x * (1 + s) + h  ->  addcmul(h, x, 1 + s)
        if isinstance(node.op, ast.Add) and isinstance(node.left, ast.BinOp) and isinstance(node.left.op, ast.Mult):
            scale = node.left.right
            if _one_plus(scale):
                self.count += 1
                return _addcmul(node.right, node.left.left, scale)
        return node

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:  # noqa: N802
        node.decorator_list = []
        self.generic_visit(node)
        node.body = self._statements(node.body)
        return node

    def _statements(self, body: list[ast.stmt]) -> list[ast.stmt]:
        """``h = h + g * o`` and ``o = g * o`` then ``h = r + o`` (``o`` unused after)."""
        out: list[ast.stmt] = []
        index = 0
        while index < len(body):
            statement = body[index]
            for field in ("body", "orelse"):
                if isinstance(getattr(statement, field, None), list):
                    setattr(statement, field, self._statements(getattr(statement, field)))
            gated = _assign(statement)
            if gated and isinstance(gated[1], ast.BinOp) and isinstance(gated[1].op, ast.Add) \
                    and isinstance(gated[1].right, ast.BinOp) and isinstance(gated[1].right.op, ast.Mult) \
                    and _same(gated[1].left, gated[0]):
                self.count += 1
                product = gated[1].right
                out.append(_assigned(statement, _addcmul(gated[1].left, product.left, product.right)))
                index += 1
                continue
            following = _assign(body[index + 1]) if index + 1 < len(body) else None
            if gated and following and isinstance(gated[1], ast.BinOp) and isinstance(gated[1].op, ast.Mult) \
                    and isinstance(following[1], ast.BinOp) and isinstance(following[1].op, ast.Add) \
                    and _same(following[1].right, gated[0]) \
                    and (_same(following[0], gated[0]) or not _used(gated[0], body[index + 2:])):
                self.count += 1
                out.append(_assigned(body[index + 1], _addcmul(following[1].left, gated[1].left, gated[1].right)))
                index += 2
                continue
            out.append(statement)
            index += 1
        return out


def _one_plus(node: ast.AST) -> bool:
    return (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and isinstance(node.left, ast.Constant)
            and node.left.value == 1)


def _addcmul(a: ast.expr, b: ast.expr, c: ast.expr) -> ast.Call:
    return ast.Call(func=ast.Attribute(value=ast.Name("torch", ast.Load()), attr="addcmul", ctx=ast.Load()),
                    args=[a, b, c], keywords=[])


def _assign(statement: ast.stmt) -> tuple[ast.Name, ast.expr] | None:
    if isinstance(statement, ast.Assign) and len(statement.targets) == 1 and isinstance(statement.targets[0], ast.Name):
        return statement.targets[0], statement.value
    return None


def _assigned(statement: ast.stmt, value: ast.expr) -> ast.stmt:
    assert isinstance(statement, ast.Assign)
    return ast.copy_location(ast.Assign(targets=statement.targets, value=value), statement)


def _same(node: ast.AST, name: ast.Name) -> bool:
    return isinstance(node, ast.Name) and node.id == name.id


def _used(name: ast.Name, statements: Iterable[ast.stmt]) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name.id for s in statements for n in ast.walk(s))


def fused_method(cls: type, method: str) -> tuple[Callable[..., Any] | None, int, str]:
    """``cls.method`` rewritten, the number of rewrites, and why not (when None)."""
    function = cls.__dict__.get(method)
    if not isinstance(function, types.FunctionType):
        return None, 0, f"{cls.__name__}.{method} is not a plain method here"
    if function.__code__.co_freevars:  # super() or a closure: cannot be rebuilt outside its class body
        return None, 0, f"{cls.__name__}.{method} uses a closure (super())"
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError) as exc:
        return None, 0, f"the source of {cls.__name__}.{method} cannot be read ({exc})"
    rewrite = _AddcmulRewrite()
    tree = ast.fix_missing_locations(rewrite.visit(tree))
    # The rewritten ``def`` compiled, and its code object made a function over the block
    # module's own globals, with the original's defaults (the signature is unchanged).
    module_code = compile(tree, f"<{cls.__module__}.{cls.__name__}.{method}, fused>", "exec")
    code = next(c for c in module_code.co_consts if isinstance(c, types.CodeType) and c.co_name == function.__name__)
    namespace = vars(sys.modules[cls.__module__])
    if "torch" not in namespace:
        return None, 0, f"{cls.__module__} does not import torch"
    fused = types.FunctionType(code, namespace, function.__name__, function.__defaults__)
    fused.__kwdefaults__ = function.__kwdefaults__
    return fused, rewrite.count, ""


def fuse(denoiser: torch.nn.Module, sites: Iterable[Any]) -> FusionReport:
    """Patch every module of ``denoiser`` whose class a site names, as the site expects."""
    fused: dict[str, int] = {}
    skipped: dict[str, str] = {}
    by_class = {site.block: site for site in sites}
    prepared: dict[type, dict[str, Callable[..., Any]] | None] = {}
    for module in denoiser.modules():
        site = by_class.get(type(module).__name__)
        if site is None or getattr(module, _FUSED, False):
            continue
        cls = type(module)
        if cls not in prepared:
            prepared[cls] = _prepare(cls, site, skipped)
        methods = prepared[cls]
        if methods is None:
            continue
        for name, function in methods.items():
            setattr(module, name, types.MethodType(function, module))
        setattr(module, _FUSED, tuple(methods))
        fused[cls.__name__] = fused.get(cls.__name__, 0) + 1
    return FusionReport(fused, skipped)


def _prepare(cls: type, site: Any, skipped: dict[str, str]) -> dict[str, Callable[..., Any]] | None:
    methods, count = {}, 0
    for method in site.methods:
        function, rewrites, why = fused_method(cls, method)
        if function is None:
            skipped[cls.__name__] = why
            return None
        methods[method], count = function, count + rewrites
    if count != site.rewrites:
        skipped[cls.__name__] = (f"its source changed: {count} fusible expressions where the family's table "
                                 f"expects {site.rewrites} (left as diffusers wrote it)")
        return None
    return methods


def unfuse(denoiser: torch.nn.Module) -> int:
    """Put every fused module's own methods back; how many modules."""
    restored = 0
    for module in denoiser.modules():
        names = getattr(module, _FUSED, None)
        if names:
            for name in names:
                module.__dict__.pop(name, None)
            delattr(module, _FUSED)
            restored += 1
    return restored
