"""The base class of every error caused by the user's input (configs, files, degrees, launchers).

Commands catch it and print its message as one line with exit code 2. Kept free of heavy imports
so that catching it never pulls in torch or DeepSpeed.
"""


class UserError(ValueError):
    """Bad input; the message says what is wrong and how to fix it."""
