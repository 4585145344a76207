"""The option grammar of rollout correction (verl's `rollout_is*`, `rollout_rs*`), torch-free: the config
validates with it, rollout_correction.py beside it applies it."""

from __future__ import annotations

IS_LEVELS = ("token", "sequence")
RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)




def parse_is_threshold(spec: float | str) -> tuple[float, float | None]:
    """(upper, lower or None) of a rollout_is_threshold: a number or "U" (TIS), or "L_U" (IcePop)."""
    if isinstance(spec, bool) or not isinstance(spec, int | float | str):
        raise ValueError(f"rollout_is_threshold={spec!r} must be a number or a 'lower_upper' string")
    text = str(spec).strip()
    lower_text, _, upper_text = text.rpartition("_") if "_" in text else ("", "", text)
    try:
        upper = float(upper_text)
        lower = float(lower_text) if lower_text else None
    except ValueError:
        raise ValueError(f"rollout_is_threshold={spec!r} is not a number nor 'lower_upper' numbers") from None
    if not upper > 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"rollout_is_threshold={spec!r} needs 0 < lower <= upper")
    return upper, lower


def parse_rs_options(rollout_rs: str) -> list[str]:
    """The distinct options of a comma-separated rollout_rs, in order; unknown ones refused."""
    options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
    if not options:
        raise ValueError(f"rollout_rs={rollout_rs!r} names no option (one of {', '.join(RS_OPTIONS)})")
    for option in options:
        if option not in RS_OPTIONS:
            raise ValueError(f"rollout_rs option {option!r} is not one of {', '.join(RS_OPTIONS)}")
    return options


def parse_rs_thresholds(
    options: list[str], spec: float | str | None
) -> dict[str, tuple[float | None, float]]:
    """Per option (lower or None, upper): one threshold shared by all options or one per option (commas).
    k1 options take ratio bounds "L_U" (a single U means L = 1/U); the others one upper bound."""
    if spec is None or isinstance(spec, bool):
        raise ValueError(f"rollout_rs_threshold={spec!r} must be given when rollout_rs is set")
    parts = [p.strip() for p in str(spec).split(",") if p.strip()]
    if len(parts) not in (1, len(options)):
        raise ValueError(
            f"rollout_rs_threshold={spec!r} has {len(parts)} values: give one, or one per rollout_rs option "
            f"({len(options)})"
        )
    parts = parts * len(options) if len(parts) == 1 else parts
    out: dict[str, tuple[float | None, float]] = {}
    for option, part in zip(options, parts, strict=True):
        try:
            if option.endswith("k1"):
                lower_text, _, upper_text = part.rpartition("_")
                upper = float(upper_text)
                lower = float(lower_text) if lower_text else 1.0 / upper
            elif "_" in part:
                raise ValueError
            else:
                lower, upper = None, float(part)
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"rollout_rs_threshold {part!r} for {option} is not a valid threshold") from None
        if not upper > 0 or (lower is not None and not 0 < lower <= upper):
            raise ValueError(f"rollout_rs_threshold {part!r} for {option} needs 0 < lower <= upper")
        out[option] = (lower, upper)
    return out
