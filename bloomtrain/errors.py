"""The errors every module may raise. A leaf: it imports nothing, so that raising an error never
ties a module to the config, the model or torch."""


class UserError(Exception):
    """An error caused by the user's input or environment. The CLI prints it without a
    traceback, so the message must say what to change."""
