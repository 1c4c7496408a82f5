"""The transformers versions this backend supports, checked when it is registered."""

from __future__ import annotations

SUPPORTED = ">=5.17,<6"  # what the tests cover; pyproject.toml's hf and test extras pin the same range
_LOWEST, _BELOW = (5, 17), (6, 0)


def check_transformers_version(version: str) -> None:
    """ImportError naming the supported range when ``version`` (``transformers.__version__``) is outside it.

    Below 5.17 transformers composes the vision models' masks from other pieces (``token_type_ids_mask_function``
    in 4.x and early 5.x; blocks OR-ed after the sliding window up to 5.16). The cache argument is
    ``past_key_values`` in 5.17 and ``cache`` in later 5.x releases; the backend reads neither. From 6 on, nothing is
    known.
    """
    parts = []
    for piece in version.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece else ""
        if not digits:
            break
        parts.append(int(digits))
    found = tuple(parts + [0] * (2 - len(parts)))
    if not _LOWEST <= found < _BELOW:
        raise ImportError(
            f"attn_implementation='mmsparse' supports transformers {SUPPORTED}; this is transformers {version}. "
            f"Install a supported version: pip install 'transformers{SUPPORTED}'"
        )
