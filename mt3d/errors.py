"""The base class of every error caused by the user's input (configs, files, degrees, launchers).

Commands catch it and print its message as one line with exit code 2. Kept free of heavy imports
so that catching it never pulls in torch or DeepSpeed.
"""

# Process exit codes shared by `mt3d` commands and `python -m mt3d.train`.
EXIT_OK = 0
EXIT_FAILED = 1  # a bug or a hardware/communication failure: see the traceback in the log
EXIT_BAD_INPUT = 2  # a UserError: the one-line message says what to fix
EXIT_PREEMPTED = 75  # stopped by SIGTERM/SIGINT after saving a checkpoint: resume to continue
EXIT_DIVERGED = 76  # stopped after train.max_bad_steps non-finite steps, last good state saved


class UserError(ValueError):
    """Bad input; the message says what is wrong and how to fix it."""


class CheckpointError(UserError):
    """A checkpoint that must not be used; the message names the file and what to do."""
