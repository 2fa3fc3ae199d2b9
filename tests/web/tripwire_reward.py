"""A reward module no operator allowed: importing it at all is what the tests must never see."""

IMPORTED = True


def reward_fn(completion: str, answer: str = "", **_: object) -> float:
    return 1.0
