"""A reward that varies even for an untrained model, so the tiny runs take real gradient steps."""


def digit_reward(completions, **columns):
    """The fraction of characters that are digits."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def zero_reward(completions, **columns):
    """The same reward for every completion: every group has zero variance."""
    return [0.0 for _ in completions]


# What the rewards below saw, one entry per call; a test that uses them empties it first (monkeypatch.setattr)
CALLS: list[dict] = []
# {call number: signal}: `signalling_reward` sends the signal to its own process during that call (that step)
SIGNAL_AT: dict[int, int] = {}


def signalling_reward(completions, **columns):
    """digit_reward, sending this process a signal during the steps SIGNAL_AT names, as a scheduler would: the
    step is then still in progress. It writes a line to stderr once the signal has been handled."""
    import os
    import sys

    CALLS.append({})
    if len(CALLS) in SIGNAL_AT:
        os.kill(os.getpid(), SIGNAL_AT[len(CALLS)])
        sys.stderr.write(f"the reward of step {len(CALLS)} returns\n")
        sys.stderr.flush()
    return digit_reward(completions)


def question_reward(completions, question, solution, **columns):
    """Needs the prompt's own column and the answer's, by their names; records every keyword it was given."""
    CALLS.append({"question": question, "solution": solution, **columns})
    return [float(len(q) > 0) for q in question]


def word_reward(completions, **columns):
    """Returns words, not numbers."""
    return ["high" for _ in completions]


def short_reward(completions, **columns):
    """One value too few."""
    return [0.0 for _ in completions[1:]]
