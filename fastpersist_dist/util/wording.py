"""Counts in messages: "1 problem", "2 problems", never "1 problems"."""


def counted(count: int, noun: str) -> str:
    """``count`` and ``noun``, plural (noun + "s") unless the count is one."""
    return f"{count} {noun}{'' if count == 1 else 's'}"
