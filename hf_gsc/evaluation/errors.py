"""The evaluation's input error, in a module of its own so that every layer (the loop, the plan, the models, the
options) raises it without importing the command line."""


class InputError(ValueError):
    """Bad input, found before any expensive work; the message names the argument."""


__all__ = ["InputError"]
