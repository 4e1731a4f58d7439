"""The checks ``EngineConfig`` and its groups run on their values: a bad one is a ``ValueError`` naming the
setting, what it must be, and what it got."""


def require(ok: bool, name: str, requirement: str, value: object) -> None:
    if not ok:
        raise ValueError(f"EngineConfig.{name} must be {requirement}, got {value!r}")


def require_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    require(value in choices, name, f"one of {choices}", value)


def require_at_least_one(name: str, value: int | None) -> None:
    require(value is None or value >= 1, name, "at least 1", value)
