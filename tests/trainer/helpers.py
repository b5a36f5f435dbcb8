"""A reward that varies even for an untrained model, so the tiny runs take real gradient steps."""


def digit_reward(completions, **columns):
    """The fraction of characters that are digits."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def zero_reward(completions, **columns):
    """The same reward for every completion: every group has zero variance."""
    return [0.0 for _ in completions]
