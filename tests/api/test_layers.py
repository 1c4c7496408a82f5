"""The package's layers, bottom to top: a module imports only from its own layer or the ones below it. Device code
(``kernels/``) imports nothing of the host; the mask (``mask/``) sits below the attention passes' plans, arguments
and launchers (``attention/``) and knows none of them.

Read from the source with ``ast`` (imports inside functions count too), so nothing is imported to check it.
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers import REPO
from tests.imports import imported, module_files

# Bottom to top. An entry names a module, or a package and everything in it.
LAYERS: list[tuple[str, list[str]]] = [
    ("kernels: device code of both dialects, the mask rule, the constants they read", ["mmsparse.kernels"]),
    ("runtime: launches with little host work, stream keys, scratch for device-side descriptors",
     ["mmsparse.runtime"]),
    ("checks: the arguments' types and ranges, the sizes one launch takes", ["mmsparse.checks"]),
    ("mask: lengths and segment codes, small int tensors of traced calls", [
        "mmsparse.mask.lengths", "mmsparse.mask.segment_codes", "mmsparse.mask.traced_ints"]),
    ("mask: topology, the torch block classification and the lists' launch order", [
        "mmsparse.mask.topology", "mmsparse.mask.blocks", "mmsparse.mask.code_blocks", "mmsparse.mask.list_order",
    ]),
    ("mask: the builders' launchers", [
        "mmsparse.mask.token_bits", "mmsparse.mask.bit_lists", "mmsparse.mask.code_lists",
    ]),
    ("mask: the mask of a call and its block lists per tile", ["mmsparse.mask.info", "mmsparse.mask"]),
    ("mask: a call's mask built from its arguments, cached by value", ["mmsparse.mask.build"]),
    ("mask: masks of host values kept for traced graphs", ["mmsparse.mask.kept"]),
    ("attention: tiles, Gluon availability, tensor layouts, TMA descriptors, the dropout seed and the mask for tests", [
        "mmsparse.attention.dispatch", "mmsparse.attention.config", "mmsparse.attention.layouts",
        "mmsparse.attention.host_tma", "mmsparse.attention.dropout",
    ]),
    ("attention: the plan", ["mmsparse.attention.plan"]),
    ("attention: the kernels' mask arguments", ["mmsparse.attention.kernel_args"]),
    ("attention: the passes' launchers", [
        "mmsparse.attention.forward", "mmsparse.attention.backward", "mmsparse.attention.gluon_launch",
    ]),
    ("attention: op boundary, custom ops and autograd", [
        "mmsparse.attention.custom_ops", "mmsparse.attention.autograd", "mmsparse.attention",
    ]),
    ("functional API and the reference", ["mmsparse.functional", "mmsparse.reference"]),
    ("modules, integrations, tools", [
        "mmsparse.qkv_module", "mmsparse.nn", "mmsparse.picture", "mmsparse.integrations", "mmsparse.distributed",
        "mmsparse.__main__", "mmsparse.tuning", "mmsparse.recompute", "mmsparse",
    ]),
]


def _module_names() -> dict[str, Path]:
    return module_files(REPO, ("mmsparse",))


def _layer(module: str) -> int:
    """Index of the layer holding ``module``: the longest entry that names it or a package above it."""
    best, found = -1, -1
    for i, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            if (module == entry or module.startswith(entry + ".")) and len(entry) > best:
                best, found = len(entry), i
    assert found >= 0, f"{module} is in no layer: add it to LAYERS"
    return found


def test_every_module_has_a_layer():
    for module in _module_names():
        _layer(module)


def test_no_import_points_upwards():
    modules = _module_names()
    upward = []
    for module, path in sorted(modules.items()):
        for target in sorted(imported(module, path, set(modules))):
            if _layer(target) > _layer(module):
                upward.append(f"{module} ({LAYERS[_layer(module)][0]}) imports {target} "
                              f"({LAYERS[_layer(target)][0]})")
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_the_layer_check_seesimported(tmp_path):
    """The parser finds relative, absolute and from-package imports (a check that sees nothing passes)."""
    modules = _module_names()
    known = set(modules)
    forward = modules["mmsparse.attention.forward"]
    assert "mmsparse.mask.blocks" in imported("mmsparse.attention.forward", forward, known)
    from_package = tmp_path / "from_package.py"  # no module of the package imports a sibling module this way now
    from_package.write_text("from . import dispatch\n")
    assert "mmsparse.attention.dispatch" in imported("mmsparse.attention.forward", from_package, known)
    assert "mmsparse.functional" in imported("mmsparse", modules["mmsparse"], known)
